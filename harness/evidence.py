"""The evidence bundle: raw arm records in, parquet tables, summary, report, plot and manifest out.

A bundle (``results/<date>-<name>-<short sha>/``) is what the versioned contract
``loopbench/bundle_format.json`` (:data:`FORMAT`, explained in ``audit/FORMAT.md``) defines: files, table
columns (type, unit; an undeclared one is never written), JSON documents, status codes. The auditor reads
the same file; ``manifest.json`` records its version beside the sha256 and size of every other file.
Why a run is incomplete is a list of status codes (``{"code": "child_failed", ...}``), worded by report.py.

Every file is written atomically (temporary file in the same folder, fsync, rename), so a crash leaves
either the old file or the new one, and at worst a dot-named ``*.tmp`` that :func:`remove_stale_temp_files`
sweeps before publishing. A run that lost an arm, a pair or a child is marked incomplete and
publishes no verdict; its completed arms stay in the bundle.

Bundle states (DESIGN.md, "Bundle states"): *in progress* (no manifest; ``children.json`` lists running
children), *published* (``manifest.json`` written last by :func:`finalize`): complete, or incomplete
(failed, killed, timed out, interrupted, or finished after its controller died). An incomplete bundle
may be resumed: the resume unpublishes it (:func:`unpublish`) and publishes again when done.

report.py renders report.md; the auditor re-renders the whole report from the raw records with its own
code (audit/render.py, driven by the same contract) and requires an exact match.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from . import diagnostics, graph_coverage, natural, roofline, telemetry
from . import stats as _stats
from .fileio import (atomic_write_bytes, atomic_write_json, atomic_write_text, bundle_format,  # noqa: F401
                     canonical_json, sha256_bytes, sha256_file, try_lock)

FORMAT = bundle_format()
FORMAT_VERSION = FORMAT["version"]
SCHEMA_VERSION = FORMAT["tables"]["schema_version"]
SUMMARY_SCHEMA_VERSION = FORMAT["documents"]["summary"]["schema_version"]
TABLES = tuple(FORMAT["table_names"])
UNMANIFESTED = tuple(FORMAT["unmanifested"])
STATUS_CODES = FORMAT["status_codes"]["codes"]


def columns(table: str) -> list[str]:
    """The declared columns of ``table``, in the contract's order."""
    return [c["name"] for c in FORMAT["tables"][table]["columns"]]


def _published() -> tuple[str, ...]:
    """What finalize() writes from the records (and the auditor after it): the files of those writers in the
    contract, the manifest first (unpublish() removes it first)."""
    writers = ("harness/evidence.py", "harness/report.py", "audit/auditor.py", "harness/online/evidence.py")
    paths = [f["path"].replace("{table}", t) for f in FORMAT["files"] if f["writer"] in writers
             for t in (TABLES if "{table}" in f["path"] else [""])]
    return tuple(sorted(paths, key=lambda p: p != "manifest.json"))


PUBLISHED = _published()


# ------------------------------------------------------------------------------------- temporary files

def remove_stale_temp_files(bundle: Path) -> list[str]:
    """Delete the dot-named ``*.tmp`` files that writers killed mid-write left (this module's and the
    auditor's); returns their bundle-relative paths. Call it only when no writer of the bundle runs."""
    bundle = Path(bundle)
    stale = sorted(p for p in bundle.rglob(".*.tmp") if p.is_file())
    for p in stale:
        p.unlink()
    return [p.relative_to(bundle).as_posix() for p in stale]


def arrow_type(declared: str) -> pa.DataType:
    """The arrow type of a contract column type ("string", "int64", "list<int64>", ...)."""
    if declared.startswith("list<") and declared.endswith(">"):
        return pa.list_(arrow_type(declared[5:-1]))
    return pa.type_for_alias(declared)


