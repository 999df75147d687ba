"""The checker: every warmup and measured arm must reproduce the frozen reference exactly.

BRIEF section 2: "every warmup and measured arm must reproduce the frozen tokens and exit depths
exactly, with equal work counters", and "measured arms must show zero new captures". A finding names the
session, point, comparison, pair, arm, phase, request and token position; any finding bars every verdict
of the run (the runtime did not do what the protocol assumes, so no timing of it is evidence).

It reads the raw arm records the sessions wrote (plain JSON data, see ``session.py``) and the frozen
references (the reference capture's ``Schedule`` JSON and its work counters); it knows nothing about
how the records were produced. Equal-within-a-pair Graph coverage (replays and fallbacks) is checked
where both arms of a pair have the same Graph settings, since a different eager/graph split changes
the kernels that ran, not just their speed.

Coverage (harness/coverage.py): a record's coverage counts must come from the rows that ran (their
simulated row trace equals the measured run's), else a ``coverage`` finding. A comparison whose arms
differ in layout or prefix tiles but whose workload never reached the paths where they differ gets a
*warning* (:func:`coverage_warnings`): its timing is still evidence of speed, but its bitwise equality
shows nothing about the layouts.
"""
from __future__ import annotations

from dataclasses import dataclass

from loopbench.runtime.api import EngineStats
from loopbench.runtime.schedule import first_difference

WORK_KEYS = EngineStats.WORK_FIELDS   # the runtime's work counters, by name
PHASES = ("warmup", "measured")


@dataclass(frozen=True)
class Finding:
    kind: str            # tokens | exit_depths | requests | work | captures | graph_coverage | trace | coverage | missing
    job: str
    point: str
    comparison: str
    pair: int
    arm: str
    phase: str
    request_id: str | None
    position: int | None
    expected: object
    got: object

    def message(self) -> str:
        where = f"{self.job} {self.point} {self.comparison} pair {self.pair} arm {self.arm!r} {self.phase}"
        if self.request_id is not None:
            where += f" request {self.request_id!r}"
        if self.position is not None:
            where += f" position {self.position}"
        return f"{self.kind}: {where}: expected {self.expected!r}, got {self.got!r}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "job": self.job, "point": self.point, "comparison": self.comparison,
                "pair": self.pair, "arm": self.arm, "phase": self.phase, "request_id": self.request_id,
                "position": self.position, "expected": _jsonable(self.expected), "got": _jsonable(self.got),
                "message": self.message()}


@dataclass(frozen=True)
class CheckReport:
    findings: tuple[Finding, ...]
    arms_checked: int
    phases_checked: int
    requests_checked: int
    tokens_checked: int
    warnings: tuple[str, ...] | None = None   # None: the records carry no coverage (record schema 1)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        out = {"ok": self.ok, "arms_checked": self.arms_checked, "phases_checked": self.phases_checked,
               "requests_checked": self.requests_checked, "tokens_checked": self.tokens_checked,
               "findings": [f.to_dict() for f in self.findings]}
        if self.warnings is not None:
            out["warnings"] = list(self.warnings)
        return out


def _jsonable(x: object) -> object:
    return list(x) if isinstance(x, tuple) else x


def check_phase(record: dict, phase: str, reference: dict) -> list[Finding]:
    """Findings for one phase of one arm record against the frozen reference of its point.

    ``reference``: {"schedule": Schedule JSON data (requests[].request_id/token_ids/exit_depths,
    trace_sha256), "work": the natural capture's work counters}.
    """
    data = record[phase]

    def finding(kind, request_id=None, position=None, expected=None, got=None) -> Finding:
        return Finding(kind, record["job"], record["point"], record["comparison"], record["pair"],
                       record["arm"], phase, request_id, position, expected, got)

    out: list[Finding] = []
    frozen = {r["request_id"]: r for r in reference["schedule"]["requests"]}
    outputs = data["outputs"]
    if set(outputs) != set(frozen):
        out.append(finding("requests", expected=sorted(frozen), got=sorted(outputs)))
    for rid in sorted(set(outputs) & set(frozen)):
        for field in ("token_ids", "exit_depths"):
            diff = first_difference(outputs[rid][field], frozen[rid][field])
            if diff is not None:
                pos, want, got = diff
                out.append(finding("tokens" if field == "token_ids" else "exit_depths", rid, pos, want, got))
    for key in WORK_KEYS:
        want, got = reference["work"].get(key), data["work"].get(key)
        if want is not None and got != want:
            out.append(finding("work", expected={key: want}, got={key: got}))
    want_trace = reference["schedule"].get("trace_sha256")
    if data.get("trace_sha256") is not None and want_trace is not None and data["trace_sha256"] != want_trace:
        out.append(finding("trace", expected=want_trace, got=data["trace_sha256"]))
    return out


