"""A forger's tools: edit a bundle's files and rewrite its manifest to match, so that it is the auditor's
re-derivation that must catch the edit, not the manifest's hashes."""
import contextlib
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from loopbench.audit import check_plan, contract
from loopbench.audit.auditor import audit
from loopbench.harness import evidence, inputs, stats, workloads

REPO = Path(__file__).resolve().parents[2]
BEFORE_HASH_RULES = contract.DOCS["plan"]["order_rule_since"] - 1   # the last format of numpy's order and prompts


def numpy_balanced_first(n_pairs: int, seed) -> tuple[str, ...]:
    """harness stats.balanced_first as writers of formats up to 14 drew it (documents.plan.order_rule_before, numpy's
    Generator): the auditor's copy of that rule stands in for the old writer."""
    return tuple(check_plan.first_arms(n_pairs, [seed] if isinstance(seed, int) else list(seed), BEFORE_HASH_RULES))


def numpy_prompts(spec, vocab_size: int) -> list[list[int]]:
    """harness inputs.make_prompts of a seeded pool as writers of formats up to 14 drew it
    (documents.plan.prompt_rule_before): one [C, P] draw of numpy's Generator, or one draw per prompt in order."""
    wl = spec.workload
    rng, need = np.random.default_rng(wl.prompt_seed), workloads.workload_requests(spec)
    if wl.prompt_lens:
        return [rng.integers(0, vocab_size, size=wl.prompt_lens[i % len(wl.prompt_lens)]).tolist() for i in range(need)]
    return rng.integers(0, vocab_size, size=(need, wl.prompt_len)).tolist()


@contextlib.contextmanager
def numpy_draws():
    """The harness drawing its pair orders and its workload's prompts as a format-14 writer did (numpy's Generator),
    for a bundle that a test claims as an older format: format 15 draws both by the contract's SHA-256 rules."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats, "balanced_first", numpy_balanced_first)
        patch.setattr(inputs, "make_prompts", numpy_prompts)
        yield patch


def rewrite_manifest(bundle: Path) -> None:
    """A forger's manifest: every file now in the bundle, dotfiles included, with its true sha256, and the
    format version the bundle's manifest recorded."""
    files = {}
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and rel not in ("manifest.json", "audit.json"):
            files[rel] = {"sha256": evidence.sha256_file(p), "bytes": p.stat().st_size}
    old = json.loads((bundle / "manifest.json").read_text()) if (bundle / "manifest.json").is_file() else {}
    version = {k: old[k] for k in ("format_version", "layout_version") if k in old} \
        or {"format_version": evidence.FORMAT_VERSION}
    evidence.atomic_write_json(bundle / "manifest.json", {"schema_version": 1, **version, "files": files})


def strip_version_15_flags(bundle: Path) -> None:
    """What format 15 added to summary.json, environment.json and report.md taken out: ``noise_floor`` and its
    warnings above the result tables, ``cpu_load`` and its warning under the header (a blank line before it)."""
    edit_json(bundle / "summary.json", lambda s: s.pop("noise_floor", None))
    edit_json(bundle / "environment.json", lambda e: e.pop("cpu_load", None))

    def drop(lines):
        out, after_warning = [], False
        for line in lines:
            if line.endswith("(environment.json cpu_load)."):
                out.pop()    # the blank line before it
            elif line.endswith("(summary.json noise_floor)."):
                after_warning = True
            elif not (after_warning and line == ""):    # the blank line after the last warning
                out.append(line)
            if not line.endswith("(summary.json noise_floor)."):
                after_warning = False
        return out
    edit_report(bundle, drop)


def passes_as_version(bundle: Path, version: int) -> None:
    """Claim format ``version`` in the manifest (rewritten to match the files, what format 15 added to the documents
    taken out below it: ``strip_version_15_flags``) and require the audit to pass."""
    if version < 15:
        strip_version_15_flags(bundle)
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=version))
    rewrite_manifest(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]


def edit_table(bundle: Path, name: str, fn) -> None:
    df = pd.read_parquet(bundle / "tables" / f"{name}.parquet")
    evidence.write_table(bundle / "tables" / f"{name}.parquet", fn(df))


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def edit_report(bundle: Path, fn) -> None:
    path = bundle / "report.md"
    path.write_text("\n".join(fn(path.read_text().split("\n"))))


def raw(bundle: Path, seq: int) -> Path:
    return next((bundle / "raw" / "cpu0").glob(f"{seq:05d}-*.json"))


def failed(bundle: Path) -> str:
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    return "\n".join(verdict["discrepancies"])


