"""The independent auditor: re-derive everything a bundle claims from the bundle alone.

It reads files (JSON, parquet, markdown) and imports nothing from ``loopbench.harness``: what each
table, summary field and report line must be is re-derived by :mod:`.derive` and :mod:`.render` from
the raw arm records and the plan, so a bug in the harness cannot vouch for itself. Each failure below
becomes one named discrepancy; a file that cannot be read is one too, never a crash.

1. files: the bundle holds only files of the layout contract ``loopbench/bundle_layout.json`` (the
   version its manifest records; dotfiles included) and every file that contract requires; the manifest
   lists every file in the bundle (dotfiles included) with its sha256 and size, and nothing else;
2. raw records: each parses, has the record's fields, and sits at ``raw/<job>/<seq>-...json``;
3. plan: the config's, prompts' and references' sha256s; every frozen reference fits the prompts;
4. order: the seeded balanced order (first arm ceil/floor per comparison, the same numpy
   permutation); every record at its planned place with its planned arm, point and workload, measured
   in that order;
5. devices: each record's device is its session's device in the plan and in children.json;
   sessions: every child ended (none still ``running``); each record names a session child of its job,
   a pair is measured by one session, a job's sessions follow each other in its order, and a completed
   session measured exactly the seqs its job file asked for;
6. tables: every column of every row of arms, pairs, requests, tokens and telemetry equals what the
   raw records give, and no row is missing or extra; tokens/s = C * D / elapsed_s; each measured
   elapsed_s lies within its record's wall-clock span;
7. references: every warmup and measured arm reproduces its frozen reference token for token and
   exit for exit, with the reference's work counters and row trace, zero measured Graph captures and
   equal Graph coverage within a pair;
8. coverage: each record of schema 2 carries the coverage counts that the auditor derives itself from
   the frozen schedule and the arm's config (:mod:`.coverage`), whose row trace must be the frozen one;
9. summary: every field re-derived (status, reasons, counts, checks, children, verdict rule, and per
   comparison the names, pairs, tokens/s, ratios, speedup, CIs, Wilcoxon p, verdict and its reason);
   complete or incomplete follows from children.json's structured fields (the latest entry per child:
   its state, exit code and ``interrupted_by``) and the records, never from the summary's sentences;
10. report: ``report.md`` equals, line for line, the auditor's own rendering of the re-derived figures
   (no extra, hidden or edited line; no raw HTML).

The verdict goes to ``audit.json`` in the bundle (outside the manifest by design) and the exit status:
0 pass, 1 discrepancies, 3 consistent but incomplete (an honest partial run: nothing to vouch for).
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import scipy

from . import coverage, derive, render


def _bundle_layout() -> dict:
    """The bundle layout contract ``loopbench/bundle_layout.json``: the one written list of a bundle's files,
    which the harness writes by and this auditor checks against (STYLE rule 10)."""
    return json.loads(resources.files("loopbench").joinpath("bundle_layout.json").read_text())


AUDITOR_VERSION = 3
LAYOUT = _bundle_layout()
UNMANIFESTED = tuple(LAYOUT["unmanifested"])
TABLES = tuple(LAYOUT["tables"])
WORK_KEYS = ("rows_per_depth", "prefill_tokens", "prefill_rows", "decode_tokens", "steps", "decode_steps")
# A measured run is timed by time.perf_counter inside the record's wall-clock span (time.time, read just
# outside it), so an honest span exceeds elapsed_s by the set-up between the reads. On Linux both clocks
# (CLOCK_MONOTONIC, CLOCK_REALTIME) run at the same NTP-slewed rate; the tolerance covers the rounding of
# unix-second floats (~2e-7 s) and clock resolution with a wide margin. Only a step of the system clock
# during a run could trip it honestly, and such a span could not vouch for the timing anyway.
WALL_CLOCK_ABS_TOL_S = 1e-3
WALL_CLOCK_REL_TOL = 1e-3
REL_TOL = 1e-9
MAX_PER_KIND = 20
HTML = re.compile(r"<\s*[A-Za-z!/?]")
ABSENT = object()

# A raw arm record's fields and their JSON types (``session.py`` writes them; bool is never an int here).
RECORD_FIELDS = {"job": str, "seq": int, "point": str, "comparison": str, "pair": int, "position": str, "slot": int,
                 "arm": str, "arm_config": dict, "device": dict, "max_num_seqs": int, "num_requests": int,
                 "output_len": int, "tokens_per_s": (int, float), "measured": dict}
PHASE_FIELDS = {"elapsed_s": (int, float), "graphs": dict, "memory": dict, "outputs": dict, "work": dict,
                "kv_blocks_used": int}
OUTPUT_FIELDS = {"token_ids": list, "exit_depths": list, "finish_reason": str}
COVERAGE_FIELDS = {"exits_per_depth": list, "lower_plane_reads": list, "routed_reads": int, "direct_tiles": int,
                   "boundary_tiles": int, "boundary_last_key": int, "fill_token_planes": int, "padding_rows": int,
                   "trace_sha256": str}


# ------------------------------------------------------------------------------------------ values

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _prompt_sha256(ids: list[int]) -> str:
    # The schedule format's prompt hash: sha256 of the JSON list of ints in json.dumps' default spelling.
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()


def _plain(value: Any) -> Any:
    """A parquet or JSON value as plain Python: numpy scalars and arrays unwrapped, NaN and NA as None."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _same(got: Any, want: Any) -> bool:
    """Equal as data: ints exactly, floats to REL_TOL, bools only to bools, lists and dicts item by item."""
    got, want = _plain(got), _plain(want)
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        if isinstance(got, int) and isinstance(want, int):
            return got == want
        return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=0.0)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return set(got) == set(want) and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def _field_diffs(got: Any, want: Any, path: str) -> list[tuple[str, Any, Any]]:
    """(path, got, want) for every leaf where two JSON documents differ; ABSENT marks a missing key."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in list(want) + [k for k in got if k not in want]:
            out += _field_diffs(got.get(key, ABSENT), want.get(key, ABSENT), f"{path}.{key}" if path else str(key))
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _field_diffs(g, w, f"{path}[{i}]")]
    if got is ABSENT or want is ABSENT or not _same(got, want):
        return [(path, got, want)]
    return []


def _line_diffs(got: list[str], want: list[str]):
    """(index in ``got``, got line or None, wanted line or None) for each line that differs."""
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=got, b=want, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            g = got[i1 + k] if i1 + k < i2 else None
            w = want[j1 + k] if j1 + k < j2 else None
            yield (i1 + k if g is not None else min(i2, len(got) - 1)), g, w


def _where(keys: tuple, values: tuple) -> str:
    """A table row's key in words: 'cpu0 seq 3 measured request r0001 position 2'."""
    labels = {"seq": "seq ", "pair": "pair ", "request_id": "request ", "position": "position "}
    return " ".join(f"{labels.get(k, '')}{_plain(v)}" for k, v in zip(keys, values))


