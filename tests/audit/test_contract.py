"""Writer and auditor implement one contract, loopbench/bundle_format.json: every column the writer writes
is declared (type and unit) and an undeclared one is refused on both sides; status is a code of the
contract, worded only from it; each request's prompt is the plan's prompt_index, never parsed from its id."""
import json
import re

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from loopbench.audit import contract, render
from loopbench.audit.auditor import audit
from loopbench.harness import controller, evidence, report
from tests.audit.tamper import (REPO, edit_json, edit_table, failed, passes_as_version, raw, rewrite_manifest,
                                strip_version_15_flags, strip_version_3, strip_version_5)

GPU_BUNDLE = REPO / "results" / "2026-12-01-ouro-1.4b-e4b8faf"   # a bundle whose tables have every column


def test_every_column_the_writer_writes_is_declared_with_type_and_unit(honest_bundle):
    for name in evidence.TABLES:
        schema = pq.read_schema(honest_bundle / "tables" / f"{name}.parquet")
        declared = contract.declared_columns(name)
        rows = pq.read_metadata(honest_bundle / "tables" / f"{name}.parquet").num_rows
        for field in schema:
            assert field.name in declared, (name, field.name)
            assert {"name", "type", "unit", "what"} <= set(declared[field.name]), (name, field.name)
            if rows:
                assert contract.column_type_problem(name, field.name, str(field.type)) is None, (name, field)


# columns declared after GPU_BUNDLE was measured (arm_engine: the arm's engine factory, issue 9)
NEWER_THAN_GPU_BUNDLE = {"arms": {"arm_engine"}}


def test_no_declared_column_is_dead(honest_bundle):
    """Every declared column is one the writer has written (the GPU bundle has all but those declared since,
    by name or by a since later than its format version; the CPU bundle written now has those)."""
    for name in evidence.TABLES:
        written = set(pq.read_schema(GPU_BUNDLE / "tables" / f"{name}.parquet").names)
        later = set(contract.columns_since(name, 2))
        assert set(contract.declared_columns(name)) == written | NEWER_THAN_GPU_BUNDLE.get(name, set()) | later, name
        if name != "telemetry":   # a CPU bundle has no telemetry rows
            assert later <= set(pq.read_schema(honest_bundle / "tables" / f"{name}.parquet").names), name


def test_undeclared_column_is_refused_by_writer_and_auditor(bundle):
    tables = {name: pd.read_parquet(bundle / "tables" / f"{name}.parquet") for name in evidence.TABLES}
    tables["arms"]["speed_of_light"] = 1.0
    with pytest.raises(ValueError, match=r"arms.parquet would get columns \['speed_of_light'\]"):
        evidence.write_tables(bundle, tables)
    edit_table(bundle, "arms", lambda df: df.assign(speed_of_light=1.0))
    rewrite_manifest(bundle)
    assert f"arms.parquet: has column 'speed_of_light', which {contract.WHERE} does not declare" in failed(bundle)


def test_column_of_another_type_is_named(bundle):
    edit_table(bundle, "pairs", lambda df: df.assign(pair=df["pair"].astype(str)))
    rewrite_manifest(bundle)
    assert "pairs.parquet: column 'pair' is of arrow type large_string, the format declares int64" in failed(bundle)


def test_status_code_unknown_to_the_contract_is_a_finding(bundle):
    edit_json(bundle / "summary.json", lambda s: s.update(incomplete_reasons=[{"code": "gremlins"}]))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert f"summary.json: incomplete_reasons[0]: code 'gremlins' is not a status code of {contract.WHERE}" in text


def test_status_code_with_undefined_fields_is_a_finding(bundle):
    edit_json(bundle / "summary.json", lambda s: s.update(incomplete_reasons=[{"code": "stopped", "by": "SIGTERM",
                                                                               "why": "tired"}]))
    rewrite_manifest(bundle)
    assert "incomplete_reasons[0]: code 'stopped' has fields ['why'] that" in failed(bundle)


def test_incomplete_status_is_a_code_worded_by_the_report(bundle):
    """A lost arm, re-published by the harness: the summary lists the code, the report words it, the audit
    says incomplete; a sentence of the report changed alone is a report discrepancy, not a status."""
    raw(bundle, 7).unlink()
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    children[-1].update(state="failed", exit_code=1)
    evidence.unpublish(bundle)
    summary = controller.publish(bundle, plan, children, env).summary
    assert summary["incomplete_reasons"] == [
        {"code": "child_failed", "child": "cpu0", "state": "failed", "exit_code": 1},
        {"code": "arms_missing", "recorded": 7, "planned": 8}]
    assert "**This run is incomplete and publishes no verdict:** child cpu0 ended failed, exit code 1; 7 of 8 " \
           "planned arms recorded" in (bundle / "report.md").read_text()
    verdict = audit(bundle)
    assert verdict["status"] == "incomplete", verdict["discrepancies"]
    text = (bundle / "report.md").read_text().replace("ended failed, exit code 1", "ended completed, exit code 0")
    (bundle / "report.md").write_text(text)
    rewrite_manifest(bundle)
    assert "report.md: line 3 (header) reads '**This run is incomplete" in failed(bundle)