def forge_settings(bundle: Path, path: Path, **settings) -> str:
    """The record at ``path`` (a raw arm or online record) with ``settings`` over its ``engine_settings``, the
    manifest rewritten to match; the failed audit's discrepancies."""
    edit_json(path, lambda rec: rec["engine_settings"].update(settings))
    rewrite_manifest(bundle)
    return failed(bundle)


def tampered(value):
    """A different value of the same kind."""
    if isinstance(value, (bool, np.bool_)):
        return not value
    if isinstance(value, (int, np.integer)):
        return int(value) + 1
    if isinstance(value, (float, np.floating)):
        return 1.0 if np.isnan(value) else float(value) * 1.5 + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 1
    return [int(v) + 1 for v in value]


def leaves(data, path=""):
    """(path, value) of every leaf of a JSON document, paths spelt as the auditor spells them."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(data, list) and data:
        for i, v in enumerate(data):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, data


def set_leaf(data, path: str, value) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")]
    for k in keys[:-1]:
        data = data[k]
    data[keys[-1]] = value


def every_leaf_named(bundle: Path, rel: str, message, select=lambda path: True) -> set[str]:
    """Change each selected leaf of the JSON document ``rel`` in turn (a different value of its kind; a
    forged string for null or []), rewrite the manifest and require the audit to fail with
    ``message(leaf)`` among its discrepancies; returns the paths changed. The document is restored."""
    path = bundle / rel
    original = path.read_text()
    every = [(p, v) for p, v in leaves(json.loads(original)) if select(p)]
    for leaf, value in every:
        data = json.loads(original)
        set_leaf(data, leaf, ["forged"] if value == [] else tampered(value) if value is not None else "forged")
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        rewrite_manifest(bundle)
        text = failed(bundle)
        assert message(leaf) in text, (leaf, text)
    path.write_text(original)
    return {p for p, _ in every}


def forge_elapsed(bundle: Path, seq: int, fn) -> dict:
    """Change one measured elapsed_s in its raw record and let the harness re-derive everything from it
    (tokens/s, tables, summary, report, plot, manifest), as a forger with the harness would."""
    path = raw(bundle, seq)
    rec = json.loads(path.read_text())
    fn(rec)
    rec["tokens_per_s"] = stats.tokens_per_s(rec["num_requests"], rec["output_len"], rec["measured"]["elapsed_s"])
    path.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    republish(bundle)
    return rec


def rebind_plan_lines(bundle: Path) -> None:
    """Every session log's plan.json sha256 line (format 14) rewritten to the bundle's plan.json as it now is: a forger
    who edits the plan and covers the line the sessions printed (the line binds the plan to the log, not to the run)."""
    sha = hashlib.sha256((bundle / "plan.json").read_bytes()).hexdigest()
    for log in (bundle / "logs").glob("*.log"):
        log.write_text(re.sub(r"(: plan\.json sha256 )[0-9a-f]{64}", rf"\g<1>{sha}", log.read_text()))


def republish(bundle: Path) -> None:
    """Tables, summary, report, plot and manifest written again by the harness from the bundle's files as they now
    are: a forger with the harness covers an edit with every figure that follows from it."""
    plan, summary, children, env = (json.loads((bundle / f"{name}.json").read_text())
                                    for name in ("plan", "summary", "children", "environment"))
    evidence.finalize(bundle, plan, summary["checks"], children, env)


def _reword_as_version_6(bundle: Path) -> None:
    """report.md as formats 4 to 6 worded it: "GPU" and "cpu" for "Device" and "CPU", the result table's
    columns without the arms' roles, the interval's level or "speedup - 1", and counts of one in the plural
    (or "session(s)"); summary.json's verdict reasons with "1 pairs"; the manifest's ``format_version`` is
    the caller's to set."""
    def reasons(s):
        for r in s["results"]:
            r["stats"]["verdict_reason"] = r["stats"]["verdict_reason"].replace("1 pair,", "1 pairs,")
    edit_json(bundle / "summary.json", reasons)
    lines = (bundle / "report.md").read_text().split("\n")
    for i, line in enumerate(lines):
        if line.startswith("| "):
            if i + 1 < len(lines) and lines[i + 1].startswith("|---"):
                line = line.replace("| Device |", "| GPU |", 1)
                line = line.replace(" (baseline) tokens/s", " tokens/s").replace(" (candidate) tokens/s", " tokens/s")
                line = re.sub(r"\[[\d.]+% CI\]", "[95% CI]", line).replace("Throughput change (speedup - 1)",
                                                                           "Throughput change")
            line = line.replace("| CPU |", "| cpu |")
        line = re.sub(r"\b(\d+) independent sessions?\b", r"\1 independent session(s)", line)
        lines[i] = re.sub(r"\b1 (pair|arm|run|request|output token|balanced pair)\b", r"1 \1s", line)
    (bundle / "report.md").write_text("\n".join(lines))