def _fields_problem(data: dict, fields: dict, where: str) -> str | None:
    for key, kind in fields.items():
        value = data.get(key, ABSENT)
        if value is ABSENT:
            return f"{where}{key} is missing"
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{where}{key} is {value!r}"
    return None


def _phase_problem(data: Any, phase: str) -> str | None:
    if not isinstance(data, dict):
        return f"{phase} is {data!r}"
    problem = _fields_problem(data, PHASE_FIELDS, f"{phase}.")
    if problem is not None:
        return problem
    if not data["elapsed_s"] > 0:
        return f"{phase}.elapsed_s is {data['elapsed_s']!r}"
    for rid, out in data["outputs"].items():
        if not isinstance(out, dict):
            return f"{phase}.outputs.{rid} is {out!r}"
        problem = _fields_problem(out, OUTPUT_FIELDS, f"{phase}.outputs.{rid}.")
        if problem is not None:
            return problem
    return None


def _record_problem(rec: Any) -> str | None:
    """Why ``rec`` is not a raw arm record (a field missing or of the wrong JSON type), or None."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    problem = _fields_problem(rec, RECORD_FIELDS, "")
    if problem is not None:
        return problem
    if rec["position"] not in ("baseline", "candidate"):
        return f"position is {rec['position']!r}"
    if not isinstance(rec["device"].get("label"), str):
        return "device.label is missing"
    for phase in derive.PHASES:
        if phase == "warmup" and rec.get(phase) is None:  # a run without warmup
            continue
        problem = _phase_problem(rec.get(phase), phase)
        if problem is not None:
            return problem
    return _coverage_problem(rec)


def _coverage_problem(rec: dict) -> str | None:
    """Records of schema 2 and later carry ``coverage``; schema 1 (bundles before it) has none."""
    schema = rec.get("schema", 1)
    if isinstance(schema, bool) or not isinstance(schema, int):
        return f"schema is {schema!r}"
    if schema < 2:
        return "coverage is in a schema-1 record" if "coverage" in rec else None
    cov = rec.get("coverage")
    if not isinstance(cov, dict):
        return f"coverage is {cov!r}"
    return _fields_problem(cov, COVERAGE_FIELDS, "coverage.")


def _record_file_name(rec: dict) -> str:
    return f"{rec['seq']:05d}-{rec['point']}-{rec['comparison']}-p{rec['pair']}-{rec['position']}.json"


# ---------------------------------------------------------------------------------- bundle layout

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _device_sessions(devices: list[str], ran: set[str]) -> list[str]:
    """The ids in ``ran`` of a device's session: its name (a bundle's first run) or ``<name>.r<k>`` (k-th resume)."""
    def of_device(sid: str) -> bool:
        name, sep, k = sid.rpartition(".r")
        return sid in devices or (bool(sep) and name in devices and k.isdigit())
    return sorted(s for s in ran if of_device(s))


def layout_domains(plan: dict, ran: set[str]) -> dict[str, dict[str, list[str] | None]]:
    """Per ``required`` condition of the layout contract, the values each placeholder takes in this bundle
    (None: any one path segment). ``ran``: the sessions that children.json or a raw record shows ran."""
    devices = [d["name"] for d in plan.get("devices", [])]
    anywhere = {"point": [pt["key"] for pt in plan.get("points", [])], "device": devices,
                "session": sorted(set(devices) | set(_device_sessions(devices, ran))),
                "reference_device": devices[:1], "table": list(LAYOUT["tables"]), "record": None}
    return {"always": anywhere, "optional": anywhere,
            "point_with_reference": {**anywhere, "point": [pt["key"] for pt in plan.get("points", [])
                                                           if pt.get("reference")]},
            "session_ran": {**anywhere, "device": [d for d in devices if d in ran],
                            "session": _device_sessions(devices, ran)}}


def layout_required(plan: dict, ran: set[str]) -> list[str]:
    """Every path the layout contract requires of this bundle, in the contract's order."""
    domains, out = layout_domains(plan, ran), []
    for entry in LAYOUT["files"]:
        if entry["required"] == "optional":
            continue
        paths = [entry["path"]]
        for name in _PLACEHOLDER.findall(entry["path"]):
            values = domains[entry["required"]][name]
            if values is None:
                raise ValueError(f"the layout contract requires {entry['path']!r}, whose {{{name}}} has no listed values")
            paths = [p.replace(f"{{{name}}}", v, 1) for p in paths for v in values]
        out += paths
    return out


def _layout_pattern(template: str, domain: dict[str, list[str] | None]) -> re.Pattern:
    rx = ""
    for part in re.split(r"(\{\w+\})", template):
        m = _PLACEHOLDER.fullmatch(part)
        if m is None:
            rx += re.escape(part)
        elif domain[m.group(1)] is None:
            rx += "[^/]+"
        else:
            rx += "(?:" + "|".join(re.escape(v) for v in domain[m.group(1)]) + ")" if domain[m.group(1)] else "(?!)"
    return re.compile(rx)