def empty_table(name: str) -> pa.Table:
    """A table without rows: every column the contract declares for ``name``, of its declared type."""
    return pa.table({c["name"]: pa.array([], type=arrow_type(c["type"])) for c in FORMAT["tables"][name]["columns"]})


def write_table(path: Path, df: pd.DataFrame | pa.Table) -> None:
    """Parquet with ``loopbench_schema_version`` in the schema metadata, written atomically."""
    table = df if isinstance(df, pa.Table) else pa.Table.from_pandas(df, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[b"loopbench_schema_version"] = str(SCHEMA_VERSION).encode()
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


# ----------------------------------------------------------------------------------------- bundle dir

def bundle_dir(results_dir: Path, name: str, short_sha: str, today: _dt.date | None = None) -> Path:
    """``results/<date>-<name>-<short sha>``, with ``-2``, ``-3``... when that exists already."""
    today = today or _dt.date.today()
    base = Path(results_dir) / f"{today.isoformat()}-{name}-{short_sha}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    path.mkdir(parents=True)
    return path


def load_records(bundle: Path) -> list[dict]:
    """Every raw arm record in the bundle, by (job, seq)."""
    recs = [json.loads(p.read_text()) for p in sorted((Path(bundle) / "raw").glob("*/*.json"))]
    return sorted(recs, key=lambda r: (r["job"], r["seq"]))


# ------------------------------------------------------------------------------------------- tables

GRAPH_COLUMNS = ("captures", "replays", "fallbacks", "prefill_captures", "prefill_replays", "prefill_fallbacks")


def _phase_row(prefix: str, phase: dict | None) -> dict:
    keys = ("elapsed_s", *GRAPH_COLUMNS, "peak_allocated_bytes", "peak_reserved_bytes")
    if phase is None:
        return {f"{prefix}{k}": None for k in keys}
    row = {f"{prefix}elapsed_s": phase["elapsed_s"]}
    row.update({f"{prefix}{k}": phase["graphs"].get(k, 0) for k in GRAPH_COLUMNS})
    row.update({f"{prefix}{k}": phase["memory"][k] for k in ("peak_allocated_bytes", "peak_reserved_bytes")})
    return row


def _coverage_columns(record: dict) -> dict:
    """``coverage_<count>`` columns of one arm (harness/coverage.py); none for a record without coverage."""
    return {f"coverage_{k}": v for k, v in sorted((record.get("coverage") or {}).items())}


def build_tables(records: list[dict]) -> dict[str, pd.DataFrame]:
    """Flatten raw records into the bundle's five tables (one row per arm / pair / request / token / sample)."""
    arms, reqs, toks, tele = [], [], [], []
    for r in records:
        m = r["measured"]
        row = {"job": r["job"], "seq": r["seq"], **({"session": r["session"]} if "session" in r else {}),
               "device": r["device"]["label"], "point": r["point"],
               "max_num_seqs": r["max_num_seqs"], "num_requests": r["num_requests"], "output_len": r["output_len"],
               "comparison": r["comparison"], "pair": r["pair"], "position": r["position"], "slot": r["slot"],
               "arm": r["arm"], **{f"arm_{k}": v for k, v in sorted(r["arm_config"].items())},
               "tokens_per_s": r["tokens_per_s"]}
        row.update(_phase_row("", m))
        # the measured run's wall-clock span (format version 3); a record without one is the auditor's to name
        row.update({k: (r.get("wall_clock") or {}).get(k) for k in ("measured_start_unix_s", "measured_end_unix_s")})
        row.update(_phase_row("warmup_", r.get("warmup")))
        for k, v in sorted(m["work"].items()):
            row[f"work_{k}"] = v
        row["kv_blocks_used"] = m["kv_blocks_used"]
        row["trace_sha256"] = m.get("trace_sha256")
        row.update(_coverage_columns(r))
        row["eager_fraction"] = graph_coverage.record_eager_fraction(r)   # format 5
        row.update(telemetry.arm_summary(r))                               # format 5
        arms.append(row)
        for phase in ("warmup", "measured"):
            data = r.get(phase)
            if data is None:
                continue
            for rid, out in sorted(data["outputs"].items()):
                depths = out["exit_depths"]
                reqs.append({"job": r["job"], "seq": r["seq"], "arm": r["arm"], "point": r["point"],
                             "phase": phase, "request_id": rid, "num_tokens": len(out["token_ids"]),
                             "finish_reason": out["finish_reason"],
                             "mean_exit_depth": float(np.mean(depths)) if depths else None})
                for pos, (tok, dep) in enumerate(zip(out["token_ids"], depths)):
                    toks.append((r["job"], r["seq"], r["point"], r["comparison"], r["arm"], phase, rid, pos, tok, dep))
        tele += _telemetry_rows(r)
    tokens = pd.DataFrame(toks, columns=columns("tokens"))
    arms_df = pd.DataFrame(arms)
    return {"arms": arms_df, "pairs": build_pairs(arms_df), "requests": pd.DataFrame(reqs),
            "tokens": tokens.astype({"position": "int32", "token_id": "int64", "exit_depth": "int16"}),
            "telemetry": pd.DataFrame(tele, columns=None if tele else ["job", "seq", "arm", "when", "sample"])}


def _telemetry_rows(r: dict) -> list[dict]:
    """telemetry.parquet rows of one record: the start reading, the sampler's readings during the measured
    run (``when`` = during, ``sample`` 0..n-1; format 5) and the end reading."""
    tele = r.get("telemetry") or {}
    ident = {"job": r["job"], "seq": r["seq"], "arm": r["arm"]}
    rows = [{**ident, "when": "start", "sample": 0, **tele["start"]}] if tele.get("start") else []
    rows += [{**ident, "when": "during", "sample": i, **s} for i, s in enumerate(tele.get("samples") or [])]
    return rows + ([{**ident, "when": "end", "sample": 0, **tele["end"]}] if tele.get("end") else [])


def build_pairs(arms: pd.DataFrame) -> pd.DataFrame:
    """One row per complete pair: both arms' measured seconds and ratio = baseline_s / candidate_s."""
    rows = []
    if len(arms):
        for key, grp in arms.groupby(["job", "point", "comparison", "pair"], sort=True):
            if set(grp["position"]) != {"baseline", "candidate"} or len(grp) != 2:
                continue
            b = grp[grp["position"] == "baseline"].iloc[0]
            c = grp[grp["position"] == "candidate"].iloc[0]
            rows.append({"job": b["job"], "device": b["device"], "point": b["point"],
                         "max_num_seqs": int(b["max_num_seqs"]), "num_requests": int(b["num_requests"]),
                         "output_len": int(b["output_len"]), "comparison": b["comparison"], "pair": int(b["pair"]),
                         "first": "baseline" if b["slot"] == 0 else "candidate",
                         "baseline_arm": b["arm"], "candidate_arm": c["arm"],
                         "baseline_seq": int(b["seq"]), "candidate_seq": int(c["seq"]),
                         "baseline_s": float(b["elapsed_s"]), "candidate_s": float(c["elapsed_s"]),
                         "ratio": float(b["elapsed_s"]) / float(c["elapsed_s"])})
    return pd.DataFrame(rows, columns=columns("pairs"))


def write_tables(bundle: Path, tables: dict[str, pd.DataFrame]) -> None:
    """Every table of the format; a column the format does not declare is a bug here, never written."""
    for name in TABLES:
        extra = [c for c in tables[name].columns if c not in columns(name)]
        if extra:
            raise ValueError(f"{name}.parquet would get columns {extra} that loopbench/bundle_format.json "
                             f"version {FORMAT_VERSION} does not declare")
        # no rows: pandas would type the columns null (or drop them); the contract declares them all
        df = tables[name] if len(tables[name]) else empty_table(name)
        write_table(Path(bundle) / "tables" / f"{name}.parquet", df)


def point_requests(num_requests: int, first_prompt: int = 0) -> list[dict]:
    """A plan point's requests as plan.json lists them: ids r0000.. on C prompts of the pool from
    ``first_prompt`` on (0: the workload's; a point's own prompt length has its own block, harness/workloads.py);
    the auditor reads each request's prompt from this list."""
    return [{"request_id": f"r{i:04d}", "prompt_index": first_prompt + i} for i in range(num_requests)]


# ------------------------------------------------------------------------------------------- summary

def current_children(children: list[dict]) -> list[dict]:
    """The latest entry of each child name (a resume appends its sessions after the earlier ones)."""
    latest: dict[str, dict] = {}
    for ch in children:
        latest[ch["name"]] = ch
    return list(latest.values())


def stop_code(interrupted_by: str) -> dict:
    """The status code of a child's structured ``interrupted_by``: a signal the controller got, or ``lost``."""
    return {"code": "lost"} if interrupted_by == "lost" else {"code": "stopped", "by": interrupted_by}


def incomplete_reasons(children: list[dict], interrupted: str | None, recorded: int, planned: int) -> list[dict]:
    """Why a run is incomplete, as the contract's status codes in its order: how the controller stopped,
    ``interrupted`` (the code of a reason the children do not show: ``reference_failed``), each current
    child that did not complete, and missing arms."""
    if interrupted is not None and (interrupted not in STATUS_CODES or STATUS_CODES[interrupted]["fields"]):
        raise ValueError(f"interrupted = {interrupted!r} is not a field-less status code of the bundle format "
                         f"({sorted(c for c, d in STATUS_CODES.items() if not d['fields'])})")
    current = current_children(children)
    reasons = [stop_code(by) for by in dict.fromkeys(ch.get("interrupted_by") for ch in current) if by]
    reasons += [{"code": interrupted}] if interrupted else []
    reasons += [{"code": "child_failed", "child": ch.get("session", ch["name"]), "state": ch["state"],
                 "exit_code": ch["exit_code"]} for ch in current if ch["exit_code"] != 0 or ch["state"] != "completed"]
    if recorded != planned:
        reasons.append({"code": "arms_missing", "recorded": recorded, "planned": planned})
    return reasons


def comparison_results(plan: dict, arms: pd.DataFrame, pairs: pd.DataFrame, publish: bool) -> list[dict]:
    """The summary's ``results``: per (device, point, comparison) of the plan with a complete pair, its
    statistics and medians of tokens/s; its verdict only when ``publish``."""
    cfg, results = plan["config"], []
    vd = cfg["verdict"]
    groups = dict(iter(pairs.groupby(["job", "point", "comparison"], sort=False))) if len(pairs) else {}
    for job, point, comp in [(d["name"], pt["key"], c["name"]) for d in plan["devices"] for pt in plan["points"]
                             for c in cfg["comparisons"]]:
        if (job, point, comp) not in groups:
            continue
        grp = groups[(job, point, comp)].sort_values("pair")
        st = _stats.compare(grp["baseline_s"].tolist(), grp["candidate_s"].tolist(), confidence=vd["confidence"],
                            n_resamples=vd["n_resamples"], seed=vd["bootstrap_seed"], min_effect=vd["min_effect"],
                            min_pairs=vd["min_pairs"], sessions=diagnostics.pair_sessions(grp["pair"].tolist(), cfg))
        first = grp.iloc[0]
        sel = arms[(arms["job"] == job) & (arms["point"] == point) & (arms["comparison"] == comp)
                   & arms["pair"].isin(set(grp["pair"]))]
        results.append({
            "job": job, "device": first["device"], "point": point,
            "max_num_seqs": int(first["max_num_seqs"]), "num_requests": int(first["num_requests"]),
            "output_len": int(first["output_len"]), "comparison": comp,
            "baseline": first["baseline_arm"], "candidate": first["candidate_arm"],
            "pairs": [int(p) for p in grp["pair"]],
            "baseline_tokens_per_s": float(np.median(sel[sel["position"] == "baseline"]["tokens_per_s"])),
            "candidate_tokens_per_s": float(np.median(sel[sel["position"] == "candidate"]["tokens_per_s"])),
            "stats": st.to_dict(), "verdict": st.verdict if publish else None,
            "evidence": diagnostics.comparison_evidence(grp, cfg),
        })
        _bar_on_graph_coverage(results[-1], grp, arms, vd)
    return results


def _bar_on_graph_coverage(res: dict, grp: pd.DataFrame, arms: pd.DataFrame, vd: dict) -> None:
    """Format 5: the result's ``graph_coverage`` (harness/graph_coverage.py); a published verdict of a
    comparison whose paired arms' eager fractions differ becomes ``graph_coverage.BARRED``."""
    frac = {(j, int(s)): (None if pd.isna(f) else float(f))
            for j, s, f in zip(arms["job"], arms["seq"], arms["eager_fraction"])}
    pairs = [(frac[(j, int(b))], frac[(j, int(c))]) for j, b, c in zip(grp["job"], grp["baseline_seq"], grp["candidate_seq"])]
    res["graph_coverage"] = graph_coverage.result_coverage(pairs, vd["eager_fraction_tolerance"])
    if res["verdict"] is not None and res["graph_coverage"]["differs"]:
        res["verdict"] = graph_coverage.BARRED


def summarize(plan: dict, plan_sha256: str, tables: dict[str, pd.DataFrame], checks: dict,
              children: list[dict], interrupted: str | None = None) -> dict:
    """Status, counts and per (job, point, comparison) statistics; a verdict only for a complete, checked run.

    ``children`` is every child of every run of the bundle; the latest entry per name decides.
    """
    vd = plan["config"]["verdict"]
    arms, pairs = tables["arms"], tables["pairs"]
    planned = sum(len(v) for v in plan["order"].values())
    reasons = incomplete_reasons(children, interrupted, int(len(arms)), planned)
    status = "incomplete" if reasons else "complete"
    publish = status == "complete" and checks["ok"]
    results = comparison_results(plan, arms, pairs, publish)
    barred = None if publish else ("run incomplete" if status != "complete" else "checks failed")
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION, "name": plan["name"], "status": status,
        "incomplete_reasons": reasons, "verdicts_published": publish, "verdicts_barred_by": barred,
        "plan_sha256": plan_sha256,
        "verdict_rule": {"min_effect": vd["min_effect"], "confidence": vd["confidence"], "min_pairs": vd["min_pairs"],
                         "ci_method": "percentile bootstrap of the median", "n_resamples": vd["n_resamples"],
                         "bootstrap_seed": vd["bootstrap_seed"]},
        "counts": {"arms_planned": planned, "arms_recorded": int(len(arms)),
                   "pairs_planned": planned // 2, "pairs_complete": int(len(pairs)),
                   "requests": int(len(tables["requests"])), "tokens": int(len(tables["tokens"]))},
        "checks": checks, "children": children, "results": results,
        "evidence_rule": diagnostics.evidence_rule(plan["config"]), "memory_creep": diagnostics.memory_creep(plan, arms),
        "noise_floor": diagnostics.noise_floor(results),   # format 15: an A/A control that reads a change
    }


