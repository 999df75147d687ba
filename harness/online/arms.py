"""Online runs in the session child: one server process per run, driven by the load generator.

For each item of the plan's online order (harness/online/plan.py), on the plan's online device, after
the session's offline arms: start a fresh server of the item's arm (harness/online/process.py; its own
process, engine and natural exit policy on this device), send ``warmup_requests`` untimed requests (the trace's
requests in turn, again from the first where it asks for more), then

- the calibration run: every trace request, closed loop at concurrency B; its completed requests per
  second are the capacity the rates multiply, its p99s the derived SLO (metrics.derived_slo);
- an arm run: the frozen trace open loop at ``rate_multiple`` x capacity (``loadgen.arrivals_s``),

then stop the server and write one raw record ``online/<device>/<seq:05d>-<kind>-<arm>[-r<rate index>-p<pair>].json``
(atomic) with every request's timestamps and tokens and what the server's engine ran with
(``engine_settings``, read once it is healthy: bundle format 10); the server's log sits beside it (same stem, .log).
A server that crashes or never gets healthy raises ``ServerFailed`` with its log tail: the session
fails, and the bundle is incomplete. So does a warmup request that fails (``WarmupFailed``): the timed run's premise
is a warm server, and a cold one's first requests would carry compilation or capture time into the latencies with
nothing in the bundle to say so; a count in the record would still publish figures whose premise failed. The timed
run's own failed requests, by contrast, are the measurement (a request cut off under load is a result) and are
recorded. A device's first session runs the track; a resume's session of that
device runs the runs it left unrecorded (a stop or failure in the middle of the track), so a resume completes it;
the resume first moves a pair's lone run, record and server log, under superseded/ (harness/resume.py, bundle format
15), so that a pair's two runs share one session and the run measured first is kept.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

from ..fileio import atomic_write_json
from . import loadgen, metrics
from .process import ServerProcess, log_tail

RECORD_SCHEMA = 1


class WarmupFailed(RuntimeError):
    """A warmup request of an online run failed; the message names it and ends with the server log's tail."""


def record_stem(item: dict) -> str:
    """The file name stem of an order item's raw record (and of its server log)."""
    stem = f"{item['seq']:05d}-{item['kind']}-{item['arm']}"
    return stem if item["kind"] == "calibration" else f"{stem}-r{item['rate_index']}-p{item['pair']}"


def server_spec(plan: dict, job: dict, arm: str) -> dict:
    """What the server of ``arm`` needs (harness/online/server.py SPEC.json)."""
    cfg = plan["config"]
    return {"checkpoint_path": plan["checkpoint"]["path"], "dtype": cfg["model"]["dtype"], "device": job["device"],
            "arm_config": cfg["arms"][arm], "max_num_seqs": plan["online"]["max_num_seqs"],
            "max_model_len": plan["max_model_len"], "policy": cfg["exit"]["policy"],
            "exit": {k: cfg["exit"][k] for k in ("min_loops", "max_loops", "threshold")}, "host": "127.0.0.1",
            "engine_sources": (plan.get("code") or {}).get("engine_sources", {})}   # the server checks its engine's


def _jobs(online: dict, prompts: list[list[int]]) -> list[loadgen.Job]:
    return [loadgen.Job(r["index"], r["prompt_index"], prompts[r["prompt_index"]], online["max_tokens"])
            for r in online["requests"]]


def calibration_figures(record: dict) -> dict:
    """The calibration run's figures (no SLO): its ``request_rate_rps`` is the capacity."""
    return metrics.run_figures(record["requests"], None)


def _check_warmup(server: ServerProcess, stem: str, warmed: list[loadgen.RequestResult]) -> None:
    """ServerFailed where the server ended during the warmup, WarmupFailed where a warmup request failed (see the
    module docstring); warmup request i (index -1 - i) is the trace's request i modulo its length."""
    server.check("during the warmup")
    bad = [r for r in warmed if r.error is not None]
    if bad:
        first = bad[0]
        raise WarmupFailed(f"online run {stem}: {len(bad)} of {len(warmed)} warmup requests failed, so its timed run "
                           f"would not start on a warm server; the first, warmup request {-1 - first.index} (prompt "
                           f"{first.prompt_index}): {first.error}; last lines of {server.log_path}:\n"
                           f"{log_tail(server.log_path)}")


