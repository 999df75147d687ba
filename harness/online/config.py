"""The online track's configuration: ``OnlineConf`` (the Hydra node ``online``), its rules and frozen spec.

``online: null`` (the default) runs no online track. Set, each bundle's first device runs, after its
offline arms, one native calibration run (closed loop at concurrency B) and then, per rate, ``pairs``
balanced pairs of open-loop runs of ``baseline`` and ``candidate`` on one frozen Poisson trace
(harness/online/plan.py, arms.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class OnlineConf:
    """Online serving track (issue 13): an HTTP server per run, a seeded open-loop Poisson trace.

    ``point``: the plan point (its key, ``B<max_num_seqs>C<num_requests>`` with ``P<prompt_len>`` /
    ``D<output_len>`` where it sets its own) whose batch capacity, prompts and frozen natural reference the
    trace uses (None: the first); ``num_requests`` requests (at most that point's C, so every served request
    has a reference), its first requests on their prompts, of its D tokens each.
    ``rates`` are multiples of the native capacity that the calibration run measures (completed requests
    per s at concurrency B). The SLO is ``slo_ttft_s`` and ``slo_tpot_s`` when both are set, else the
    contract's ``online.slo_factor`` (1.5) x the calibration run's p99 TTFT and p99 TPOT. ``baseline`` /
    ``candidate`` default to the first comparison's arms. Each run is bounded by ``max_duration_s``; a server that is not healthy within
    ``health_timeout_s`` fails its arm.
    """

    point: Optional[str] = None
    num_requests: int = 24
    trace_seed: int = 0
    rates: List[float] = field(default_factory=lambda: [0.5, 1.0])
    pairs: int = 1
    baseline: Optional[str] = None
    candidate: Optional[str] = None
    slo_ttft_s: Optional[float] = None
    slo_tpot_s: Optional[float] = None
    warmup_requests: int = 4
    max_duration_s: float = 300.0
    health_timeout_s: float = 300.0


@dataclass(frozen=True)
class OnlineSpec:
    """A checked ``OnlineConf`` with its defaults filled in (``point``, ``baseline``, ``candidate``)."""

    point: str
    num_requests: int
    trace_seed: int
    rates: tuple[float, ...]
    pairs: int
    baseline: str
    candidate: str
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    warmup_requests: int
    max_duration_s: float
    health_timeout_s: float

    @classmethod
    def from_plain(cls, p: dict | None) -> OnlineSpec | None:
        return None if p is None else cls(**{**p, "rates": tuple(p["rates"])})


def _positive(key: str, value, integer: bool = False) -> None:
    bad = (isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not value > 0
           or not math.isfinite(value))
    if bad:
        raise ValueError(f"{key} must be a positive {'integer' if integer else 'finite number'}, got {value!r}")


def check(plain: dict) -> None:
    """The online rules on the composed config's plain data; fills in the defaults of ``point``,
    ``baseline`` and ``candidate`` (in that private copy). ValueError names key and value."""
    on = plain.get("online")
    if on is None:
        return
    from ..spec import PointSpec    # at call time: spec.py imports this module for OnlineSpec

    points = {PointSpec(**p).key: p for p in plain["points"]}   # keyed as plan.json and `loopbench plan` key them
    on["point"] = next(iter(points)) if on["point"] is None else on["point"]   # '' is a (bad) point, not the default
    if on["point"] not in points:
        raise ValueError(f"online.point = {on['point']!r} is not a point of this run; points are {sorted(points)}")
    for key in ("num_requests", "pairs"):
        _positive(f"online.{key}", on[key], integer=True)
    if on["num_requests"] > points[on["point"]]["num_requests"]:
        raise ValueError(f"online.num_requests = {on['num_requests']} exceeds the {points[on['point']]['num_requests']}"
                         f" requests of point {on['point']}, whose frozen reference checks every served request")
    if isinstance(on["trace_seed"], bool) or not isinstance(on["trace_seed"], int) or on["trace_seed"] < 0:
        raise ValueError(f"online.trace_seed must be a non-negative integer seed, got {on['trace_seed']!r}")
    if not on["rates"]:
        raise ValueError("online.rates must list at least one multiple of the measured capacity")
    for i, rate in enumerate(on["rates"]):
        _positive(f"online.rates[{i}]", rate)
        if rate in on["rates"][:i]:     # one rate's runs would be summarised under both entries
            raise ValueError(f"online.rates[{i}] = {rate!r} is listed twice: {list(on['rates'])}")
    first = plain["comparisons"][0]
    on["baseline"] = first["baseline"] if on["baseline"] is None else on["baseline"]
    on["candidate"] = first["candidate"] if on["candidate"] is None else on["candidate"]
    for key in ("baseline", "candidate"):
        if on[key] not in plain["arms"]:
            raise ValueError(f"online.{key} = {on[key]!r} is not an arm; arms are {sorted(plain['arms'])}")
    if (on["slo_ttft_s"] is None) != (on["slo_tpot_s"] is None):
        raise ValueError("online.slo_ttft_s and online.slo_tpot_s are set together (a declared SLO) or both "
                         f"left null (derived from the calibration run); got {on['slo_ttft_s']!r} and {on['slo_tpot_s']!r}")
    for key in ("slo_ttft_s", "slo_tpot_s"):
        if on[key] is not None:
            _positive(f"online.{key}", on[key])
    own_d = points[on["point"]].get("output_len")
    d_key, d = (f"points[{on['point']}].output_len", own_d) if own_d is not None else \
        ("workload.output_len", plain["workload"]["output_len"])
    if on["slo_ttft_s"] is None and d < 2:
        raise ValueError(f"{d_key} = {d} gives requests of one token, which have no TPOT, so the calibration run "
                         "derives no SLO: declare online.slo_ttft_s and online.slo_tpot_s")
    if isinstance(on["warmup_requests"], bool) or not isinstance(on["warmup_requests"], int) or on["warmup_requests"] < 0:
        raise ValueError(f"online.warmup_requests must be an integer >= 0, got {on['warmup_requests']!r}")
    for key in ("max_duration_s", "health_timeout_s"):
        _positive(f"online.{key}", on[key])