@pytest.mark.parametrize("reason", [{"code": "stopped", "by": "SIGINT"}, {"code": "lost"}, {"code": "reference_failed"},
                                    {"code": "child_failed", "child": "gpu0.r1", "state": "timeout", "exit_code": None},
                                    {"code": "arms_missing", "recorded": 3, "planned": 56}])
def test_writer_and_auditor_word_a_code_alike(reason):
    assert contract.reason_problem(reason) is None
    children = [{"name": "gpu0", "session": "gpu0.r1", "exit_code": None, "state": "timeout", "wall_s": 600.0}]
    assert report.reason_text(reason, children) == render.reason_text(reason, children, contract.VERSION)
    assert render.reason_text(reason, children, 1) == contract.reason_text(reason)   # a version-1 summary's sentence
    assert set(contract.CODES) == set(evidence.STATUS_CODES)


def test_writer_refuses_an_interrupted_sentence():
    with pytest.raises(ValueError, match="not a field-less status code"):
        evidence.incomplete_reasons([], "the reference capture failed; nothing was measured", 0, 0)


def test_plan_points_list_the_requests_the_session_builds(honest_bundle):
    from loopbench.harness import session

    plan = json.loads((honest_bundle / "plan.json").read_text())
    prompts = json.loads((honest_bundle / "prompts.json").read_text())
    exit_conf = plan["config"]["exit"]
    for pt in plan["points"]:
        built = session.build_requests(prompts, pt["num_requests"], 4, exit_conf)
        assert pt["requests"] == evidence.point_requests(pt["num_requests"])
        assert [(q.request_id, list(q.prompt_token_ids)) for q in built] == \
            [(q["request_id"], prompts[q["prompt_index"]]) for q in pt["requests"]]


def test_request_whose_prompt_is_not_the_plans_prompt_index_is_named(bundle):
    """The plan says r0001 ran prompts.json[2]; the frozen reference's prompt hash is of prompts.json[1]."""
    edit_json(bundle / "plan.json", lambda p: p["points"][0]["requests"][1].update(prompt_index=2))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "reference: B2C3 request r0001: prompt sha256 does not match prompts.json[2], the plan's prompt_index" \
        in text, text


def test_plan_point_without_its_request_list_is_named(bundle):
    edit_json(bundle / "plan.json", lambda p: p["points"][0].pop("requests"))
    rewrite_manifest(bundle)
    assert "plan: point 'B2C3': requests is missing" in failed(bundle)


def test_plan_point_listing_too_few_requests_is_named(bundle):
    edit_json(bundle / "plan.json", lambda p: p["points"][0]["requests"].pop())
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "plan: point B2C3 lists 2 requests (2 distinct ids) for C3" in text
    assert "reference: B2C3 request r0002 is not a request of the plan's point" in text


def test_older_format_versions_are_audited_by_their_rules_and_others_refused(bundle):
    assert contract.SUPPORTED == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) and contract.VERSION == 15
    assert set(contract.FORMAT["versions"]) == {str(v) for v in contract.SUPPORTED}
    edit_json(bundle / "manifest.json", lambda m: (m.pop("format_version"), m.update(layout_version=0)))
    assert "layout: manifest.json records bundle format version 0; this auditor audits versions " \
           "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]" in failed(bundle)


def _as_version_1(bundle):
    """An incomplete bundle as format version 1 wrote it: reasons as sentences, no request lists, layout_version."""
    raw(bundle, 7).unlink()
    plan, children, env = (json.loads((bundle / f"{n}.json").read_text()) for n in ("plan", "children", "environment"))
    children[-1].update(state="failed", exit_code=1)
    evidence.unpublish(bundle)
    controller.publish(bundle, plan, children, env)
    old_sha = evidence.sha256_file(bundle / "plan.json")
    strip_version_15_flags(bundle)
    strip_version_3(bundle)
    strip_version_5(bundle)
    edit_json(bundle / "plan.json", lambda p: ([(pt.pop("requests"), pt.pop("prompt_len"), pt.pop("output_len"))
                                                for pt in p["points"]], p.pop("detectable_effect"), p.pop("natural", None)))
    new_sha = evidence.sha256_file(bundle / "plan.json")
    edit_json(bundle / "summary.json", lambda s: s.update(
        schema_version=1, plan_sha256=new_sha,
        incomplete_reasons=[contract.reason_text(r) for r in s["incomplete_reasons"]]))   # a version-1 sentence
    (bundle / "report.md").write_text((bundle / "report.md").read_text().replace(old_sha, new_sha))
    for name in ("arms", "tokens"):   # columns a version-1 writer did not have
        edit_table(bundle, name, lambda df, later=contract.columns_since(name, 1): df.drop(columns=later))
    (bundle / "manifest.json").write_text(json.dumps({"layout_version": 1}))
    rewrite_manifest(bundle)


