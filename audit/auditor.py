"""The independent auditor: re-derive everything a bundle claims from the bundle alone.

It reads files (JSON, parquet, markdown) and imports nothing from ``loopbench.harness``: every formula
it needs is re-implemented here from the documented bundle format, so a bug in the harness cannot
vouch for itself. What it verifies, each failure becoming one named discrepancy:

1. manifest: every listed file exists with its sha256 and size, and no unlisted file exists;
2. plan: the config's sha256, the prompts' sha256, the references' sha256s, the summary's plan hash;
   every frozen reference fits the prompts (prompt sha256 per request, D tokens, depths in bounds);
3. order: the measurement order is the seeded balanced order (first arm ceil/floor per comparison,
   the same numpy permutation), every record sits at its planned place, measured in that order;
4. children: exit codes; a run with a failed child or a missing arm must say incomplete and publish
   no verdict;
5. data: raw records vs the parquet tables (arms, pairs, requests, tokens), counts in the summary;
6. references: every warmup and measured arm reproduces its frozen reference token for token and exit
   for exit, with the reference's work counters and zero measured Graph captures;
7. numbers: every tokens/s (C * D / elapsed_s), pair ratio, arm median, speedup, percentile and BCa CI
   (scipy.stats.bootstrap, same seed), distinct-resample count, exact Wilcoxon p (where the summary
   used the exact method) and verdict, and every row of the report's result tables.

The verdict goes to ``audit.json`` in the bundle (outside the manifest by design) and the exit status:
0 pass, 1 discrepancies, 3 consistent but incomplete (an honest partial run: nothing to vouch for).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import scipy
import scipy.stats

AUDITOR_VERSION = 1
SCHEMA_VERSION = 1
UNMANIFESTED = ("manifest.json", "audit.json")
TABLES = ("arms", "pairs", "requests", "tokens", "telemetry")
WORK_KEYS = ("rows_per_depth", "prefill_tokens", "prefill_rows", "decode_tokens", "steps", "decode_steps")
REL_TOL = 1e-9
MAX_PER_KIND = 20


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


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=0.0)


class Audit:
    """Collects discrepancies; each check section runs even when an earlier one failed."""

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

    def load_json(self, rel: str) -> Any:
        return json.loads((self.bundle / rel).read_text())

    # ---------------------------------------------------------------------------------- manifest
    def check_manifest(self) -> None:
        manifest = self.load_json("manifest.json")
        listed = manifest["files"]
        for rel, entry in sorted(listed.items()):
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
            if p.is_file() and rel not in UNMANIFESTED and not p.name.startswith(".") and rel not in listed:
                self.fail("manifest", f"{rel} is in the bundle but not in the manifest")

    # -------------------------------------------------------------------------------------- plan
    def check_plan(self, plan: dict, summary: dict) -> None:
        cfg_sha = hashlib.sha256(_canonical(plan["config"])).hexdigest()
        if cfg_sha != plan["config_sha256"]:
            self.fail("plan", f"config sha256 is {cfg_sha}, plan.json says {plan['config_sha256']}")
        got = _sha256_file(self.bundle / plan["prompts"]["file"])
        if got != plan["prompts"]["sha256"]:
            self.fail("plan", f"prompts sha256 is {got}, plan.json says {plan['prompts']['sha256']}")
        plan_sha = _sha256_file(self.bundle / "plan.json")
        if summary.get("plan_sha256") != plan_sha:
            self.fail("plan", f"summary.json names plan sha256 {summary.get('plan_sha256')}, plan.json is {plan_sha}")
        for pt in plan["points"]:
            ref = pt.get("reference")
            if ref is None:
                if summary.get("status") == "complete":  # an incomplete run may have failed to capture it
                    self.fail("plan", f"point {pt['key']} has no frozen reference, yet the run says complete")
                continue
            for f, want in ((ref["file"], ref["sha256"]), (ref["meta_file"], ref["meta_sha256"])):
                got = _sha256_file(self.bundle / f)
                if got != want:
                    self.fail("plan", f"{f} sha256 is {got}, plan.json says {want}")

    def check_references(self, plan: dict, refs: dict) -> None:
        cfg = plan["config"]
        prompts = self.load_json(plan["prompts"]["file"])
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
                    self.fail("reference", f"{pt['key']} request {r['request_id']}: exit depth outside 1..{ex['max_loops']}")
                self.count("reference_requests")

    # ------------------------------------------------------------------------------------- order
    def check_order(self, plan: dict, records: list[dict]) -> None:
        cfg = plan["config"]
        n = cfg["pairs"]
        comps = cfg["comparisons"]
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
        for dev in plan["devices"]:
            order = plan["order"].get(dev["name"])
            if order != expected:
                self.fail("order", f"{dev['name']}: plan.json's measurement order is not the seeded balanced order")
                continue
            counts: dict[tuple, list[int]] = {}
            for item in order:
                if item["slot"] == 0:
                    c = counts.setdefault((item["point"], item["comparison"]), [0, 0])
                    c[0 if item["position"] == "baseline" else 1] += 1
            for key, (b, c) in counts.items():
                if (b, c) != (math.ceil(n / 2), n // 2):
                    self.fail("order", f"{dev['name']} {key}: baseline first {b}x, candidate first {c}x")
        by_seq = {(d["name"], it["seq"]): it for d in plan["devices"] for it in plan["order"].get(d["name"], [])}
        last: dict[str, tuple[int, float]] = {}
        for r in records:
            item = by_seq.get((r["job"], r["seq"]))
            fields = ("point", "comparison", "pair", "position", "slot", "arm")
            if item is None or any(r[f] != item[f] for f in fields):
                self.fail("order", f"record {r['job']} seq {r['seq']} ({r['arm']}) is not at its planned place")
            if r["arm_config"] != cfg["arms"].get(r["arm"]):
                self.fail("order", f"record {r['job']} seq {r['seq']}: arm {r['arm']!r} ran a config other than planned")
            start = r.get("wall_clock", {}).get("measured_start_unix_s")
            prev = last.get(r["job"])
            if prev is not None and start is not None and start < prev[1]:
                self.fail("order", f"{r['job']} seq {r['seq']} was measured before seq {prev[0]}")
            if start is not None:
                last[r["job"]] = (r["seq"], start)
            self.count("records_in_order")

    # ------------------------------------------------------------------------------ completeness
    def check_completeness(self, plan: dict, summary: dict, records: list[dict], children: list[dict]) -> bool:
        planned = sum(len(v) for v in plan["order"].values())
        failed = [c for c in children if c["exit_code"] != 0]
        complete = not failed and len(records) == planned and {"reference"} <= {c["name"] for c in children} \
            and all(d["name"] in {c["name"] for c in children} for d in plan["devices"])
        for c in failed:
            self.count("failed_children")
        status = summary.get("status")
        if complete and status != "complete":
            self.fail("status", f"every arm and child is present and exited 0, but summary says {status!r}")
        if not complete:
            if status != "incomplete":
                self.fail("status", f"{len(records)} of {planned} arms, failed children "
                                    f"{[(c['name'], c['exit_code']) for c in failed]}, but summary says {status!r}")
            if summary.get("verdicts_published") or any(r.get("verdict") is not None for r in summary.get("results", [])):
                self.fail("status", "an incomplete run publishes a verdict")
        c = summary.get("counts", {})
        if c.get("arms_planned") != planned or c.get("arms_recorded") != len(records):
            self.fail("counts", f"summary counts {c.get('arms_recorded')}/{c.get('arms_planned')} arms, the bundle "
                                f"has {len(records)}/{planned}")
        return complete

    # ------------------------------------------------------------------------------ data tables
    def check_tables(self, records: list[dict], tables: dict[str, pd.DataFrame], summary: dict) -> None:
        for name, df in tables.items():
            meta = pq.read_schema(self.bundle / "tables" / f"{name}.parquet").metadata or {}
            if meta.get(b"loopbench_schema_version") != str(SCHEMA_VERSION).encode():
                self.fail("tables", f"{name}.parquet schema version {meta.get(b'loopbench_schema_version')!r}")
        arms = tables["arms"].set_index(["job", "seq"]) if len(tables["arms"]) else None
        if len(tables["arms"]) != len(records):
            self.fail("tables", f"arms.parquet has {len(tables['arms'])} rows, raw records {len(records)}")
        tok_rows, req_rows = [], 0
        for r in records:
            C, D = r["num_requests"], r["output_len"]
            tps = C * D / r["measured"]["elapsed_s"]
            if not _close(tps, r["tokens_per_s"]):
                self.fail("timing", f"record {r['job']} seq {r['seq']} ({r['arm']}): tokens_per_s {r['tokens_per_s']} "
                                    f"!= C*D/elapsed_s = {tps}")
            if arms is not None and (r["job"], r["seq"]) in arms.index:
                row = arms.loc[(r["job"], r["seq"])]
                for col, want in (("elapsed_s", r["measured"]["elapsed_s"]), ("tokens_per_s", tps),
                                  ("warmup_elapsed_s", (r.get("warmup") or {}).get("elapsed_s"))):
                    got = row[col]
                    got = None if got is None or (isinstance(got, float) and math.isnan(got)) else got
                    if not _close(got, want):
                        self.fail("timing", f"arms.parquet {col} of {r['job']} seq {r['seq']} ({r['arm']}) is {got}, "
                                            f"the raw record gives {want}")
                for col in ("arm", "point", "comparison", "position"):
                    if row[col] != r[col]:
                        self.fail("tables", f"arms.parquet {col} of {r['job']} seq {r['seq']} is {row[col]!r}, raw {r[col]!r}")
                for key, n in r["measured"]["graphs"].items():
                    if key in row.index and int(row[key]) != n:
                        self.fail("tables", f"arms.parquet {key} of {r['job']} seq {r['seq']} is {row[key]}, the "
                                            f"raw record has {n}")
            elif arms is not None:
                self.fail("tables", f"arms.parquet has no row for {r['job']} seq {r['seq']}")
            for phase in ("warmup", "measured"):
                data = r.get(phase)
                if data is None:
                    continue
                for rid, out in data["outputs"].items():
                    req_rows += 1
                    for pos, (t, d) in enumerate(zip(out["token_ids"], out["exit_depths"])):
                        tok_rows.append((r["job"], r["seq"], phase, rid, pos, t, d))
        raw_tok = pd.DataFrame(tok_rows, columns=["job", "seq", "phase", "request_id", "position", "token_id", "exit_depth"])
        self.count("tokens_compared", len(raw_tok))
        tok = tables["tokens"]
        keys = ["job", "seq", "phase", "request_id", "position"]
        merged = raw_tok.merge(tok, on=keys, how="outer", suffixes=("_raw", "_table"), indicator=True)
        for _, m in merged[merged["_merge"] != "both"].iterrows():
            where = "raw records only" if m["_merge"] == "left_only" else "tokens.parquet only"
            self.fail("tokens", f"{m['job']} seq {m['seq']} {m['phase']} request {m['request_id']} position "
                                f"{m['position']}: in {where}")
        both = merged[merged["_merge"] == "both"]
        for field, kind in (("token_id", "tokens"), ("exit_depth", "exit_depths")):
            bad = both[both[f"{field}_raw"] != both[f"{field}_table"]]
            for _, m in bad.iterrows():
                self.fail(kind, f"tokens.parquet {field} of {m['job']} seq {m['seq']} {m['phase']} request "
                                f"{m['request_id']} position {int(m['position'])} is {int(m[f'{field}_table'])}, "
                                f"the raw record has {int(m[f'{field}_raw'])}")
        if len(tables["requests"]) != req_rows:
            self.fail("tables", f"requests.parquet has {len(tables['requests'])} rows, raw records {req_rows}")
        c = summary.get("counts", {})
        if c.get("tokens") != len(tok) or c.get("requests") != len(tables["requests"]):
            self.fail("counts", f"summary counts {c.get('requests')} requests / {c.get('tokens')} tokens, tables hold "
                                f"{len(tables['requests'])} / {len(tok)}")

    # ------------------------------------------------------------------------------ references
    def check_against_references(self, plan: dict, records: list[dict], refs: dict,
                                 tokens: pd.DataFrame) -> bool:
        before = len(self.discrepancies)
        warmup = plan["config"]["warmup"]
        for r in records:
            ref = refs.get(r["point"])
            if ref is None:
                self.fail("reference", f"{r['job']} seq {r['seq']}: no frozen reference for {r['point']}")
                continue
            frozen = {q["request_id"]: q for q in ref["schedule"]["requests"]}
            for phase in ("warmup", "measured"):
                data = r.get(phase)
                if data is None:
                    if phase == "measured" or warmup:
                        self.fail("reference", f"{r['job']} seq {r['seq']} {r['arm']}: no {phase} run")
                    continue
                where = f"{r['job']} seq {r['seq']} {r['point']} {r['comparison']} pair {r['pair']} arm {r['arm']!r} {phase}"
                if set(data["outputs"]) != set(frozen):
                    self.fail("reference", f"{where}: requests {sorted(data['outputs'])} != frozen {sorted(frozen)}")
                for rid in sorted(set(data["outputs"]) & set(frozen)):
                    for field, kind in (("token_ids", "tokens"), ("exit_depths", "exit_depths")):
                        got, want = data["outputs"][rid][field], frozen[rid][field]
                        if got != want:
                            i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                            self.fail(kind, f"{where} request {rid!r} position {i}: "
                                            f"{got[i] if i < len(got) else '<end>'} != frozen "
                                            f"{want[i] if i < len(want) else '<end>'}")
                    self.count("requests_vs_reference")
                for key in WORK_KEYS:
                    if key in ref["work"] and data["work"].get(key) != ref["work"][key]:
                        self.fail("work", f"{where}: {key} {data['work'].get(key)} != reference {ref['work'][key]}")
                trace = ref["schedule"].get("trace_sha256")
                if data.get("trace_sha256") is not None and trace is not None and data["trace_sha256"] != trace:
                    self.fail("trace", f"{where}: row trace differs from the frozen schedule")
            new_captures = {k: n for k, n in r["measured"]["graphs"].items() if k.endswith("captures") and n}
            if warmup and new_captures:
                self.fail("captures", f"{r['job']} seq {r['seq']} {r['arm']}: {new_captures} in the measured run")
        # The tokens table against the references too (a table edit that also rewrote the raw record).
        expected = []
        seq_point = {(r["job"], r["seq"]): r["point"] for r in records}
        for (job, seq), point in seq_point.items():
            for q in refs.get(point, {}).get("schedule", {}).get("requests", []):
                for pos, (t, d) in enumerate(zip(q["token_ids"], q["exit_depths"])):
                    expected.append((job, seq, q["request_id"], pos, t, d))
        exp = pd.DataFrame(expected, columns=["job", "seq", "request_id", "position", "token_ref", "depth_ref"])
        m = tokens.merge(exp, on=["job", "seq", "request_id", "position"], how="left")
        for field, ref_col, kind in (("token_id", "token_ref", "tokens"), ("exit_depth", "depth_ref", "exit_depths")):
            bad = m[m[field] != m[ref_col]]
            for _, b in bad.iterrows():
                self.fail(kind, f"tokens.parquet {b['job']} seq {b['seq']} {b['phase']} request {b['request_id']} "
                                f"position {int(b['position'])}: {field} {int(b[field])} != frozen reference "
                                f"{b[ref_col]}")
        return len(self.discrepancies) == before

    # --------------------------------------------------------------------------------- numbers
    def check_numbers(self, plan: dict, summary: dict, tables: dict[str, pd.DataFrame], records: list[dict],
                      complete: bool, checks_ok: bool) -> None:
        vd = plan["config"]["verdict"]
        pairs: dict[tuple, dict] = {}
        for r in records:
            pairs.setdefault((r["job"], r["point"], r["comparison"], r["pair"]), {})[r["position"]] = r
        expected_pairs = []
        for key, pr in sorted(pairs.items()):
            if set(pr) == {"baseline", "candidate"}:
                b, c = pr["baseline"], pr["candidate"]
                expected_pairs.append((*key, b["measured"]["elapsed_s"], c["measured"]["elapsed_s"],
                                       b["measured"]["elapsed_s"] / c["measured"]["elapsed_s"], b, c))
        pt = tables["pairs"]
        if len(pt) != len(expected_pairs):
            self.fail("pairs", f"pairs.parquet has {len(pt)} rows, the records make {len(expected_pairs)} complete pairs")
        pt_idx = pt.set_index(["job", "point", "comparison", "pair"]) if len(pt) else None
        for job, point, comp, pair, bs, cs, ratio, *_ in expected_pairs:
            if pt_idx is None or (job, point, comp, pair) not in pt_idx.index:
                self.fail("pairs", f"pairs.parquet lacks {job} {point} {comp} pair {pair}")
                continue
            row = pt_idx.loc[(job, point, comp, pair)]
            for col, want in (("baseline_s", bs), ("candidate_s", cs), ("ratio", ratio)):
                if not _close(row[col], want):
                    self.fail("timing", f"pairs.parquet {col} of {job} {point} {comp} pair {pair} is {row[col]}, "
                                        f"the raw records give {want}")
            self.count("ratios")
        publish = complete and checks_ok
        if bool(summary.get("verdicts_published")) != publish:
            self.fail("verdict", f"summary publishes verdicts: {summary.get('verdicts_published')}, the audit "
                                 f"finds complete={complete}, checks ok={checks_ok}")
        groups: dict[tuple, list] = {}
        for item in expected_pairs:
            groups.setdefault(item[:3], []).append(item)
        results = {(x["job"], x["point"], x["comparison"]): x for x in summary.get("results", [])}
        if set(results) != set(groups):
            self.fail("summary", f"summary has results for {sorted(results)}, the records for {sorted(groups)}")
        report = (self.bundle / "report.md").read_text()
        for key, items in groups.items():
            res = results.get(key)
            if res is None:
                continue
            items = sorted(items, key=lambda x: x[3])
            ratios = np.array([x[6] for x in items])
            st = res["stats"]
            where = f"{key[0]} {key[1]} {key[2]}"
            if len(st["ratios"]) != len(ratios) or not all(_close(a, b) for a, b in zip(st["ratios"], ratios)):
                self.fail("summary", f"{where}: ratios {st['ratios']} != recomputed {ratios.tolist()}")
            speedup = float(np.median(ratios))
            if not _close(st["speedup"], speedup):
                self.fail("summary", f"{where}: speedup {st['speedup']} != recomputed median {speedup}")
            ci = _bootstrap(ratios, vd["confidence"], vd["n_resamples"], vd["bootstrap_seed"], "percentile")
            bca = _bootstrap(ratios, vd["confidence"], vd["n_resamples"], vd["bootstrap_seed"], "BCa")
            for name, got, want in (("CI", st["ci"], ci), ("BCa CI", st["bca_ci"], bca)):
                if (got is None) != (want is None) or (got is not None and not all(_close(a, b) for a, b in zip(got, want))):
                    self.fail("summary", f"{where}: {name} {got} != recomputed {want}")
            if st["distinct_resamples"] != math.comb(2 * len(ratios) - 1, len(ratios)):
                self.fail("summary", f"{where}: distinct resamples {st['distinct_resamples']}")
            if st["wilcoxon_method"] == "exact":
                p = float(scipy.stats.wilcoxon(np.log(ratios), method="exact").pvalue)
                if not _close(p, st["wilcoxon_p"]):
                    self.fail("summary", f"{where}: Wilcoxon p {st['wilcoxon_p']} != recomputed {p}")
            for role, col in (("baseline", "baseline_tokens_per_s"), ("candidate", "candidate_tokens_per_s")):
                tps = float(np.median([x[7 if role == "baseline" else 8]["tokens_per_s"] for x in items]))
                recomputed = float(np.median([x[7 if role == "baseline" else 8]["num_requests"]
                                              * x[7 if role == "baseline" else 8]["output_len"]
                                              / x[4 if role == "baseline" else 5] for x in items]))
                if not _close(res[col], tps) or not _close(res[col], recomputed):
                    self.fail("summary", f"{where}: {col} {res[col]} != recomputed median {recomputed}")
            rule = _verdict(speedup, ci, vd["min_effect"], len(ratios), vd.get("min_pairs", 1))
            if st["verdict"] != rule:
                self.fail("verdict", f"{where}: rule outcome {st['verdict']!r}, recomputed {rule!r}")
            want_verdict = rule if publish else None
            if res.get("verdict") != want_verdict:
                self.fail("verdict", f"{where}: published verdict {res.get('verdict')!r}, expected {want_verdict!r}")
            row = _table_row(res["device"], res["max_num_seqs"], res["num_requests"],
                             float(np.median([x[7]["num_requests"] * x[7]["output_len"] / x[4] for x in items])),
                             float(np.median([x[8]["num_requests"] * x[8]["output_len"] / x[5] for x in items])),
                             speedup, ci, want_verdict)
            if row not in report.splitlines():
                self.fail("report", f"report.md lacks the recomputed row for {where}: {row}")
            self.count("results")

    # ------------------------------------------------------------------------------------- run
    def run(self) -> dict:
        b = self.bundle
        self.section("manifest", self.check_manifest)
        plan = self.section("plan", self.load_json, "plan.json") or {}
        summary = self.section("summary", self.load_json, "summary.json") or {}
        children = self.section("children", self.load_json, "children.json") or []
        records = sorted((json.loads(p.read_text()) for p in sorted((b / "raw").glob("*/*.json"))),
                         key=lambda r: (r["job"], r["seq"]))
        self.count("records", len(records))
        refs = {}
        for pt in plan.get("points", []):
            ref = pt.get("reference")
            if ref:
                refs[pt["key"]] = {"schedule": json.loads((b / ref["file"]).read_text()),
                                   "work": json.loads((b / ref["meta_file"]).read_text())["work"]}
        tables = {}
        for name in TABLES:
            tables[name] = self.section("tables", pd.read_parquet, b / "tables" / f"{name}.parquet")
        if not plan or not summary or any(t is None for t in tables.values()):
            self.fail("bundle", "plan.json, summary.json or a table is missing or unreadable; nothing else is checked")
            return self._verdict(False)
        self.section("plan", self.check_plan, plan, summary)
        self.section("reference", self.check_references, plan, refs)
        self.section("order", self.check_order, plan, records)
        complete = self.section("status", self.check_completeness, plan, summary, records, children)
        self.section("tables", self.check_tables, records, tables, summary)
        checks_ok = self.section("reference", self.check_against_references, plan, records, refs, tables["tokens"])
        if bool(summary.get("checks", {}).get("ok")) != bool(checks_ok):
            self.fail("checks", f"summary says checks ok = {summary.get('checks', {}).get('ok')}, the audit finds "
                                f"{bool(checks_ok)}")
        self.section("summary", self.check_numbers, plan, summary, tables, records, bool(complete), bool(checks_ok))
        return self._verdict(bool(complete))

    def _verdict(self, complete: bool) -> dict:
        status = "fail" if self.discrepancies else ("pass" if complete else "incomplete")
        return {"auditor_version": AUDITOR_VERSION, "status": status, "discrepancies": self.discrepancies,
                "checked": self.checked, "scipy": scipy.__version__, "numpy": np.__version__,
                "note": "audit.json is written after manifest.json and is not listed in it"}


def _rng_kwargs(seed: int) -> dict:
    import inspect

    rng = np.random.default_rng(seed)
    return {"rng": rng} if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else {"random_state": rng}


def _bootstrap(ratios: np.ndarray, confidence: float, n_resamples: int, seed: int, method: str):
    """scipy.stats.bootstrap of the median, fresh default_rng(seed) per call; None if undefined."""
    import warnings

    if ratios.size < 2:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap((ratios,), np.median, n_resamples=n_resamples, confidence_level=confidence,
                                    method=method, vectorized=True, **_rng_kwargs(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return [low, high] if math.isfinite(low) and math.isfinite(high) else None


def _verdict(speedup: float, ci, min_effect: float, n: int, min_pairs: int) -> str:
    if n < min_pairs or ci is None:
        return "inconclusive"
    if ci[0] > 1 and speedup - 1 >= min_effect:
        return "faster"
    if ci[1] < 1 and 1 - speedup >= min_effect:
        return "slower"
    return "inconclusive"


def _table_row(device: str, b: int, c: int, base_tps: float, cand_tps: float, speedup: float, ci, verdict) -> str:
    ci_text = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "[n/a]"
    return (f"| {device} | {b} / {c} | {base_tps:.2f} | {cand_tps:.2f} | {speedup:.4f}× {ci_text} | "
            f"{100 * (speedup - 1):+.2f}% | {verdict if verdict is not None else 'none'} |")


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
    return Audit(Path(bundle)).run()