def run_item(plan: dict, job: dict, item: dict, prompts: list[list[int]], capacity_rps: float | None,
             out_dir: Path) -> dict:
    """One online run of the order; returns its raw record (also written to ``out_dir``)."""
    online = plan["online"]
    jobs = _jobs(online, prompts)
    stem = record_stem(item)
    server = ServerProcess(server_spec(plan, job, item["arm"]), out_dir / f"{stem}.log", online["health_timeout_s"])
    server.start()
    try:
        settings = server.engine_settings()
        if online["warmup_requests"]:   # the trace's requests in turn, from the first again past its end
            warm = [replace(jobs[i % len(jobs)], index=-1 - i) for i in range(online["warmup_requests"])]
            _, warmed = asyncio.run(loadgen.closed_loop(server.url, warm, online["max_num_seqs"],
                                                        online["max_duration_s"]))
            _check_warmup(server, stem, warmed)
        if item["kind"] == "calibration":
            rate_rps = None
            start, results = asyncio.run(loadgen.closed_loop(server.url, jobs, online["calibration"]["concurrency"],
                                                             online["max_duration_s"]))
        else:
            rate_rps = item["rate_multiple"] * capacity_rps
            planned = loadgen.arrivals_s(online["trace"]["unit_arrivals_s"], rate_rps)
            start, results = asyncio.run(loadgen.open_loop(server.url, jobs, planned, online["max_duration_s"]))
        server.check("during the run")
        health = server.health()
    finally:
        exit_code = server.stop()
    record = {"schema": RECORD_SCHEMA, "job": job["name"], "session": job.get("session", job["name"]),
              **{k: item[k] for k in ("seq", "kind", "arm", "rate_index", "rate_multiple", "pair", "position", "slot")},
              "arm_config": plan["config"]["arms"][item["arm"]], "point": online["point"],
              "mode": "closed" if item["kind"] == "calibration" else "open",
              "concurrency": online["calibration"]["concurrency"] if item["kind"] == "calibration" else None,
              "capacity_rps": capacity_rps, "rate_rps": rate_rps, "start_unix_s": start,
              "warmup_requests": online["warmup_requests"], "max_duration_s": online["max_duration_s"],
              "server": {"log": f"{stem}.log", "exit_code": exit_code, "health": health},
              "engine_settings": settings,
              "requests": [r.to_dict() for r in results]}
    atomic_write_json(out_dir / f"{stem}.json", record)
    return record


def recorded_runs(out_dir: Path) -> dict[int, dict]:
    """The online records a session of this device already wrote, by seq (a record is written whole, or not)."""
    return {rec["seq"]: rec for rec in (json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json")))}


def _capacity(calibration: dict, out_dir: Path) -> float:
    """The capacity the rates multiply: the calibration run's completed requests per s; RuntimeError where it
    completed none (in the session that ran it, and in a resume's, before any server starts)."""
    figs = calibration_figures(calibration)
    if not figs["request_rate_rps"]:
        raise RuntimeError(f"the online calibration run completed no request ({figs['failed']} failed): "
                           f"no capacity to scale the rates by; see {out_dir / calibration['server']['log']}")
    return figs["request_rate_rps"]


def track_here(plan: dict, job: dict) -> dict | None:
    """The plan's online track where it runs in this session job (on the track's device), else None."""
    online = plan.get("online")
    return online if online is not None and job["name"] == online["device"] else None


def measure_online(job: dict, log, plan: dict) -> None:
    """The session's online track: every online run of ``plan`` (the bundle's plan.json) not yet recorded, in order
    (nothing without one or on another device). The device's first session records them all; a later one (a
    resume's, after a stop in the middle of the track) runs those left, at the capacity of the recorded calibration
    run."""
    bundle = Path(job["bundle"])
    online = track_here(plan, job)
    if online is None:
        return
    prompts = json.loads((bundle / plan["prompts"]["file"]).read_text())
    out_dir = bundle / "online" / job["name"]
    done = recorded_runs(out_dir)
    capacity = None
    if 0 in done and len(done) < len(online["order"]):   # a resume's session: the recorded calibration run's capacity
        capacity = _capacity(done[0], out_dir)
    for item in online["order"]:
        if item["seq"] in done:
            continue
        rec = run_item(plan, job, item, prompts, capacity, out_dir)
        figs = metrics.run_figures(rec["requests"], None)
        if item["kind"] == "calibration":
            capacity = _capacity(rec, out_dir)
        ttft, rate = figs["p99_ttft_s"], figs["request_rate_rps"]
        log(f"online {item['seq']:3d} {item['kind']:11s} {item['arm']:>14s} rate "
            f"{'closed' if rec['rate_rps'] is None else format(rec['rate_rps'], '.3f') + '/s'}: "
            f"{figs['completed']} done, {figs['failed']} failed, p99 TTFT "
            f"{'n/a' if ttft is None else format(ttft * 1e3, '.1f') + ' ms'}, "
            f"{'n/a' if rate is None else format(rate, '.2f')} req/s")
