"""Checks of the bundle's claims: the run's status (complete or incomplete, and why, as status codes)
re-derived from children.json's structured fields and the records, never from the summary's words; every
field of summary.json re-derived; report.md equal, line for line, to the auditor's own rendering."""
from __future__ import annotations

import re

from . import check_online, check_roofline, check_settings, check_superseded, contract, derive, render
from .context import Audit
from .values import field_diffs, line_diffs, plain, sha256_file

ABSENT = contract.ABSENT
HTML = re.compile(r"<\s*[A-Za-z!/?]")


def interruption(ctx: Audit, plan: dict, children: list[dict]) -> dict | None:
    """A failed reference capture, as the bundle shows it: the reference child did not complete (and was
    not stopped: a stopped child's ``interrupted_by`` says why instead) or a point has no reference."""
    current = derive.current_children(children)
    if any(c.get("interrupted_by") for c in current):
        return None
    ref = next((c for c in current if c["name"] == "reference"), None)
    if ref is None or ref["exit_code"] != 0 or any(not pt.get("reference") for pt in plan["points"]):
        return {"code": "reference_failed"}
    return None


def is_complete(ctx: Audit, plan: dict, records: list[dict], children: list[dict], interrupted: dict | None) -> bool:
    """Every planned arm recorded, and the latest child of each name (reference, every device) completed."""
    current = derive.current_children(children)
    names = {c["name"] for c in current}
    return (interrupted is None and all(c["exit_code"] == 0 and c["state"] == "completed" for c in current)
            and "reference" in names and all(d["name"] in names for d in plan["devices"])
            and len(records) == derive.planned_arms(plan))


def check_status_codes(ctx: Audit, claimed: dict) -> None:
    """Each of the summary's incomplete reasons is a status code the contract defines, with its fields
    (version 1: a sentence); a code unknown to the contract is a discrepancy even where nothing reads it."""
    reasons = claimed.get("incomplete_reasons")
    for i, reason in enumerate(reasons if isinstance(reasons, list) else []):
        problem = (None if isinstance(reason, str) else f"{reason!r} is not a sentence") if ctx.version < 2 \
            else contract.reason_problem(reason)
        if problem is not None:
            ctx.fail("summary.json", f"incomplete_reasons[{i}]: {problem}")


def expected_summary(ctx: Audit, plan: dict, claimed: dict, records: list[dict], children: list[dict], refs: dict,
                     complete: bool, checks_ok: bool, interrupted: dict | None, natural: dict | None = None) -> dict:
    # The checker's finding messages cannot be re-derived; a failed check is a discrepancy of its own.
    findings = [] if checks_ok else (claimed.get("checks") or {}).get("findings")
    return derive.summary(plan, sha256_file(ctx.bundle / "plan.json"), records, children, complete=complete,
                          checks_ok=checks_ok, reference_points=set(refs), findings=findings,
                          interrupted=interrupted, version=ctx.version, natural=natural)


def check_summary(ctx: Audit, claimed: dict, expected: dict) -> None:
    for path, got, want in field_diffs(claimed, expected, ""):
        if got is ABSENT:
            ctx.fail("summary.json", f"lacks {path} (the audit derives {want!r})")
        elif want is ABSENT:
            ctx.fail("summary.json", f"has {path} = {got!r}, which the bundle format does not define")
        elif isinstance(got, list) and isinstance(want, list) and len(got) != len(want):
            ctx.fail("summary.json", f"{path} has {len(got)} entries, the audit derives {len(want)}")
        else:
            ctx.fail("summary.json", f"{path} is {plain(got)!r}, the audit derives {want!r}")
    ctx.count("results", len(expected["results"]))
    ctx.count("ratios", sum(len(r["pairs"]) for r in expected["results"]))


def expected_report(ctx: Audit, plan: dict, summary: dict, records: list[dict], environment: dict) -> str:
    prompts_sha = sha256_file(ctx.bundle / plan["prompts"]["file"])
    return render.report(plan, summary["plan_sha256"], prompts_sha, summary,
                         [derive.arm_row(r) for r in records], environment, ctx.version,
                         check_online.report_lines(ctx, plan), check_roofline.report_lines(ctx, plan),
                         check_settings.report_lines(ctx, plan, records), check_superseded.report_lines(ctx, summary["children"]))


def check_report(ctx: Audit, want: str) -> None:
    """report.md must be exactly the re-derived report: each differing line is named with its section."""
    got_lines, want_lines = (ctx.bundle / "report.md").read_text().split("\n"), want.split("\n")

    def at(j: int) -> str:
        heading = next((line for line in reversed(got_lines[:j + 1]) if line.startswith("## ")), "header")
        return f"line {j + 1} ({heading})"

    for j, line in enumerate(got_lines):
        if HTML.search(line):
            ctx.fail("report.md", f"{at(j)} holds raw HTML, which can hide or forge what the page shows: {line!r}")
    for j, got, wanted in line_diffs(got_lines, want_lines):
        if wanted is None:
            ctx.fail("report.md", f"{at(j)} is not in the re-derived report: {got!r}")
        elif got is None:
            ctx.fail("report.md", f"lacks the re-derived line {wanted!r} before {at(j)}")
        else:
            ctx.fail("report.md", f"{at(j)} reads {got!r}, re-derived {wanted!r}")
    ctx.count("report_lines", len(want_lines))