NATURAL_TABLES = ("natural", "natural_divergences")


def write_natural(bundle: Path, plan: dict, records: list[dict]) -> dict:
    """The natural track's tables (harness/natural.py) from the traced runs and raw records; returns the
    summary's ``natural``."""
    rows, divs = natural.derive(plan, records, natural.load_traces(bundle, plan))
    for name, data in zip(NATURAL_TABLES, (rows, divs)):
        df = pd.DataFrame(data, columns=columns(name)) if data else empty_table(name)
        write_table(Path(bundle) / "tables" / f"{name}.parquet", df)
    return natural.summary(plan, rows, divs)


def write_roofline(bundle: Path, plan: dict, records: list[dict]) -> tuple[list[dict], dict[str, dict]]:
    """Format 7: ``tables/roofline.parquet`` (harness/roofline.py) from the raw records, the prompts and the
    sessions' copy ceilings; returns (its rows, the ceilings by session) for the report."""
    prompts = json.loads((Path(bundle) / plan["prompts"]["file"]).read_text())
    ceilings = roofline.load_ceilings(bundle)
    rows = roofline.derive(plan, prompts, records, ceilings)
    schema = empty_table("roofline").schema
    write_table(Path(bundle) / "tables" / "roofline.parquet", pa.Table.from_pylist(rows, schema=schema))
    return rows, ceilings