def test_version_1_bundle_is_audited_by_its_rules(older_bundle):
    bundle = older_bundle   # its order numpy's, as format 1 drew it
    _as_version_1(bundle)
    verdict = audit(bundle)
    assert verdict["status"] == "incomplete", verdict["discrepancies"]
    edit_json(bundle / "summary.json", lambda s: s.update(incomplete_reasons=[{"code": "arms_missing"}]))
    rewrite_manifest(bundle)
    assert "summary.json: incomplete_reasons[0]: {'code': 'arms_missing'} is not a sentence" in failed(bundle)


def test_numpys_order_and_prompts_pass_as_format_14_and_are_named_as_format_15(older_bundle, bundle):
    """Format 15 draws the pair order and a seeded prompt pool by the contract's SHA-256 rules (documents.plan
    order_rule, prompt_rule). The bundle whose writer drew both with numpy's Generator, as formats up to 14 did, is
    named when it claims 15 and passes as 14; the format-15 bundle claimed as 14 is named by numpy's order rule, so
    neither passes off the other's order."""
    plans = [json.loads((b / "plan.json").read_text()) for b in (older_bundle, bundle)]
    assert plans[0]["order"] != plans[1]["order"]   # here the two rules put another arm first in some pair
    assert plans[0]["prompts"]["sha256"] != plans[1]["prompts"]["sha256"]
    text = failed(older_bundle)
    assert "order: cpu0: plan.json's measurement order is not the seeded balanced order (the contract's " \
           "documents.plan.order_rule)" in text
    assert "plan: prompts.json is not the seeded pool of the contract's documents.plan.prompt_rule: 3 of its 3 " \
           "prompts differ from the rule's 3, the first prompts.json[0]" in text
    passes_as_version(older_bundle, 14)
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=14))
    rewrite_manifest(bundle)
    assert "order: cpu0: plan.json's measurement order is not the seeded balanced order (the contract's " \
           "documents.plan.order_rule_before)" in failed(bundle)


class _AnotherNumpysGenerator(np.random.Generator):
    """A Generator as another numpy version might give it: its permutations other than this one's (numpy does not
    promise them across versions); every other draw (the bootstrap's) as this numpy's."""

    def permutation(self, x, axis=0):
        return super().permutation(x, axis)[::-1]


_DEFAULT_RNG = np.random.default_rng


def _another_numpys_default_rng(seed=None):
    """numpy.random.default_rng of that other numpy; like numpy's, it hands a Generator it is given back unchanged."""
    return seed if isinstance(seed, np.random.Generator) else _AnotherNumpysGenerator(_DEFAULT_RNG(seed).bit_generator)


def test_a_format_15_bundle_audits_alike_on_a_numpy_that_draws_otherwise(bundle, monkeypatch):
    """The auditor re-derives a format-15 order by the contract's SHA-256 rule alone, so an auditor whose numpy
    permutes otherwise passes the sound bundle (format 14's rule, numpy's permutation, names its order)."""
    monkeypatch.setattr(np.random, "default_rng", _another_numpys_default_rng)
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    assert verdict["checked"]["seeded_prompts"] == 3
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=14))
    rewrite_manifest(bundle)
    assert "documents.plan.order_rule_before" in failed(bundle)


@pytest.mark.parametrize("doc, edit, expected", [
    ("plan.json", lambda p: p.pop("reference_arm"), "plan: plan.json: reference_arm is missing"),
    ("references/B2C3.meta.json", lambda m: m.pop("work"), "reference: B2C3: meta work is missing"),
    ("references/B2C3.schedule.json", lambda s: s["requests"][0].update(prompt_sha256=None),
     "reference: B2C3: schedule request prompt_sha256 is None"),
    ("children.json", lambda c: c[0].update(wall_s="long"), "sessions: children.json: reference: wall_s is 'long'"),
])
def test_document_without_its_contract_fields_is_named(bundle, doc, edit, expected):
    edit_json(bundle / doc, edit)
    rewrite_manifest(bundle)
    assert expected in failed(bundle)