def strip_version_3(bundle: Path) -> None:
    """What format 3 added, taken out of summary.json and report.md (sessions and drift sections, the
    rule sentence), as a format-2 writer would have left a one-session bundle; plan.json's
    ``detectable_effect`` is the caller's to drop (it changes the plan's sha256)."""
    def summary(s):
        s.pop("evidence_rule")
        s.pop("memory_creep")
        s.pop("natural", None)   # format 5 (a bundle without natural comparisons has no report section)
        for r in s["results"]:
            r.pop("evidence")
    edit_json(bundle / "summary.json", summary)
    plan = json.loads((bundle / "plan.json").read_text())
    spec = evidence.FORMAT["report"]

    def rule(line: str) -> str:
        return spec["result"]["rule"].format(**plan["config"]["verdict"]) if line.startswith("Tokens/s are medians") \
            else line
    drop_report_sections(bundle, {spec["headings"]["sessions"], spec["headings"]["drift"]}, rule)


def drop_report_sections(bundle: Path, headings: set[str], rewrite=lambda line: line) -> None:
    """report.md without the sections of ``headings`` (and the blank line each opens with); every other
    line through ``rewrite``."""
    out, skipping = [], False
    for line in (bundle / "report.md").read_text().split("\n"):
        if line.startswith("## "):
            if skipping and line not in headings:
                out.append("")   # the blank line this section opens with, skipped with the one before
            skipping = line in headings
            if skipping and out and out[-1] == "":
                out.pop()   # the blank line each section opens with
        if not skipping:
            out.append(rewrite(line))
    (bundle / "report.md").write_text("\n".join(out))