def write_manifest(bundle: Path) -> dict:
    """sha256 and size of every file in the bundle except the manifest itself and the audit verdict, and the
    version of the format contract the bundle follows."""
    bundle = Path(bundle)
    files = {}
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and rel not in UNMANIFESTED and not p.name.startswith("."):
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {"schema_version": SCHEMA_VERSION, "format_version": FORMAT_VERSION, "files": files}
    atomic_write_json(bundle / "manifest.json", manifest)
    return manifest


def unlike_manifest(bundle: Path) -> str | None:
    """For a published bundle, in words, the first way its files differ from its ``manifest.json``: the manifest
    damaged, an entry outside the bundle, a manifested file missing or whose sha256 changed; None when all match or
    when there is no manifest (a lost controller's bundle was never signed). Never raises for a damaged bundle."""
    bundle = Path(bundle)
    try:
        files = json.loads((bundle / "manifest.json").read_text())["files"]
        entries = sorted((str(rel), entry["sha256"]) for rel, entry in files.items())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "manifest.json is damaged"
    root = bundle.resolve()
    for rel, sha in entries:
        f = bundle / rel
        if root not in f.resolve().parents:
            return f"manifest.json lists {rel}, outside the bundle"
        if not f.is_file():
            return f"{rel} is missing"
        if sha256_file(f) != sha:
            return f"{rel} changed"
    return None