def _shape_problem(doc: dict, fields: dict, where: str, optional: dict | None = None) -> str | None:
    """A problem of the contract's field check, or a key the contract does not define."""
    extra = sorted(set(doc) - set(fields) - set(optional or {}))
    return f"{where} has {extra}" if extra else contract.fields_problem(doc, fields, where, optional)


def test_writer_and_auditor_summaries_have_the_contracts_fields(honest_bundle):
    """The writer's summary.json (which the auditor re-derives field for field) is the contract's document."""
    spec = contract.DOCS["summary"]
    summary = json.loads((honest_bundle / "summary.json").read_text())
    assert summary["schema_version"] == spec["schema_version"] and summary["status"] in spec["status"]
    assert summary["verdicts_barred_by"] in spec["verdicts_barred_by"]
    problems = [_shape_problem(summary, spec["fields"], "summary"),
                _shape_problem(summary["counts"], spec["counts_fields"], "counts"),
                _shape_problem(summary["checks"], spec["checks_fields"], "checks", spec["checks_optional"]),
                _shape_problem(summary["verdict_rule"], spec["verdict_rule_fields"], "verdict_rule")]
    for r in summary["results"]:
        problems += [_shape_problem(r, spec["result_fields"], "result"),
                     _shape_problem(r["stats"], spec["stats_fields"], "stats")]
        assert r["stats"]["verdict"] in spec["verdicts"]
    children = json.loads((honest_bundle / "children.json").read_text())
    docs = contract.DOCS["children"]
    problems += [_shape_problem(c, docs["entry_fields"], "child", docs["entry_optional"]) for c in children]
    manifest = json.loads((honest_bundle / "manifest.json").read_text())
    problems.append(_shape_problem(manifest, contract.DOCS["manifest"]["fields"], "manifest"))
    assert [p for p in problems if p] == []


def test_checker_findings_have_the_contracts_fields():
    from loopbench.harness import checker

    finding = checker.Finding("tokens", "cpu0", "B2C3", "c", 0, "native", "measured", "r0000", 2, 5, 6)
    assert _shape_problem(finding.to_dict(), contract.DOCS["summary"]["finding_fields"], "finding") is None


# The contract's words name a config key as "config <key>" and a plan field as "plan.json <field>" (or "plan
# <field>"); a name in code form has "_", "." or "[" in it, or ",;:)" after it (prose such as "config and" has not).
_PART = r"[a-z][a-z0-9_]*(?:\[\d*\])?"      # sessions, points[], devices[0]
_NAMED = re.compile(rf"\b(config|plan\.json|plan) ({_PART}(?:\.{_PART})*)([,;:)]?)")


def _contract_names(kind: str) -> dict[str, list[str]]:
    """Each name of ``kind`` ("config" or "plan") that the contract's text gives -> the dotted paths of its strings."""
    def strings(node, where):
        if isinstance(node, dict):
            return [s for k, v in node.items() for s in strings(v, f"{where}.{k}" if where else k)]
        if isinstance(node, list):
            return [s for i, v in enumerate(node) for s in strings(v, f"{where}[{i}]")]
        return [(where, node)] if isinstance(node, str) else []

    named: dict[str, list[str]] = {}
    for where, text in strings(contract.FORMAT, ""):
        for m in _NAMED.finditer(text):
            if m[1].startswith(kind) and (m[3] or re.search(r"[_.\[]", m[2])):
                named.setdefault(re.sub(r"\[\d*\]", "", m[2]), []).append(where)
    return named


def test_every_config_key_the_contract_names_is_a_key_of_the_schema():
    from loopbench.harness import keys

    schema = {k.replace("[]", "").replace(".<name>", "") for k, _, _ in keys.schema_keys()}
    nodes = schema | {k.rsplit(".", i)[0] for k in schema for i in range(1, k.count(".") + 1)}
    named = _contract_names("config")
    assert {"sessions", "comparisons.track", "natural"} <= set(named), named    # the regex still finds them
    assert {k: w for k, w in named.items() if k not in nodes} == {}


def test_every_plan_field_the_contract_names_is_a_field_of_plan_json():
    plan = contract.DOCS["plan"]
    fields = set(plan["fields"]) | set(plan["optional"])
    named = _contract_names("plan")
    assert {"points", "devices", "natural", "detectable_effect"} <= {k.split(".")[0] for k in named}, named
    assert {k: w for k, w in named.items() if k.split(".")[0] not in fields} == {}


def test_only_the_current_version_is_this_file():
    """versions['11'] still read 'this file: version 10 plus ...' once version 12 was the contract's (each new version
    takes the words from the one before it, as 10 gave them to 11)."""
    current = [v for v, text in contract.FORMAT["versions"].items() if text.startswith("this file: version")]
    assert current == [str(contract.VERSION)], current