def strip_version_12(bundle: Path) -> None:
    """What format 12 changed taken back: every Spearman p of the summary (results[].evidence.trend, memory_creep[])
    as scipy.stats.spearmanr's t approximation, flags with it, and report.md's drift section in format 11's words
    (its sentence, its p and flag cells); the manifest's ``format_version`` is the caller's to set."""
    from loopbench.audit import evidence as audit_evidence
    from loopbench.audit import render

    summary = json.loads((bundle / "summary.json").read_text())
    if "evidence_rule" not in summary:
        return    # stripped to format 3 already: no drift tests (strip_version_3)
    plan = json.loads((bundle / "plan.json").read_text())
    alpha = plan["config"]["evidence"]["alpha"]
    pairs = pd.read_parquet(bundle / "tables" / "pairs.parquet")
    records = [json.loads(p.read_text()) for p in sorted((bundle / "raw").rglob("*.json"))]
    section = evidence.FORMAT["report"]

    def drift(version):   # the section as report.md has it: devices shown as the report shows them
        w = render.wording(section, version)
        return render._drift(w, {**summary, **{key: render._devices_shown(w, summary[key])
                                                for key in ("results", "memory_creep")}})
    new_drift = drift(12)
    for r in summary["results"]:
        mine = pairs[(pairs.job == r["job"]) & (pairs.point == r["point"]) & (pairs.comparison == r["comparison"])]
        r["evidence"]["trend"] = audit_evidence._spearman(mine.sort_values("pair").ratio.tolist(), alpha, 11)
    summary["memory_creep"] = audit_evidence.memory_creep(plan, records, 11)
    (bundle / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    old_drift = drift(11)
    changed = dict((new, old) for new, old in zip(new_drift, old_drift) if new != old)   # the sentence, p and flag rows
    edit_report(bundle, lambda lines: [changed.get(line, line) for line in lines])


def strip_version_11(bundle: Path) -> None:
    """What format 11 changed taken back: each result's verdict reason by format 10's rule (the interval and the
    effect alone; a verdict word that rule would change is refused, as this bundle's report would need it too)
    and report.md's rule sentence in format 10's words, and format 12's change (``strip_version_12``); the
    manifest's ``format_version`` is the caller's to set."""
    from loopbench.audit import derive, render

    strip_version_12(bundle)
    plan = json.loads((bundle / "plan.json").read_text())
    vd = plan["config"]["verdict"]

    def reword(summary):
        for r in summary["results"]:
            st = r["stats"]
            word, st["verdict_reason"] = derive.verdict(st["speedup"], st["ci"], vd["min_effect"], st["n_pairs"],
                                                        vd["min_pairs"], 10, st["wilcoxon_p"], vd["confidence"])
            assert word == st["verdict"], f"format 10's rule gives {r['comparison']} another verdict: {word}"
    edit_json(bundle / "summary.json", reword)
    summary = json.loads((bundle / "summary.json").read_text())
    if "evidence_rule" not in summary:
        return    # stripped to format 3 already, its rule sentence with it (strip_version_3)
    section = evidence.FORMAT["report"]
    new, old = (render._rule(render.wording(section, v), plan, summary) for v in (11, 10))
    edit_report(bundle, lambda lines: [old if line == new else line for line in lines])


def strip_version_10(bundle: Path) -> None:
    """What format 10 added taken out: the raw online records' ``engine_settings`` and the Online section's
    settings of the online runs (from its heading to the plot line's blank one), and format 11's change
    (``strip_version_11``); the manifest's ``format_version`` is the caller's to set."""
    strip_version_11(bundle)
    for path in sorted((bundle / "online").glob("*/*.json")):
        edit_json(path, lambda r: r.pop("engine_settings", None))
    words = evidence.FORMAT["online"]["report"]
    lines = (bundle / "report.md").read_text().split("\n")
    if words["settings_heading"] in lines:
        del lines[lines.index(words["settings_heading"]) - 1:lines.index(words["plot"]) - 1]
    (bundle / "report.md").write_text("\n".join(lines))


def strip_version_9(bundle: Path) -> None:
    """What format 9 added taken out: the raw records' ``engine_settings`` and report.md's Runtime settings
    section (and format 10's additions, ``strip_version_10``); the manifest's ``format_version`` is the caller's
    to set."""
    strip_version_10(bundle)
    for path in sorted((bundle / "raw").glob("*/*.json")):
        edit_json(path, lambda r: r.pop("engine_settings", None))
    drop_report_sections(bundle, {evidence.FORMAT["report"]["headings"]["runtime_settings"]})


def strip_version_8(bundle: Path) -> None:
    """report.md with a child's exit status as formats up to 7 worded it: the children table's column
    ``exit code`` holding children.json's ``exit_code`` as Python prints it (``0``, ``-15``, ``None``), and a
    ``child_failed`` reason "... with exit code {exit_code}" (and format 9's additions out, ``strip_version_9``);
    the manifest's ``format_version`` is the caller's to set."""
    from loopbench.audit import render

    strip_version_9(bundle)

    children = json.loads((bundle / "children.json").read_text())
    summary = json.loads((bundle / "summary.json").read_text())
    text = (bundle / "report.md").read_text()
    for r in summary["incomplete_reasons"]:
        text = text.replace(render.reason_text(r, children, 8), render.reason_text(r, children, 7), 1)
    lines, rows = text.split("\n"), iter(children)
    heading = lines.index(evidence.FORMAT["report"]["headings"]["children"])
    lines[heading + 2] = lines[heading + 2].replace("| exit status |", "| exit code |")
    i = heading + 4   # heading, blank line, column headings, ---, then one row per entry
    while i < len(lines) and lines[i].startswith("| "):
        cells = lines[i].split(" | ")
        cells[3] = str(next(rows)["exit_code"])
        lines[i] = " | ".join(cells)
        i += 1
    (bundle / "report.md").write_text("\n".join(lines))


def strip_version_7(bundle: Path) -> None:
    """What format 7 added taken out (the roofline: table, ceilings, records' decode_timing, report section)
    and report.md / summary.json worded as format 6 (``strip_version_8``, ``_reword_as_version_6``); the
    manifest's ``format_version`` is the caller's to set."""
    strip_version_8(bundle)
    (bundle / "tables" / "roofline.parquet").unlink(missing_ok=True)
    for path in sorted((bundle / "ceilings").glob("*.json")):
        path.unlink()
    if (bundle / "ceilings").is_dir():
        (bundle / "ceilings").rmdir()
    for path in sorted((bundle / "raw").glob("*/*.json")):
        edit_json(path, lambda r: r.pop("decode_timing", None))
    drop_report_sections(bundle, {evidence.FORMAT["report"]["headings"]["roofline"]})
    _reword_as_version_6(bundle)


def strip_version_5(bundle: Path) -> None:
    """What format 5 added, taken out of summary.json and report.md (graph coverage and telemetry sections,
    the result table's P / D column), as a format-4 writer would have left it (and format 7's additions); plan.json's
    points' ``prompt_len`` / ``output_len`` are the caller's to drop (they change the plan's sha256)."""
    strip_version_7(bundle)
    edit_json(bundle / "summary.json", lambda s: [r.pop("graph_coverage") for r in s["results"]])
    spec = evidence.FORMAT["report"]
    in_table = False

    def without_workload(line: str) -> str:
        nonlocal in_table   # a result table of format 5: its third cell (P / D) goes
        in_table = line.startswith("| GPU | B / C | P / D |") or (in_table and line.startswith("|"))
        return "|".join(line.split("|")[:3] + line.split("|")[4:]) if in_table else line
    drop_report_sections(bundle, {spec["headings"]["graph_coverage"], spec["headings"]["telemetry"]}, without_workload)