def check(records: list[dict], references: dict[str, dict], *, warmup: bool = True,
          natural: set[str] = frozenset()) -> CheckReport:
    """Check every record; ``references`` maps a point key to its frozen reference. Records of the
    ``natural`` comparisons (their own exits, harness/natural.py) are not held to the reference nor to
    equal paired Graph coverage: their divergences and self-consistency are the natural track's report."""
    findings: list[Finding] = []
    phases = requests = tokens = 0
    pairs: dict[tuple, list[dict]] = {}
    for rec in records:
        ref = references.get(rec["point"])
        if ref is None:
            findings.append(Finding("missing", rec["job"], rec["point"], rec["comparison"], rec["pair"],
                                    rec["arm"], "-", None, None, "a frozen reference", None))
            continue
        for phase in PHASES:
            if rec.get(phase) is None:
                if phase == "warmup" and not warmup:
                    continue
                findings.append(Finding("missing", rec["job"], rec["point"], rec["comparison"], rec["pair"],
                                        rec["arm"], phase, None, None, f"a {phase} run", None))
                continue
            if rec["comparison"] in natural:   # counted: runs compared with the frozen references
                continue
            findings += check_phase(rec, phase, ref)
            phases += 1
            requests += len(rec[phase]["outputs"])
            tokens += sum(len(o["token_ids"]) for o in rec[phase]["outputs"].values())
        measured = rec.get("measured")
        findings += _coverage_trace_findings(rec)
        if warmup and measured is not None:
            for key, n in sorted(measured["graphs"].items()):
                if key.endswith("captures") and n != 0:
                    findings.append(Finding("captures", rec["job"], rec["point"], rec["comparison"], rec["pair"],
                                            rec["arm"], "measured", None, None, {key: 0}, {key: n}))
        pairs.setdefault((rec["job"], rec["point"], rec["comparison"], rec["pair"]), []).append(rec)
    for members in pairs.values():
        if len(members) != 2 or any(m.get("measured") is None for m in members) or members[0]["comparison"] in natural:
            continue
        a, b = members
        same_graphs = all(a["arm_config"][k] == b["arm_config"][k] for k in ("cuda_graphs", "graph_cache_size"))
        if same_graphs:
            keys = sorted(k for k in set(a["measured"]["graphs"]) | set(b["measured"]["graphs"])
                          if k.endswith(("replays", "fallbacks")))
            for key in keys:
                if a["measured"]["graphs"].get(key) != b["measured"]["graphs"].get(key):
                    findings.append(Finding(
                        "graph_coverage", b["job"], b["point"], b["comparison"], b["pair"], b["arm"], "measured",
                        None, None, {key: a["measured"]["graphs"].get(key), "arm": a["arm"]},
                        {key: b["measured"]["graphs"].get(key)}))
    warnings = tuple(coverage_warnings(records)) if any("coverage" in r for r in records) else None
    return CheckReport(tuple(findings), len(records), phases, requests, tokens, warnings)


def _coverage_trace_findings(rec: dict) -> list[Finding]:
    """A ``coverage`` finding when the record's counts were derived from rows other than those that ran."""
    cov, measured = rec.get("coverage"), rec.get("measured")
    if cov is None or measured is None or measured.get("trace_sha256") is None:
        return []
    if cov["trace_sha256"] == measured["trace_sha256"]:
        return []
    return [Finding("coverage", rec["job"], rec["point"], rec["comparison"], rec["pair"], rec["arm"], "measured",
                    None, None, {"trace_sha256": measured["trace_sha256"]},
                    {"coverage trace_sha256": cov["trace_sha256"]})]


def coverage_warnings(records: list[dict]) -> list[str]:
    """One line per (job, point, comparison) whose arms differ where the workload never went.

    Arms that differ in ``kv_layout``: a warning when no decode row read a key from a plane below its
    depth (``lower_plane_reads`` all zero: native's copies and alias's resolved reads were never needed)
    or when the alias arm read no key through the exit map. Arms that differ in ``prefix_tiles``: a
    warning when the prefix arm read no tile directly or met no boundary tile. Coverage of each arm is
    taken from its first record of the group (the counts are a function of point and arm).
    """
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if "coverage" in r:
            groups.setdefault((r["job"], r["point"], r["comparison"]), {}).setdefault(r["position"], r)
    out = []
    for (job, point, comp), by_pos in groups.items():
        if set(by_pos) != {"baseline", "candidate"}:
            continue
        arms = sorted(by_pos.values(), key=lambda r: r["position"])
        gaps = []
        if len({a["arm_config"]["kv_layout"] for a in arms}) == 2:
            alias = next(a for a in arms if a["arm_config"]["kv_layout"] == "alias")
            if not any(alias["coverage"]["lower_plane_reads"]):
                gaps.append("no decode row read a key from a plane below its depth")
            if alias["coverage"]["routed_reads"] == 0:
                gaps.append(f"arm {alias['arm']!r} read no key through the exit map")
        if len({bool(a["arm_config"]["prefix_tiles"]) for a in arms}) == 2:
            prefix = next(a for a in arms if a["arm_config"]["prefix_tiles"])
            if prefix["coverage"]["direct_tiles"] == 0:
                gaps.append(f"arm {prefix['arm']!r} read no key tile directly")
            if prefix["coverage"]["boundary_tiles"] == 0:
                gaps.append(f"arm {prefix['arm']!r} met no boundary tile")
        if gaps:
            out.append(f"{job} {point} {comp}: {'; '.join(gaps)}: this comparison does not exercise where "
                       "its arms differ")
    return out
