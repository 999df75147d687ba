"""The independent auditor: re-derive everything a bundle claims from the bundle alone.

It reads files (JSON, parquet, markdown) and imports nothing from ``loopbench.harness``: what each
table, summary field and report line must be is re-derived by :mod:`.derive` and :mod:`.render` from
the raw arm records and the plan, so a bug in the harness cannot vouch for itself. Each failure below
becomes one named discrepancy; a file that cannot be read is one too, never a crash.

1. files (:mod:`.check_files`): the bundle holds only files of the format contract
   ``loopbench/bundle_format.json`` (:mod:`.contract`; dotfiles included) and every file it requires; the
   manifest records a format version this auditor audits (older ones by their own rules, see the
   contract's ``versions``) and lists every file in the bundle with its sha256 and size, and nothing else;
2. documents (:mod:`.load`): each raw record parses, has the record's fields of the contract's types, and
   sits at ``raw/<job>/<seq>-...json``; plan, references and children.json have their contract fields;
   each table has only declared columns, of their declared types;
3. plan (:mod:`.check_plan`): the config's, prompts' and references' sha256s; each point lists its C
   requests with their prompt_index; every frozen reference runs those requests on those prompts; a seeded
   prompt pool is the contract's ``documents.plan.prompt_rule``'s (format 15);
4. order (:mod:`.check_plan`): the seeded balanced order (first arm ceil/floor per comparison, the same
   permutation: the contract's SHA-256 ``documents.plan.order_rule`` from format 15, numpy's before); every
   record at its planned place with its planned arm, point and workload, measured in that order;
5. devices and sessions (:mod:`.check_sessions`): each record's device is its session's device in the
   plan and in children.json; every child ended (none still ``running``); each record names a session
   child of its job, a pair is measured by one session, a job's sessions follow each other in its order,
   and a completed session measured exactly the seqs its job file asked for; each job file is what the plan asked
   (:mod:`.check_jobs`: device, session, the reference's spec and key material, which each frozen reference's
   cache key hashes); environment.json's GPU of a pinned
   device is the card its records ran on (uuid, name), and its torch the one the reference child ran; from
   format 15 its ``cpu_load`` is there exactly for a run with a CPU session and counts its threads
   (``check_sessions.check_cpu_load``; report.md's warning is re-derived from it), and each record a resume superseded (:mod:`.check_superseded`, under ``superseded/``) is a planned run
   of its session's job, with its log line, measured again by a later session, and in no figure;
6. tables (:mod:`.check_tables`): every column of every row of arms, pairs, requests, tokens and
   telemetry equals what the raw records give, and no row is missing or extra; tokens/s = C * D /
   elapsed_s; each measured elapsed_s lies within its record's wall-clock span;
7. references (:mod:`.check_runs`): every warmup and measured arm reproduces its frozen reference token
   for token and exit for exit, with the reference's work counters and row trace, zero measured Graph
   captures and equal Graph coverage within a pair;
8. coverage (:mod:`.check_runs`): each record of schema 2 carries the coverage counts that the auditor
   derives itself from the frozen schedule and the arm's config (:mod:`.coverage`), whose row trace must
   be the frozen one;
9. summary (:mod:`.check_summary`): every field re-derived (status, reasons as status codes, counts,
   checks, children, verdict rule, and per comparison the names, pairs, tokens/s, ratios, speedup, CIs,
   Wilcoxon p, verdict and its reason); complete or incomplete follows from children.json's structured
   fields (the latest entry per child: its state, exit code and ``interrupted_by``) and the records,
   never from words; a status code the contract does not define is a discrepancy;
10. engine settings (:mod:`.check_settings`, format 9): each record's ``engine_settings`` is an object of JSON
   scalars or null, the runs of one arm at one point and track in one session hold equal ones, and a replayed
   run that names its ``schedule_sha256`` names its point's frozen reference; from format 10 the online records'
   ``engine_settings`` alike, equal across an arm's online runs in one session;
11. logs (:mod:`.check_logs`): each record's elapsed_s and tokens/s are those its session printed to its log
   when it wrote the record, every arm line of a log is a run of the plan, and (format 7) each session's copy
   ceiling the one it printed;
12. plot (:mod:`.check_plot`): ``pair_ratios.png`` is, pixel for pixel, the auditor's own drawing of the
   re-derived ratios, medians and intervals, and ``online/latency.png`` its own drawing of the online records'
   TTFTs and inter-token gaps and the re-derived SLO;
13. report (:mod:`.render`): ``report.md`` equals, line for line, the auditor's own rendering of the
   re-derived figures (no extra, hidden or edited line; no raw HTML).

The verdict goes to ``audit.json`` in the bundle (outside the manifest by design) and the exit status:
0 pass, 1 discrepancies, 3 consistent but incomplete (an honest partial run: nothing to vouch for).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import scipy

from . import (check_files, check_jobs, check_logs, check_natural, check_online, check_plan, check_plot, check_roofline,
               check_runs, check_sessions, check_settings, check_summary, check_superseded, check_tables, check_telemetry,
               contract, evidence, load)
from .context import Audit

AUDITOR_VERSION = 16  # 6: bundle formats 5-6 (telemetry, per-point workloads, graph coverage, online, natural); 7: roofline;
                      # 8: format 9, engine settings; 9: format 10, the online runs' engine settings; 10: format 11,
                      # the signed-rank test in the verdict rule; 11: format 12, exact Spearman p up to 8 values;
                      # 12: format 13, failed requests in the online percentiles; 13: each record against its
                      # session's log line (documents.log), pair_ratios.png against its own drawing, environment.json GPUs
                      # against the records' cards, every format; 14: online request times in one clock's order, each
                      # online record's run settings against plan.json online, plan.json online against config.online;
                      # 15: format 14 (the online trace without numpy, plan.json against the sessions' plan lines);
                      # the derived SLO by the contract's factor; each copy ceiling against its log line; environment
                      # torch against the reference child's; jobs/*.json against the plan; every arm line planned;
                      # 16: format 15, the records a resume superseded (planned, measured again, out of every figure) and
                      # the pair orders and a seeded prompt pool by the contract's SHA-256 rules
EXIT_CODES = contract.DOCS["audit"]["exit_codes"]   # pass 0, fail 1, incomplete 3, usage 2


def _check_files(ctx: Audit, plan, children, records: list[dict]) -> None:
    plan = plan if isinstance(plan, dict) else {}
    children = children if isinstance(children, list) else []
    ctx.section("files", check_files.check_required_files, plan, children, records)
    ctx.section("files", check_files.check_no_links)
    if plan:
        ctx.section("layout", check_files.check_layout, plan, check_files.sessions_ran(children, records))


def _check_measurement(ctx: Audit, plan: dict, records: list[dict], children: list[dict], refs: dict) -> tuple[bool, dict | None]:
    """Plan, order, devices, timing, tables, coverage, references, sessions and the natural track; (True when
    every replay record reproduces its reference: the summary's ``checks.ok``, the natural track's summary)."""
    tables = load.load_tables(ctx)
    ctx.section("plan", check_plan.check_plan, plan)
    ctx.section("plan", check_plan.check_point_requests, plan)
    ctx.section("plan", check_plan.check_prompts, plan)   # format 15: a seeded pool by the contract's rule
    ctx.section("plan", evidence.check_detectable_effect, plan)
    ctx.section("reference", check_plan.check_references, plan, refs)
    ctx.section("order", check_plan.check_order, plan, records)
    ctx.section("devices", check_sessions.check_devices, plan, records, children)
    ctx.section("timing", check_tables.check_timing, records)
    ctx.section("timing", check_tables.check_wall_clock, records)
    ctx.section("tables", check_tables.check_tables, records, tables)
    ctx.section("telemetry", check_telemetry.check_sample_rate, records)
    ctx.section("coverage", check_runs.check_coverage, plan, records, refs)
    checks_ok = bool(ctx.section("reference", check_runs.check_against_references, plan, records, refs))
    ctx.section("sessions", check_sessions.check_child_states, children)
    ctx.section("sessions", check_sessions.check_slurm_jobs, plan, children)
    ctx.section("sessions", check_sessions.check_sessions, plan, records, children)
    ctx.section("jobs", check_jobs.check, plan)   # what each child was asked to do, against the plan
    ctx.section("sessions", evidence.check_session_restarts, plan, records)
    ctx.section("logs", check_logs.check, records, children)   # each record against its session's log line
    ctx.section("logs", check_logs.check_planned, plan, children)   # each arm line a run of the plan
    ctx.section("online", check_online.check, plan, children)   # format 5: the online serving track
    ctx.section("superseded", check_superseded.check, plan, children, records)   # format 15: a resume's lone runs
    ctx.section("roofline", check_roofline.check, plan, records)   # format 7: roofline accounting
    ctx.section("logs", check_logs.check_ceilings, children)   # format 7: each copy ceiling against its log line
    ctx.section("logs", check_logs.check_plan_lines, plan, children)   # format 14: plan.json as the sessions read it
    ctx.section("engine_settings", check_settings.check, plan, records)   # format 9: what each run ran with
    ctx.section("engine_settings", check_settings.check_online, plan, ctx.online_records, records)   # format 10
    return checks_ok, ctx.section("natural", check_natural.check, plan, records)


def _check_claims(ctx: Audit, plan: dict, summary: dict, records: list[dict], children: list[dict], refs: dict,
                  environment, checks_ok: bool, natural: dict | None = None) -> bool:
    """Status, summary.json and report.md; True when the run is complete."""
    interrupted = ctx.section("status", check_summary.interruption, plan, children)
    complete = bool(ctx.section("status", check_summary.is_complete, plan, records, children, interrupted))
    ctx.section("summary.json", check_summary.check_status_codes, summary)
    expected = ctx.section("summary.json", check_summary.expected_summary, plan, summary, records, children, refs,
                           complete, checks_ok, interrupted, natural)
    if expected is not None:
        ctx.section("summary.json", check_summary.check_summary, summary, expected)
        ctx.section("pair_ratios.png", check_plot.check, expected, environment)   # the figure report.md shows
        if isinstance(environment, dict) and (ctx.bundle / "report.md").is_file():
            want = ctx.section("report.md", check_summary.expected_report, plan, expected, records, environment)
            if want is not None:
                ctx.section("report.md", check_summary.check_report, want)
    ctx.section(check_plot.LATENCY_FILE, check_plot.check_latency, environment)   # the online section's figure
    return complete


def run(ctx: Audit) -> dict:
    """Every check of the module docstring, in order; the verdict."""
    ctx.section("manifest", check_files.check_manifest)
    plan, summary = ctx.read_json("plan.json"), ctx.read_json("summary.json")
    children, environment = ctx.read_json("children.json"), ctx.read_json("environment.json")
    records = ctx.section("raw", load.load_records) or []
    ctx.count("records", len(records))
    _check_files(ctx, plan, children, records)
    if not (isinstance(plan, dict) and isinstance(summary, dict) and isinstance(children, list)):
        ctx.fail("bundle", "plan.json, summary.json or children.json is missing or unreadable; nothing else is checked")
        return verdict(ctx, False)
    if environment is not None:
        ctx.section("environment.json", load.check_environment, environment)
        ctx.section("environment.json", check_sessions.check_environment_gpus, plan, records, environment)
        ctx.section("environment.json", check_sessions.check_environment_torch, plan, environment)
        ctx.section("environment.json", check_sessions.check_cpu_load, plan, environment)
    refs = ctx.section("reference", load.load_references, plan) or {}
    checks_ok, natural = _check_measurement(ctx, plan, records, children, refs)
    return verdict(ctx, _check_claims(ctx, plan, summary, records, children, refs, environment, checks_ok, natural))


def verdict(ctx: Audit, complete: bool) -> dict:
    """audit.json: fail with any discrepancy, else pass when complete, else incomplete."""
    status = "fail" if ctx.discrepancies else ("pass" if complete else "incomplete")
    return {"auditor_version": AUDITOR_VERSION, "status": status, "discrepancies": ctx.discrepancies,
            "checked": ctx.checked, "scipy": scipy.__version__, "numpy": np.__version__,
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
    ctx = Audit(Path(bundle))
    try:
        return run(ctx)
    except Exception as exc:
        ctx.fail("auditor", f"stopped early: {type(exc).__name__}: {exc}")
        return verdict(ctx, False)