def unpublish(bundle: Path) -> None:
    """Back to *in progress* before a resume measures more: the manifest goes first, so a resume that dies
    leaves a bundle that reads as unpublished (``finish`` publishes it again), never a stale published one."""
    for rel in PUBLISHED:
        (Path(bundle) / rel).unlink(missing_ok=True)


def finalize(bundle: Path, plan: dict, checks: dict, children: list[dict], environment: dict,
             interrupted: str | None = None) -> dict:
    """Tables, summary, report, plot and manifest from whatever raw records the bundle holds; ``interrupted``
    is the status code of a reason children.json does not show (``"reference_failed"``) or None."""
    from . import report_sections, superseded
    from .report import plot_ratios, render_report   # report reads this module's FORMAT

    bundle = Path(bundle)
    records = load_records(bundle)
    tables = build_tables(records)
    write_tables(bundle, tables)
    summary = summarize(plan, sha256_file(bundle / "plan.json"), tables, checks, children, interrupted)
    if "natural" in plan:
        summary["natural"] = write_natural(bundle, plan, records)
    atomic_write_json(bundle / "summary.json", summary)
    plot_ratios(summary, tables["pairs"], bundle / "pair_ratios.png")
    from .online.evidence import publish as publish_online   # the online track's files and report lines

    online = publish_online(bundle, plan)
    roof = write_roofline(bundle, plan, records)
    settings = report_sections.runtime_settings(plan, records)   # format 9: what each run ran with
    atomic_write_text(bundle / "report.md", render_report(plan, summary, tables["arms"], environment, online, roof,
                                                          settings, superseded.report_lines(bundle, children)))
    write_manifest(bundle)
    return summary
