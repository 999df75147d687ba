"""The load generator (harness/online/loadgen.py) and its figures (metrics.py), against a fake server.

The fake server streams ``max_tokens`` tokens 20 ms apart and serves one request at a time, so requests
that arrive together queue: their latencies must count from the planned arrival, not from when the
server got to them.
"""
import asyncio
import json
import socket
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loopbench.harness.online import loadgen, metrics
from loopbench.harness.online.loadgen import TIMEOUT_ERROR

GAP_S = 0.02


def _fake_app() -> Starlette:
    lock = asyncio.Lock()

    async def completions(request):
        body = await request.json()

        async def events():
            async with lock:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(GAP_S)
                    yield "data: " + json.dumps({"choices": [{"token_ids": [i], "finish_reason": None}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"token_ids": [], "finish_reason": "length"}]}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def url():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(_fake_app(), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


def test_the_unit_trace_is_seeded_poisson_from_zero():
    a = loadgen.unit_trace(2000, seed=7)
    assert a == loadgen.unit_trace(2000, seed=7) and a != loadgen.unit_trace(2000, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 0.9 < a[-1] / 1999 < 1.1                          # mean gap 1 s at rate 1
    assert loadgen.trace_sha256(a) == loadgen.trace_sha256(list(a))
    assert loadgen.trace_sha256(a) != loadgen.trace_sha256(a[:-1] + [a[-1] + 1e-12])
    assert loadgen.arrivals_s([0.0, 1.0, 3.0], 4.0) == [0.0, 0.25, 0.75]
    with pytest.raises(ValueError, match="rate_rps must be > 0, got 0"):
        loadgen.arrivals_s(a, 0)
    with pytest.raises(ValueError, match="num_requests must be an integer >= 1, got 0"):
        loadgen.unit_trace(0, 1)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        loadgen.unit_trace(3, -1)


def test_the_unit_trace_follows_the_contracts_rule_without_numpys_generator(monkeypatch):
    """Format 14 (contract online.trace_rule): gap i is -ln((k + 1) / 2**53), k the first 64 bits of SHA-256 of
    online.trace_message shifted right by 11; numpy's Generator, whose stream numpy does not promise across its
    versions, is not used (a default_rng that raises changes nothing)."""
    import hashlib
    import math

    import numpy as np

    from loopbench.audit import contract

    def no_generator(*args, **kwargs):
        raise AssertionError("the trace drew from numpy.random.default_rng")
    monkeypatch.setattr(np.random, "default_rng", no_generator)
    spec = contract.FORMAT["online"]
    assert spec["trace_rule_since"] == 14 <= contract.VERSION
    want = [0.0]
    for i in (1, 2, 3):
        k = int.from_bytes(hashlib.sha256(f"loopbench online trace 5 {i}".encode()).digest()[:8], "big") >> 11
        want.append(want[-1] + -math.log((k + 1) / 2 ** 53))
    assert spec["trace_message"].format(seed=5, index=1) == "loopbench online trace 5 1"
    assert loadgen.unit_trace(4, seed=5) == want


def _jobs(n: int, tokens: int = 3) -> list:
    return [loadgen.Job(i, i, [1, 2, 3], tokens) for i in range(n)]


def test_open_loop_sends_each_request_at_its_planned_arrival(url):
    planned = loadgen.arrivals_s(loadgen.unit_trace(8, seed=1), rate_rps=20.0)
    _, results = asyncio.run(loadgen.open_loop(url, _jobs(8, 1), planned, max_duration_s=30))
    for res, want in zip(results, planned):
        assert res.planned_s == want                          # exactly the trace's arrival at this rate
        assert -0.002 <= res.sent_s - want < 0.25, (res.sent_s, want)   # sent on time (a loaded 2-core box lags)
        assert res.error is None and res.token_ids == [0] and res.finish_reason == "length"


def test_latency_counts_from_the_planned_arrival_when_requests_queue(url):
    _, results = asyncio.run(loadgen.open_loop(url, _jobs(3), [0.0, 0.0, 0.0], max_duration_s=30))
    ttft = sorted(metrics.request_latencies(r.to_dict())["ttft_s"] for r in results)
    # one at a time, 3 tokens of 20 ms each: the k-th served request waited k * 60 ms before its first token
    for k, t in enumerate(ttft):
        assert t >= (3 * k + 1) * GAP_S * 0.9, ttft
    rec = {"planned_s": 1.0, "sent_s": 1.5, "token_times_s": [2.0, 2.5, 3.5], "end_s": 3.6, "error": None}
    lat = metrics.request_latencies(rec)
    assert lat == {"ttft_s": 1.0, "e2e_s": 2.6, "tpot_s": 0.75, "itl_s": [0.5, 1.0]}


def test_closed_loop_keeps_the_concurrency(url):
    _, results = asyncio.run(loadgen.closed_loop(url, _jobs(4, 2), concurrency=2, max_duration_s=30))
    assert all(r.error is None and len(r.token_ids) == 2 for r in results)
    assert all(r.planned_s <= r.sent_s for r in results)
    # two workers: the 3rd and 4th request start only after an earlier one ended
    ends = sorted(r.end_s for r in results[:2])
    assert min(r.sent_s for r in results[2:]) >= ends[0] - 1e-3


def test_a_run_stops_at_its_time_bound_and_counts_open_requests_failed(url):
    t0 = time.perf_counter()
    _, results = asyncio.run(loadgen.open_loop(url, _jobs(3, 40), [0.0, 0.0, 0.0], max_duration_s=0.5))
    assert time.perf_counter() - t0 < 5
    assert [r.error for r in results].count(loadgen.TIMEOUT_ERROR) >= 2
    figs = metrics.run_figures([r.to_dict() for r in results], {"ttft_s": 1.0, "tpot_s": 1.0})
    assert figs["failed"] >= 2 and figs["completed"] + figs["failed"] == 3


def test_run_figures_percentiles_and_goodput():
    reqs = [{"planned_s": 0.0, "token_times_s": [0.1 * (i + 1), 0.1 * (i + 1) + 0.05], "end_s": 0.1 * (i + 1) + 0.06,
             "token_ids": [1, 2], "error": None} for i in range(10)]
    reqs.append({"planned_s": 0.5, "token_times_s": [], "end_s": 0.7, "token_ids": [], "error": "HTTP 500: x"})
    figs = metrics.run_figures(reqs[:10], {"ttft_s": 0.55, "tpot_s": 0.06})
    assert figs["completed"] == 10 and figs["failed"] == 0
    assert figs["p50_ttft_s"] == pytest.approx(0.55) and figs["p99_ttft_s"] == pytest.approx(0.991)
    assert figs["good"] == 5 and figs["duration_s"] == pytest.approx(1.06)
    assert figs["goodput_rps"] == pytest.approx(5 / 1.06)
    assert figs["throughput_tokens_per_s"] == pytest.approx(20 / 1.06)
    assert metrics.derived_slo(figs) == {"ttft_s": pytest.approx(1.5 * 0.991), "tpot_s": pytest.approx(0.075)}
    # the failed request counts as slower than every completed one: p50 of 11 is the 6th TTFT, p99 reaches it
    figs = metrics.run_figures(reqs, {"ttft_s": 0.55, "tpot_s": 0.06})
    assert figs["completed"] == 10 and figs["failed"] == 1
    assert figs["p50_ttft_s"] == pytest.approx(0.6) and figs["p99_ttft_s"] is None and figs["p99_tpot_s"] is None
    assert figs["p99_itl_s"] == pytest.approx(0.05)   # inter-token gaps: the completed requests' only
    assert figs["good"] == 5 and figs["goodput_rps"] == pytest.approx(5 / 1.06)
    with pytest.raises(ValueError, match="reaches a failed request"):
        metrics.derived_slo(figs)


def test_timed_out_requests_are_not_dropped_from_the_latency_percentiles():
    """Censoring: of two runs of the same 64 requests, the one whose 6 slowest requests timed out (no first token
    by the run's bound) had, with them dropped, a p99 TTFT of 0.5743 s and a p50 of 0.295 s against 0.6337 s and
    0.325 s for the run that served them all: it looked faster. Now its p99 is n/a and its p50 the same 0.325 s."""
    ttfts = [0.01 * (i + 1) for i in range(64)]

    def req(t, error=None):
        return {"planned_s": 0.0, "token_times_s": [] if error else [t, t + 0.01], "end_s": 9.0 if error else t + 0.02,
                "token_ids": [] if error else [1, 2], "error": error}
    served = metrics.run_figures([req(t) for t in ttfts], None)
    censored = metrics.run_figures([req(t) for t in ttfts[:58]] + [req(0, TIMEOUT_ERROR)] * 6, None)
    assert served["p99_ttft_s"] == pytest.approx(0.6337)
    assert censored["failed"] == 6 and censored["p99_ttft_s"] is None
    assert censored["p50_ttft_s"] == pytest.approx(served["p50_ttft_s"])   # the 32.5th of 64 either way
    assert metrics.censored_percentile(ttfts[:58], 6, 90) == pytest.approx(0.577)
    assert metrics.censored_percentile(ttfts[:58], 6, 91) is None    # rank 57.33 of 0..63 leans on rank 58
    assert metrics.censored_percentile(ttfts, 0, 99) == metrics.percentile(ttfts, 99)
    assert metrics.censored_percentile([], 3, 50) is None


def test_a_pair_whose_percentile_reached_a_failed_request_is_not_dropped_from_the_paired_medians():
    """A censored (None) p99 is unknown and may be the worst: the medians over pairs that include it are None, not
    the median of the other pairs (which kept only the pairs whose candidate did not time out)."""
    def run(p99):
        return {fig: 1.0 for fig in metrics.PAIRED_FIGURES} | {"p99_ttft_s": p99}
    figs = metrics.paired_figures([{"baseline": run(1.0), "candidate": run(0.5)},
                                   {"baseline": run(1.0), "candidate": run(None)}])
    p99 = figs["p99_ttft_s"]
    assert p99["ratios"] == [0.5] and p99["ratio_median"] is None and p99["candidate_median"] is None
    assert p99["baseline_median"] == 1.0 and figs["p50_ttft_s"]["ratio_median"] == 1.0