def layout_strays(bundle: Path, plan: dict, sessions: set[str] = frozenset()) -> list[str]:
    """Every file in ``bundle`` (dotfiles included) that matches no path of the layout contract;
    ``sessions``: the session ids children.json and the records name (a resume's job and log files)."""
    domain = layout_domains(plan, set(sessions))["optional"]
    patterns = [_layout_pattern(entry["path"], domain) for entry in LAYOUT["files"]]
    rels = [p.relative_to(bundle).as_posix() for p in sorted(Path(bundle).rglob("*")) if p.is_file()]
    return [rel for rel in rels if not any(rx.fullmatch(rel) for rx in patterns)]


class Audit:
    """Collects discrepancies; each check runs even when an earlier one failed."""

    def __init__(self, bundle: Path):
        self.bundle = Path(bundle)
        self.discrepancies: list[str] = []
        self._counts: dict[str, int] = {}
        self.checked: dict[str, int] = {}

    def fail(self, kind: str, message: str) -> None:
        n = self._counts.get(kind, 0) + 1
        self._counts[kind] = n
        if n <= MAX_PER_KIND:
            self.discrepancies.append(f"{kind}: {message}")
        elif n == MAX_PER_KIND + 1:
            self.discrepancies.append(f"{kind}: further discrepancies of this kind not listed")

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def section(self, name: str, fn, *args) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # a bundle too broken to check is a discrepancy, not a crash
            self.fail(name, f"could not be checked: {type(exc).__name__}: {exc}")
            return None

    # ------------------------------------------------------------------------------------ loading
    def read_json(self, rel: str, kind: str = "files") -> Any:
        """The parsed file, or None: a missing file is named by :meth:`check_required_files`, an unreadable
        one here."""
        path = self.bundle / rel
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except Exception as exc:
            self.fail(kind, f"{rel} could not be read: {type(exc).__name__}: {exc}")
            return None

    def load_records(self) -> list[dict]:
        """Every file under raw/ must be one arm record at
        raw/<job>/<seq>-<point>-<comparison>-p<pair>-<position>.json (dotfiles included)."""
        raw = self.bundle / "raw"
        records, seen = [], {}
        for path in sorted(raw.rglob("*")) if raw.is_dir() else []:
            if not path.is_file():
                continue
            rel, parts = path.relative_to(self.bundle).as_posix(), path.relative_to(raw).parts
            if len(parts) != 2 or path.suffix != ".json":
                self.fail("raw", f"{rel} is not a raw/<job>/<arm>.json record file")
                continue
            try:
                rec = json.loads(path.read_text())
            except Exception as exc:
                self.fail("raw", f"{rel} could not be read: {type(exc).__name__}: {exc}")
                continue
            problem = _record_problem(rec)
            if problem is not None:
                self.fail("raw", f"{rel} is not an arm record: {problem}")
                continue
            if parts != (rec["job"], _record_file_name(rec)):
                self.fail("raw", f"{rel} holds {rec['job']} seq {rec['seq']}, whose file is "
                                 f"raw/{rec['job']}/{_record_file_name(rec)}")
            key = (rec["job"], rec["seq"])
            if key in seen:
                self.fail("raw", f"{rel} repeats {rec['job']} seq {rec['seq']} of {seen[key]}")
                continue
            seen[key] = rel
            records.append(rec)
        return sorted(records, key=lambda r: (r["job"], r["seq"]))

    def load_references(self, plan: dict) -> dict[str, dict]:
        refs = {}
        for pt in plan["points"]:
            ref = pt.get("reference")
            if not ref:
                continue
            schedule, meta = self.read_json(ref["file"], "reference"), self.read_json(ref["meta_file"], "reference")
            if isinstance(schedule, dict) and isinstance(meta, dict):
                refs[pt["key"]] = {"schedule": schedule, "work": meta["work"]}
        return refs

    def load_tables(self) -> dict[str, pd.DataFrame]:
        tables = {}
        for name in TABLES:
            rel = f"tables/{name}.parquet"
            if not (self.bundle / rel).is_file():
                continue
            try:
                meta = pq.read_schema(self.bundle / rel).metadata or {}
                tables[name] = pd.read_parquet(self.bundle / rel)
            except Exception as exc:
                self.fail("tables", f"{rel} could not be read: {type(exc).__name__}: {exc}")
                continue
            if meta.get(b"loopbench_schema_version") != str(derive.SCHEMA_VERSION).encode():
                self.fail("tables", f"{rel} schema version {meta.get(b'loopbench_schema_version')!r}")
        return tables

    # -------------------------------------------------------------------------------------- files
    def check_manifest(self) -> None:
        manifest = self.read_json("manifest.json")
        if manifest is None:
            return
        self.check_layout_version(manifest)
        listed = manifest["files"]
        for rel, entry in sorted(listed.items()):
            if Path(rel).is_absolute() or ".." in Path(rel).parts or rel in UNMANIFESTED:
                self.fail("manifest", f"lists {rel!r}, which cannot be a file of the bundle")
                continue
            p = self.bundle / rel
            if not p.is_file():
                self.fail("manifest", f"{rel} is listed but missing")
                continue
            if p.stat().st_size != entry["bytes"] or _sha256_file(p) != entry["sha256"]:
                self.fail("manifest", f"{rel} changed: sha256 {_sha256_file(p)} does not match the manifest's "
                                      f"{entry['sha256']}")
            self.count("files")
        for p in sorted(self.bundle.rglob("*")):
            rel = p.relative_to(self.bundle).as_posix()
            if p.is_file() and rel not in UNMANIFESTED and rel not in listed:
                self.fail("manifest", f"{rel} is in the bundle but not in the manifest")

    def check_required_files(self, plan: dict, children: list, records: list[dict]) -> None:
        """The layout contract's required files: what every bundle holds, and what each point and session adds."""
        for rel in layout_required(plan, self.sessions_ran(children, records)):
            if not (self.bundle / rel).is_file():
                self.fail("files", f"required file {rel} is missing")
            self.count("required_files")

    def check_layout(self, plan: dict, sessions: set[str]) -> None:
        """No file outside the layout contract, even one the manifest lists: a stray file can carry claims
        (a table, a report) that no check reads."""
        where = f"loopbench/bundle_layout.json version {LAYOUT['version']}"
        for rel in layout_strays(self.bundle, plan, sessions):
            self.fail("layout", f"{rel} is not a file of the bundle layout ({where})")
        self.count("layout_files", sum(1 for p in self.bundle.rglob("*") if p.is_file()))

    def check_layout_version(self, manifest: dict) -> None:
        """The manifest follows the contract version this auditor implements."""
        version = manifest.get("layout_version", 1)   # manifests before the field follow version 1
        if isinstance(version, bool) or version != LAYOUT["version"]:
            self.fail("layout", f"manifest.json records bundle layout version {version!r}; this auditor "
                                f"implements version {LAYOUT['version']} (loopbench/bundle_layout.json)")

    @staticmethod
    def sessions_ran(children: list, records: list[dict]) -> set[str]:
        """The session ids that children.json or a raw record shows ran (a resume's are ``<device>.r<k>``)."""
        ran = {derive.child_session(c) for c in children if isinstance(c, dict) and isinstance(c.get("name"), str)}
        return ran | {derive.record_session(r) for r in records}

    # --------------------------------------------------------------------------------------- plan
    def check_plan(self, plan: dict) -> None:
        cfg_sha = hashlib.sha256(_canonical(plan["config"])).hexdigest()
        if cfg_sha != plan["config_sha256"]:
            self.fail("plan", f"config sha256 is {cfg_sha}, plan.json says {plan['config_sha256']}")
        got = _sha256_file(self.bundle / plan["prompts"]["file"])
        if got != plan["prompts"]["sha256"]:
            self.fail("plan", f"prompts sha256 is {got}, plan.json says {plan['prompts']['sha256']}")
        for pt in plan["points"]:
            ref = pt.get("reference")
            if not ref:  # an incomplete run may have failed to capture it; the summary check says so
                continue
            for f, want in ((ref["file"], ref["sha256"]), (ref["meta_file"], ref["meta_sha256"])):
                if (self.bundle / f).is_file() and _sha256_file(self.bundle / f) != want:
                    self.fail("plan", f"{f} sha256 is {_sha256_file(self.bundle / f)}, plan.json says {want}")

    def check_references(self, plan: dict, refs: dict) -> None:
        cfg = plan["config"]
        prompts = json.loads((self.bundle / plan["prompts"]["file"]).read_text())
        D, ex = cfg["workload"]["output_len"], cfg["exit"]
        for pt in plan["points"]:
            sched = refs.get(pt["key"], {}).get("schedule")
            if sched is None:
                continue
            if sched["max_num_seqs"] != pt["max_num_seqs"] or len(sched["requests"]) != pt["num_requests"]:
                self.fail("reference", f"{pt['key']}: schedule has B{sched['max_num_seqs']}/C{len(sched['requests'])}")
            for r in sched["requests"]:
                i = int(r["request_id"][1:])
                if r["prompt_sha256"] != _prompt_sha256(prompts[i]):
                    self.fail("reference", f"{pt['key']} request {r['request_id']}: prompt sha256 does not match "
                                           f"prompts.json[{i}]")
                if len(r["token_ids"]) != D or len(r["exit_depths"]) != D:
                    self.fail("reference", f"{pt['key']} request {r['request_id']}: {len(r['token_ids'])} tokens, "
                                           f"{len(r['exit_depths'])} depths, expected {D}")
                if any(not 1 <= d <= ex["max_loops"] for d in r["exit_depths"]):
                    self.fail("reference", f"{pt['key']} request {r['request_id']}: exit depth outside "
                                           f"1..{ex['max_loops']}")
                self.count("reference_requests")

    # -------------------------------------------------------------------------------------- order
    @staticmethod
    def _balanced_order(plan: dict) -> list[dict]:
        """The seeded balanced order: per point, pair i of every comparison, first arm ceil/floor balanced."""
        cfg = plan["config"]
        n, comps = cfg["pairs"], cfg["comparisons"]
        expected, seq = [], 0
        for pi, pt in enumerate(plan["points"]):
            firsts = []
            for ci in range(len(comps)):
                base = ["baseline"] * math.ceil(n / 2) + ["candidate"] * (n // 2)
                perm = np.random.default_rng([cfg["order_seed"], pi, ci]).permutation(n)
                firsts.append([base[i] for i in perm])
            for pair in range(n):
                for ci, comp in enumerate(comps):
                    pos = ("baseline", "candidate") if firsts[ci][pair] == "baseline" else ("candidate", "baseline")
                    for slot, p in enumerate(pos):
                        expected.append({"seq": seq, "point": pt["key"], "comparison": comp["name"], "pair": pair,
                                         "position": p, "slot": slot, "arm": comp[p]})
                        seq += 1
        return expected

    def check_order(self, plan: dict, records: list[dict]) -> None:
        cfg = plan["config"]
        expected = self._balanced_order(plan)
        for dev in plan["devices"]:
            if plan["order"].get(dev["name"]) != expected:
                self.fail("order", f"{dev['name']}: plan.json's measurement order is not the seeded balanced order")
        if set(plan["order"]) != {d["name"] for d in plan["devices"]}:
            self.fail("order", f"plan.json orders sessions {sorted(plan['order'])}, its devices are "
                               f"{sorted(d['name'] for d in plan['devices'])}")
        by_seq = {(d["name"], it["seq"]): it for d in plan["devices"] for it in plan["order"].get(d["name"], [])}
        points = {pt["key"]: pt for pt in plan["points"]}
        last: dict[str, tuple[int, float]] = {}
        for r in records:
            item = by_seq.get((r["job"], r["seq"]))
            if item is None or any(r[f] != item[f] for f in ("point", "comparison", "pair", "position", "slot", "arm")):
                self.fail("order", f"record {r['job']} seq {r['seq']} ({r['arm']}) is not at its planned place")
            if r["arm_config"] != cfg["arms"].get(r["arm"]):
                self.fail("order", f"record {r['job']} seq {r['seq']}: arm {r['arm']!r} ran a config other than "
                                   "planned")
            pt = points.get(r["point"], {})
            planned = (pt.get("max_num_seqs"), pt.get("num_requests"), cfg["workload"]["output_len"])
            if (r["max_num_seqs"], r["num_requests"], r["output_len"]) != planned:
                self.fail("order", f"record {r['job']} seq {r['seq']}: B{r['max_num_seqs']}/C{r['num_requests']}/"
                                   f"D{r['output_len']}, the plan says B{planned[0]}/C{planned[1]}/D{planned[2]}")
            start = (r.get("wall_clock") or {}).get("measured_start_unix_s")
            prev = last.get(r["job"])
            if prev is not None and start is not None and start < prev[1]:
                self.fail("order", f"{r['job']} seq {r['seq']} was measured before seq {prev[0]}")
            if start is not None:
                last[r["job"]] = (r["seq"], start)
            self.count("records_in_order")

    # ------------------------------------------------------------------------------------ devices
    def check_devices(self, plan: dict, records: list[dict], children: list[dict]) -> None:
        """Children run on the plan's devices; each record was measured on its session's planned device."""
        devices = {d["name"]: d for d in plan["devices"]}
        child = {c["name"]: c for c in children}
        first = plan["devices"][0]["label"] if plan["devices"] else None
        for c in children:
            label = first if c["name"] == "reference" else devices.get(c["name"], {}).get("label")
            if label is None:
                self.fail("devices", f"children.json lists child {c['name']!r}, which the plan does not run")
            elif c["device"] != label:
                self.fail("devices", f"children.json: child {c['name']} ran on {c['device']!r}, the plan says "
                                     f"{label!r}")
            if c.get("log") != f"{derive.child_session(c)}.log":
                self.fail("devices", f"children.json: child {c['name']} logs to {c.get('log')!r}, not "
                                     f"{derive.child_session(c)}.log")
        session_device: dict[str, dict] = {}
        for r in records:
            where, dev, d = f"record {r['job']} seq {r['seq']}", r["device"], devices.get(r["job"])
            if d is None:
                self.fail("devices", f"{where}: job {r['job']!r} is not a device of the plan")
                continue
            if r["job"] not in child:
                self.fail("devices", f"{where}: written by {r['job']}, which children.json does not list")
            # A Slurm GPU job learns its GPU only when it starts; every other session is pinned by the plan.
            pinned = not (d["kind"] == "cuda" and d["gpu_index"] is None)
            got = (dev.get("kind"), dev.get("label"), dev.get("gpu_index")) if pinned else (dev.get("kind"),)
            want = (d["kind"], d["label"], d["gpu_index"]) if pinned else (d["kind"],)
            if got != want:
                self.fail("devices", f"{where}: device (kind, label, gpu_index) {got} is not the plan's {want} "
                                     f"for {r['job']}")
            if session_device.setdefault(r["job"], dev) != dev:
                self.fail("devices", f"{where}: device {dev} differs from the session's earlier arms")

    # ----------------------------------------------------------------------------------- sessions
    def check_child_states(self, children: list[dict]) -> None:
        """A published bundle's children all ended (``finish`` resolves the ``running`` ones of a lost
        controller); an ``interrupted`` child names what interrupted it, and only such a child does."""
        for c in children:
            where = f"children.json: {derive.child_session(c)}"
            if c.get("state") not in derive.CHILD_STATES:
                self.fail("sessions", f"{where} is {c.get('state')!r}, not an ended state {derive.CHILD_STATES}")
            elif (c["state"] == "interrupted") != bool(c.get("interrupted_by")):
                self.fail("sessions", f"{where} is {c['state']} with interrupted_by {c.get('interrupted_by')!r}")

    def check_sessions(self, plan: dict, records: list[dict], children: list[dict]) -> None:
        """Which session measured which pair: each record names a session child of its job; both arms of a
        pair come from one session; a job's sessions measured its order in the order of their runs; a
        completed session measured exactly the seqs its job file asked for (all of them without a list)."""
        devices = {d["name"] for d in plan["devices"]}
        sessions: dict[str, dict] = {}
        for c in children:
            sid = derive.child_session(c)
            if sid in sessions:
                self.fail("sessions", f"children.json lists session {sid} twice")
            sessions[sid] = c
        measured: dict[str, list[int]] = {}
        pair_sessions: dict[tuple, set] = {}
        last: dict[str, tuple[int, str, int]] = {}
        for r in records:
            sid, where = derive.record_session(r), f"record {r['job']} seq {r['seq']}"
            c = sessions.get(sid)
            if c is None or c["name"] != r["job"]:
                self.fail("sessions", f"{where}: session {sid!r} is not a session of {r['job']} in children.json")
                continue
            measured.setdefault(sid, []).append(r["seq"])
            pair_sessions.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), set()).add(sid)
            attempt, prev = c.get("attempt", 0), last.get(r["job"])
            if prev is not None and attempt < prev[0]:
                self.fail("sessions", f"{where} by {sid} (run {attempt}) follows seq {prev[2]} by {prev[1]} "
                                      f"(run {prev[0]})")
            last[r["job"]] = (attempt, sid, r["seq"])
        for (job, point, comp, pair), sids in sorted(pair_sessions.items()):
            if len(sids) > 1:
                self.fail("sessions", f"{job} {point} {comp} pair {pair} was measured by sessions {sorted(sids)}")
        for sid, c in sessions.items():
            if c["name"] not in devices or c.get("state") != "completed":
                continue
            job = self.read_json(f"jobs/session-{sid}.json", "sessions")
            if not isinstance(job, dict):
                continue
            asked = job.get("seqs")
            asked = [it["seq"] for it in plan["order"].get(c["name"], [])] if asked is None else asked
            if sorted(measured.get(sid, [])) != sorted(asked):
                self.fail("sessions", f"{sid} completed, but measured seqs {sorted(measured.get(sid, []))}, its job "
                                      f"asked for {sorted(asked)}")
        self.count("sessions", len(sessions))

    # ------------------------------------------------------------------------------------- tables
    def check_timing(self, records: list[dict]) -> None:
        for r in records:
            tps = derive.tokens_per_s(r)
            if not math.isclose(tps, r["tokens_per_s"], rel_tol=REL_TOL):
                self.fail("timing", f"record {r['job']} seq {r['seq']} ({r['arm']}): tokens_per_s {r['tokens_per_s']} "
                                    f"!= C*D/elapsed_s = {tps}")

    def check_wall_clock(self, records: list[dict]) -> None:
        """Each measured elapsed_s (> 0, see the record rules) lies within its record's wall-clock span."""
        for r in records:
            where = f"record {r['job']} seq {r['seq']} ({r['arm']})"
            wall, elapsed = r.get("wall_clock"), r["measured"]["elapsed_s"]
            start, end = (wall.get("measured_start_unix_s"), wall.get("measured_end_unix_s")) \
                if isinstance(wall, dict) else (None, None)
            if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                       for t in (start, end)) or end < start:
                self.fail("timing", f"{where}: no wall-clock span to bound its measured elapsed_s: wall_clock is "
                                    f"{wall!r}")
                continue
            span = end - start
            if elapsed > span * (1 + WALL_CLOCK_REL_TOL) + WALL_CLOCK_ABS_TOL_S:
                self.fail("timing", f"{where}: measured elapsed_s {elapsed!r} is longer than its wall-clock span "
                                    f"{span!r} s (wall_clock.measured_start_unix_s .. measured_end_unix_s)")
            self.count("wall_clock_spans")

    def check_table(self, name: str, got: pd.DataFrame, want: pd.DataFrame) -> None:
        """Every row and column of ``tables/<name>.parquet`` against the rows the raw records give."""
        kind, keys = f"{name}.parquet", list(derive.TABLE_KEYS[name])
        if len(want) == 0 or len(got) == 0:
            if len(want) != len(got):
                self.fail(kind, f"has {len(got)} rows, the raw records give {len(want)}")
            return
        for col in [c for c in want.columns if c not in got.columns]:
            self.fail(kind, f"lacks column {col!r}")
        for col in [c for c in got.columns if c not in want.columns]:
            self.fail(kind, f"has column {col!r}, which the raw records do not give")
        if any(k not in got.columns for k in keys):
            return
        dup = got[got.duplicated(keys, keep="first")]
        for values in dup[keys].itertuples(index=False):
            self.fail(kind, f"repeats the row of {_where(tuple(keys), tuple(values))}")
        m = want.merge(got.drop_duplicates(keys), on=keys, how="outer", suffixes=("_raw", "_table"), indicator=True)
        for values, side in zip(m[keys].itertuples(index=False), m["_merge"]):
            if side == "left_only":
                self.fail(kind, f"lacks the row of {_where(tuple(keys), tuple(values))}")
            elif side == "right_only":
                self.fail(kind, f"has a row for {_where(tuple(keys), tuple(values))} that the raw records do not give")
        both = m[m["_merge"] == "both"]
        for col in [c for c in want.columns if c in got.columns and c not in keys]:
            table, raw = both[f"{col}_table"], both[f"{col}_raw"]
            for i in np.flatnonzero(self._mismatches(table, raw)):
                where = _where(tuple(keys), tuple(both[keys].iloc[i]))
                self.fail(kind, f"{col} of {where} is {_plain(table.iloc[i])!r}, the raw records give "
                                f"{_plain(raw.iloc[i])!r}")
        self.count(f"{name}_cells", len(both) * len(want.columns))

    @staticmethod
    def _mismatches(table: pd.Series, raw: pd.Series) -> np.ndarray:
        """Boolean mask of differing cells: vectorised for plain number columns, item by item otherwise."""
        types = pd.api.types
        if types.is_integer_dtype(table) and types.is_integer_dtype(raw):
            return table.to_numpy() != raw.to_numpy()
        numeric = all(types.is_numeric_dtype(s) and not types.is_bool_dtype(s) for s in (table, raw))
        if numeric:
            a, b = table.to_numpy(dtype=float), raw.to_numpy(dtype=float)
            return ~(np.isclose(a, b, rtol=REL_TOL, atol=0.0) | (np.isnan(a) & np.isnan(b)))
        return np.array([not _same(a, b) for a, b in zip(table, raw)], dtype=bool)

    def check_tables(self, records: list[dict], tables: dict[str, pd.DataFrame]) -> None:
        expected = derive.expected_tables(records)
        for name, got in tables.items():
            self.section(f"{name}.parquet", self.check_table, name, got, expected[name])

    # --------------------------------------------------------------------------------- references
    def check_against_references(self, plan: dict, records: list[dict], refs: dict) -> bool:
        before = len(self.discrepancies)
        warmup = plan["config"]["warmup"]
        for r in records:
            ref = refs.get(r["point"])
            if ref is None:
                self.fail("reference", f"{r['job']} seq {r['seq']}: no frozen reference for {r['point']}")
                continue
            for phase in derive.PHASES:
                data = r.get(phase)
                if data is None:
                    if phase == "measured" or warmup:
                        self.fail("reference", f"{r['job']} seq {r['seq']} {r['arm']}: no {phase} run")
                    continue
                self._check_phase(r, phase, data, ref)
            self._check_coverage_trace(r)
            new_captures = {k: n for k, n in r["measured"]["graphs"].items() if k.endswith("captures") and n}
            if warmup and new_captures:
                self.fail("captures", f"{r['job']} seq {r['seq']} {r['arm']}: {new_captures} in the measured run")
        self._check_graph_coverage(records)
        return len(self.discrepancies) == before

    def _check_phase(self, r: dict, phase: str, data: dict, ref: dict) -> None:
        frozen = {q["request_id"]: q for q in ref["schedule"]["requests"]}
        where = f"{r['job']} seq {r['seq']} {r['point']} {r['comparison']} pair {r['pair']} arm {r['arm']!r} {phase}"
        if set(data["outputs"]) != set(frozen):
            self.fail("reference", f"{where}: requests {sorted(data['outputs'])} != frozen {sorted(frozen)}")
        for rid in sorted(set(data["outputs"]) & set(frozen)):
            for field, kind in (("token_ids", "tokens"), ("exit_depths", "exit_depths")):
                got, want = data["outputs"][rid][field], frozen[rid][field]
                if got != want:
                    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    self.fail(kind, f"{where} request {rid!r} position {i}: {got[i] if i < len(got) else '<end>'} "
                                    f"!= frozen {want[i] if i < len(want) else '<end>'}")
            self.count("requests_vs_reference")
        for key in WORK_KEYS:
            if key in ref["work"] and data["work"].get(key) != ref["work"][key]:
                self.fail("work", f"{where}: {key} {data['work'].get(key)} != reference {ref['work'][key]}")
        trace = ref["schedule"].get("trace_sha256")
        if data.get("trace_sha256") is not None and trace is not None and data["trace_sha256"] != trace:
            self.fail("trace", f"{where}: row trace differs from the frozen schedule")

    def _check_coverage_trace(self, r: dict) -> None:
        """The record's coverage counts are of the rows that ran (the checker's ``coverage`` finding)."""
        cov, trace = r.get("coverage"), r["measured"].get("trace_sha256")
        if cov is not None and trace is not None and cov["trace_sha256"] != trace:
            self.fail("coverage", f"{r['job']} seq {r['seq']} {r['arm']}: coverage was derived from a row trace "
                                  "other than the measured run's")

    # ----------------------------------------------------------------------------------- coverage
    def check_coverage(self, plan: dict, records: list[dict], refs: dict) -> None:
        """Every record's coverage is what the auditor derives from the frozen schedule and its arm."""
        with_cov = [r for r in records if "coverage" in r]
        if with_cov and len(with_cov) != len(records):
            self.fail("coverage", f"{len(with_cov)} of {len(records)} records carry coverage counts; a bundle's "
                                  "records all do or none")
        planes = plan["checkpoint"]["model_config"]["total_ut_steps"]
        derived: dict[tuple, dict] = {}
        for r in with_cov:
            ref = refs.get(r["point"])
            if ref is None:
                continue  # named by the reference check
            key = (r["point"], r["arm"])
            if key not in derived:
                derived[key] = coverage.coverage(ref["schedule"], r["arm_config"], planes)
                if derived[key]["trace_sha256"] != ref["schedule"].get("trace_sha256"):
                    self.fail("coverage", f"{r['point']}: the replay scheduling rules do not reproduce the frozen "
                                          "row trace, so no coverage count can be vouched for")
            for path, got, want in _field_diffs(r["coverage"], derived[key], "coverage"):
                self.fail("coverage", f"record {r['job']} seq {r['seq']} ({r['arm']}): {path} is "
                                      f"{_plain(got) if got is not ABSENT else 'missing'}, the frozen schedule gives "
                                      f"{want if want is not ABSENT else 'no such count'}")
            self.count("coverage_records")

    def _check_graph_coverage(self, records: list[dict]) -> None:
        """Both arms of a pair with the same Graph settings replay and fall back equally often."""
        pairs: dict[tuple, list[dict]] = {}
        for r in records:
            pairs.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), []).append(r)
        for (job, point, comp, pair), members in pairs.items():
            if len(members) != 2:
                continue
            a, b = members
            if any(a["arm_config"].get(k) != b["arm_config"].get(k) for k in ("cuda_graphs", "graph_cache_size")):
                continue
            ga, gb = a["measured"]["graphs"], b["measured"]["graphs"]
            for key in sorted(k for k in set(ga) | set(gb) if k.endswith(("replays", "fallbacks"))):
                if ga.get(key) != gb.get(key):
                    self.fail("graph_coverage", f"{job} {point} {comp} pair {pair}: {key} {a['arm']} "
                                                f"{ga.get(key)} != {b['arm']} {gb.get(key)}")

    # ------------------------------------------------------------------------------------ summary
    @staticmethod
    def interruption(plan: dict, children: list[dict]) -> str | None:
        """A failed reference capture, as the bundle shows it: the reference child did not complete (and was
        not stopped: a stopped child's ``interrupted_by`` says why instead) or a point has no reference."""
        current = derive.current_children(children)
        if any(c.get("interrupted_by") for c in current):
            return None
        ref = next((c for c in current if c["name"] == "reference"), None)
        if ref is None or ref["exit_code"] != 0 or any(not pt.get("reference") for pt in plan["points"]):
            return derive.REFERENCE_FAILED
        return None

    @staticmethod
    def is_complete(plan: dict, records: list[dict], children: list[dict], interrupted: str | None) -> bool:
        """Every planned arm recorded, and the latest child of each name (reference, every device) completed."""
        current = derive.current_children(children)
        names = {c["name"] for c in current}
        return (interrupted is None and all(c["exit_code"] == 0 and c["state"] == "completed" for c in current)
                and "reference" in names and all(d["name"] in names for d in plan["devices"])
                and len(records) == derive.planned_arms(plan))

    def check_summary(self, claimed: dict, expected: dict) -> None:
        for path, got, want in _field_diffs(claimed, expected, ""):
            if got is ABSENT:
                self.fail("summary.json", f"lacks {path} (the audit derives {want!r})")
            elif want is ABSENT:
                self.fail("summary.json", f"has {path} = {got!r}, which the bundle format does not define")
            elif isinstance(got, list) and isinstance(want, list) and len(got) != len(want):
                self.fail("summary.json", f"{path} has {len(got)} entries, the audit derives {len(want)}")
            else:
                self.fail("summary.json", f"{path} is {_plain(got)!r}, the audit derives {want!r}")
        self.count("results", len(expected["results"]))
        self.count("ratios", sum(len(r["pairs"]) for r in expected["results"]))

    # ------------------------------------------------------------------------------------- report
    def check_report(self, want: str) -> None:
        """report.md must be exactly the re-derived report: each differing line is named with its section."""
        got_lines, want_lines = (self.bundle / "report.md").read_text().split("\n"), want.split("\n")

        def at(j: int) -> str:
            heading = next((line for line in reversed(got_lines[:j + 1]) if line.startswith("## ")), "header")
            return f"line {j + 1} ({heading})"

        for j, line in enumerate(got_lines):
            if HTML.search(line):
                self.fail("report.md", f"{at(j)} holds raw HTML, which can hide or forge what the page shows: {line!r}")
        for j, got, wanted in _line_diffs(got_lines, want_lines):
            if wanted is None:
                self.fail("report.md", f"{at(j)} is not in the re-derived report: {got!r}")
            elif got is None:
                self.fail("report.md", f"lacks the re-derived line {wanted!r} before {at(j)}")
            else:
                self.fail("report.md", f"{at(j)} reads {got!r}, re-derived {wanted!r}")
        self.count("report_lines", len(want_lines))

    # ---------------------------------------------------------------------------------------- run
    def run(self) -> dict:
        self.section("manifest", self.check_manifest)
        plan, summary = self.read_json("plan.json"), self.read_json("summary.json")
        children, environment = self.read_json("children.json"), self.read_json("environment.json")
        records = self.section("raw", self.load_records) or []
        self.count("records", len(records))
        self.section("files", self.check_required_files, plan if isinstance(plan, dict) else {},
                     children if isinstance(children, list) else [], records)
        if isinstance(plan, dict):
            self.section("layout", self.check_layout, plan,
                         self.sessions_ran(children if isinstance(children, list) else [], records))
        if not (isinstance(plan, dict) and isinstance(summary, dict) and isinstance(children, list)):
            self.fail("bundle", "plan.json, summary.json or children.json is missing or unreadable; "
                                "nothing else is checked")
            return self.verdict(False)
        refs = self.section("reference", self.load_references, plan) or {}
        tables = self.load_tables()
        self.section("plan", self.check_plan, plan)
        self.section("reference", self.check_references, plan, refs)
        self.section("order", self.check_order, plan, records)
        self.section("devices", self.check_devices, plan, records, children)
        self.section("timing", self.check_timing, records)
        self.section("timing", self.check_wall_clock, records)
        self.section("tables", self.check_tables, records, tables)
        self.section("coverage", self.check_coverage, plan, records, refs)
        checks_ok = bool(self.section("reference", self.check_against_references, plan, records, refs))
        self.section("sessions", self.check_child_states, children)
        self.section("sessions", self.check_sessions, plan, records, children)
        interrupted = self.section("status", self.interruption, plan, children)
        complete = bool(self.section("status", self.is_complete, plan, records, children, interrupted))
        expected = self.section("summary.json", self.expected_summary, plan, summary, records, children, refs,
                                complete, checks_ok, interrupted)
        if expected is not None:
            self.section("summary.json", self.check_summary, summary, expected)
            if isinstance(environment, dict) and (self.bundle / "report.md").is_file():
                self.section("report.md", self.check_report, self.expected_report(plan, expected, records, environment))
        return self.verdict(complete)

    def expected_summary(self, plan: dict, claimed: dict, records: list[dict], children: list[dict], refs: dict,
                         complete: bool, checks_ok: bool, interrupted: str | None) -> dict:
        # The checker's finding messages cannot be re-derived; a failed check is a discrepancy of its own.
        findings = [] if checks_ok else (claimed.get("checks") or {}).get("findings")
        return derive.summary(plan, _sha256_file(self.bundle / "plan.json"), records, children, complete=complete,
                              checks_ok=checks_ok, reference_points=set(refs), findings=findings,
                              interrupted=interrupted)

    def expected_report(self, plan: dict, summary: dict, records: list[dict], environment: dict) -> str:
        prompts_sha = _sha256_file(self.bundle / plan["prompts"]["file"])
        return render.report(plan, summary["plan_sha256"], prompts_sha, summary,
                             [derive.arm_row(r) for r in records], environment)

    def verdict(self, complete: bool) -> dict:
        status = "fail" if self.discrepancies else ("pass" if complete else "incomplete")
        return {"auditor_version": AUDITOR_VERSION, "status": status, "discrepancies": self.discrepancies,
                "checked": self.checked, "scipy": scipy.__version__, "numpy": np.__version__,
                "note": "audit.json is written after manifest.json and is not listed in it"}


def write_verdict(bundle: Path, verdict: dict) -> Path:
    path = Path(bundle) / "audit.json"
    fd, tmp = tempfile.mkstemp(dir=bundle, prefix=".audit.json.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(verdict, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def audit(bundle: Path) -> dict:
    """The verdict on one bundle; an error the checks did not foresee is a discrepancy too, never a crash."""
    a = Audit(Path(bundle))
    try:
        return a.run()
    except Exception as exc:
        a.fail("auditor", f"stopped early: {type(exc).__name__}: {exc}")
        return a.verdict(False)
