"""The load generator: an async HTTP client (httpx) that drives the online server with a frozen trace.

- **Trace** (:func:`unit_trace`): seeded Poisson arrivals at rate 1 request/s, i.e. the offsets of
  exponential(1) inter-arrival gaps, the first at 0, by the contract's ``online.trace_rule`` (format 14):
  inversion of uniforms drawn from SHA-256, so no library's version changes the trace of a seed (numpy's
  Generator, which drew it before, does not promise its stream across versions); the plan freezes it with its
  sha256 (:func:`trace_sha256`). At rate r requests/s request i arrives at
  ``unit[i] / r`` (a Poisson process of rate r).
- **Open loop** (:func:`open_loop`): request i is sent at its planned arrival whatever the server is
  doing; its latencies count from that planned time (so a client that falls behind cannot hide queueing,
  the coordinated-omission trap).
- **Closed loop** (:func:`closed_loop`): ``concurrency`` workers, each sending its next request when its
  previous one ended; a request's planned time is when its worker sent it.

Every request streams (SSE) and records, in seconds since the run's start (``time.perf_counter``):
``planned_s``, ``sent_s``, the arrival of every token (``token_times_s``), ``end_s``, the token ids, the
finish reason and a failure (``error``, None when it succeeded). A run is bounded: by the trace's
length, and by ``max_duration_s``, after which requests still open are cancelled (their connections
close, which aborts them on the server) and recorded as failed.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field

from ..fileio import bundle_format

TRACE_MESSAGE = bundle_format()["online"]["trace_message"]
TIMEOUT_ERROR = "timeout: the run's max_duration_s passed"


def unit_trace(num_requests: int, seed: int) -> list[float]:
    """Arrival offsets (s) of ``num_requests`` Poisson arrivals at 1 request/s, the first at 0.0."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    unit = [0.0]
    for i in range(1, num_requests):
        unit.append(unit[-1] - math.log(_uniform(seed, i)))
    return unit


def _uniform(seed: int, index: int) -> float:
    """The trace's ``index``-th uniform in (0, 1] (contract ``online.trace_rule``): 53 bits of a SHA-256 digest, so
    ``(k + 1) / 2**53`` is exact and never 0, whose log would be infinite."""
    digest = hashlib.sha256(TRACE_MESSAGE.format(seed=seed, index=index).encode("utf-8")).digest()
    return ((int.from_bytes(digest[:8], "big") >> 11) + 1) / 2.0 ** 53


def trace_sha256(unit: list[float]) -> str:
    """sha256 of the trace as a JSON list (``repr`` floats, so the hash pins every bit)."""
    return hashlib.sha256(json.dumps([float(t) for t in unit]).encode()).hexdigest()


def arrivals_s(unit: list[float], rate_rps: float) -> list[float]:
    """Planned arrival offsets (s) of ``unit`` at ``rate_rps`` requests/s."""
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps!r}")
    return [t / rate_rps for t in unit]


@dataclass
class RequestResult:
    """One request's timestamps (s since the run's start) and outcome."""

    index: int
    prompt_index: int
    planned_s: float
    sent_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """What to send: request ``index`` with the prompt of ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: list[int]
    max_tokens: int


async def _send(client, url: str, job: Job, res: RequestResult, t0: float) -> None:
    """POST one streaming completion and fill ``res`` as its events arrive."""
    import httpx

    body = {"prompt": job.prompt, "max_tokens": job.max_tokens, "ignore_eos": True, "stream": True}
    res.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = f"server error: {event['error'].get('message')}"
                    break
                now = time.perf_counter() - t0
                choice = event["choices"][0]
                for tok in choice["token_ids"]:
                    res.token_ids.append(int(tok))
                    res.token_times_s.append(now)
                res.finish_reason = choice["finish_reason"] or res.finish_reason
    except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:   # a failed request, never a crash
        res.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:    # the run's time bound: closing the stream aborts it on the server
        res.error = TIMEOUT_ERROR
        raise
    finally:
        res.end_s = time.perf_counter() - t0
        if res.error is None and res.finish_reason is None:
            res.error = "the stream ended without a finish reason"


def _client():
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def _bounded(tasks: list[asyncio.Task], results: list[RequestResult], max_duration_s: float, t0: float) -> None:
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, max_duration_s - (time.perf_counter() - t0)))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for res in results:
        if res.end_s is None or (res.error is None and res.finish_reason is None):
            res.error = TIMEOUT_ERROR
            res.end_s = res.end_s if res.end_s is not None else time.perf_counter() - t0
    for task in done:
        task.result()   # a bug in the client surfaces here, never as a silent failure


async def open_loop(url: str, jobs: list[Job], planned_s: list[float],
                    max_duration_s: float) -> tuple[float, list[RequestResult]]:
    """Send ``jobs[i]`` at ``planned_s[i]`` (s after the start); returns (start as ``time.time()``, results)."""
    if len(jobs) != len(planned_s):
        raise ValueError(f"{len(jobs)} jobs but {len(planned_s)} planned arrivals")
    results = [RequestResult(j.index, j.prompt_index, float(p)) for j, p in zip(jobs, planned_s)]
    async with _client() as client:
        start_unix_s, t0 = time.time(), time.perf_counter()

        async def at_arrival(job: Job, res: RequestResult) -> None:
            await asyncio.sleep(max(0.0, res.planned_s - (time.perf_counter() - t0)))
            await _send(client, url, job, res, t0)
        tasks = [asyncio.create_task(at_arrival(j, r)) for j, r in zip(jobs, results)]
        await _bounded(tasks, results, max_duration_s, t0)
    return start_unix_s, results


async def closed_loop(url: str, jobs: list[Job], concurrency: int,
                      max_duration_s: float) -> tuple[float, list[RequestResult]]:
    """``concurrency`` workers send ``jobs`` in order, each its next when its previous one ended."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    results = [RequestResult(j.index, j.prompt_index, float("nan")) for j in jobs]
    todo = list(zip(jobs, results))
    async with _client() as client:
        start_unix_s, t0 = time.time(), time.perf_counter()

        async def worker() -> None:
            while todo:
                job, res = todo.pop(0)
                res.planned_s = time.perf_counter() - t0
                await _send(client, url, job, res, t0)
        tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(jobs)))]
        await _bounded(tasks, results, max_duration_s, t0)
    for res in results:
        if res.planned_s != res.planned_s:   # never sent (the bound passed first): planned when it stopped
            res.planned_s = res.sent_s = res.end_s
    return start_unix_s, results
