"""Format 9: each raw record holds what its engine resolved and ran with (``engine_settings``); the auditor
requires an object of JSON scalars (or null) in every record and equal settings within an arm's runs at one
point and track in one session, and still audits a format-8 bundle, which has none, as before. report.md's
Runtime settings section is rendered alike by both renderers (harness/report_sections.py,
audit/check_settings.py)."""
import copy
import json

from loopbench.audit import check_settings, contract, render
from loopbench.harness import evidence, report_sections
from tests.audit.tamper import (audit, edit_json, edit_report, failed, forge_settings, passes_as_version, raw,
                                rewrite_manifest, strip_version_9)

SPEC = contract.FORMAT["report"]["runtime_settings"]


def _records(bundle):
    return [json.loads(p.read_text()) for p in sorted((bundle / "raw").glob("*/*.json"))]


def _two_runs_of_one_arm(bundle) -> tuple[dict, dict]:
    """The first two records of one arm at one point in one session (all replay in the mini bundle)."""
    seen = {}
    for rec in _records(bundle):
        key = (rec["session"], rec["point"], rec["arm"])
        if key in seen:
            return seen[key], rec
        seen[key] = rec
    raise AssertionError("no arm ran twice")


def test_every_record_holds_what_its_engine_ran_with(honest_bundle):
    assert contract.VERSION == evidence.FORMAT_VERSION == 15
    for rec in _records(honest_bundle):
        settings = rec["engine_settings"]
        assert all(type(v) in (str, int, float, bool, type(None)) for v in settings.values())
        assert settings["kv_layout"] == rec["arm_config"]["kv_layout"]
        assert settings["max_num_seqs"] == rec["max_num_seqs"] and settings["exit_policy"] == "replay"
        assert settings["model_device_type"] == "cpu" and settings["prefill_on_own_stream"] is False
        assert len(settings["schedule_sha256"]) == 64


def test_a_run_whose_settings_differ_from_its_arms_other_runs_is_named(bundle):
    first, second = _two_runs_of_one_arm(bundle)
    text = forge_settings(bundle, raw(bundle, second["seq"]), batch_invariant=False)
    assert (f"engine_settings: record cpu0 seq {second['seq']} ({second['arm']}, {second['point']}, session cpu0): "
            f"engine_settings.batch_invariant is false, where seq {first['seq']}, a run of the same arm at the same "
            f"point and track in the same session, holds true") in text


def test_a_replayed_run_names_its_points_frozen_reference(honest_bundle):
    plan = json.loads((honest_bundle / "plan.json").read_text())
    want = {pt["key"]: pt["reference"]["sha256"] for pt in plan["points"]}
    for rec in _records(honest_bundle):
        assert rec["engine_settings"]["schedule_sha256"] == want[rec["point"]]


def test_every_run_that_replayed_another_schedule_is_named_and_one_that_names_none_is_not(bundle):
    recs = _records(bundle)
    same = [r for r in recs if (r["arm"], r["point"]) == (recs[0]["arm"], recs[0]["point"])]
    for rec in same:       # every run of the arm alike, so only the reference check can name them
        edit_json(raw(bundle, rec["seq"]), lambda r: r["engine_settings"].update(schedule_sha256="0" * 64))
    rewrite_manifest(bundle)
    lines = failed(bundle).splitlines()
    named = [f for f in lines if "schedule_sha256 is " + "0" * 64 + ", not the sha256 of its point's frozen "
             "reference" in f]
    assert len(named) == len(same) == len([f for f in lines if f.startswith("engine_settings:")])
    for rec in recs:   # an engine that does not say which schedule it replayed is not held to one here
        edit_json(raw(bundle, rec["seq"]), lambda r: r["engine_settings"].pop("schedule_sha256"))
    rewrite_manifest(bundle)     # (the report's Runtime settings lines then differ, which the report check names)
    assert not [f for f in audit(bundle)["discrepancies"] if f.startswith("engine_settings:")]


def test_a_setting_that_contradicts_its_record_is_named(bundle):
    recs = _records(bundle)
    same = [r for r in recs if (r["arm"], r["point"]) == (recs[0]["arm"], recs[0]["point"])]
    for rec in same:       # every run of the arm alike, so only the record check can name them
        edit_json(raw(bundle, rec["seq"]), lambda r: r["engine_settings"].update(
            max_num_seqs=999, kv_layout="other"))
    rewrite_manifest(bundle)
    lines = [f for f in failed(bundle).splitlines() if f.startswith("engine_settings:")]
    assert len(lines) == 2 * len(same)
    assert f"engine_settings.max_num_seqs is 999, where the record says {same[0]['max_num_seqs']}" in lines[1]
    assert f'engine_settings.kv_layout is "other", where the record says "{same[0]["arm_config"]["kv_layout"]}"' \
        in lines[0]


def test_a_setting_only_one_run_has_or_a_null_beside_an_object_is_named(bundle):
    first, second = _two_runs_of_one_arm(bundle)
    edit_json(raw(bundle, second["seq"]), lambda r: r["engine_settings"].update(extra=1))
    rewrite_manifest(bundle)
    assert f"engine_settings.extra is 1, where seq {first['seq']}" in failed(bundle)
    edit_json(raw(bundle, second["seq"]), lambda r: r.update(engine_settings=None))
    rewrite_manifest(bundle)
    assert f"seq {second['seq']} ({second['arm']}, {second['point']}, session cpu0): engine_settings is null, " \
           f"where seq {first['seq']}" in failed(bundle)


def test_a_value_compares_as_json(bundle):
    """1 is not true, nor 16.0 16: the values are JSON, and a run that wrote another is another run."""
    first, second = _two_runs_of_one_arm(bundle)
    edit_json(raw(bundle, second["seq"]), lambda r: r["engine_settings"].update(max_num_seqs=float(r["max_num_seqs"])))
    rewrite_manifest(bundle)
    assert f"engine_settings.max_num_seqs is {float(second['max_num_seqs'])}, where" in failed(bundle)


def test_a_setting_that_is_no_json_scalar_is_named(bundle):
    for value in (["float32"], {"dtype": "float32"}):
        edit_json(raw(bundle, 1), lambda r: r["engine_settings"].update(model_dtype=value))
        rewrite_manifest(bundle)
        assert f"engine_settings.model_dtype is {value!r}, not a JSON scalar (string|int|number|bool|null)" \
            in failed(bundle)


def test_settings_that_are_no_object_or_missing_are_named(bundle):
    edit_json(raw(bundle, 2), lambda r: r.update(engine_settings="native"))
    rewrite_manifest(bundle)
    assert "is not an arm record: engine_settings is 'native'" in failed(bundle)
    edit_json(raw(bundle, 2), lambda r: r.pop("engine_settings"))
    rewrite_manifest(bundle)
    assert "seq 2 (" in failed(bundle) and "session cpu0) has no engine_settings" in failed(bundle)


def test_a_format_8_bundle_has_no_settings_and_audits_as_before(older_bundle):
    bundle = older_bundle   # its order numpy's, as format 8 drew it
    strip_version_9(bundle)
    passes_as_version(bundle, 8)
    edit_json(raw(bundle, 0), lambda r: r.update(engine_settings={"kv_layout": "native"}))   # format 9 content
    rewrite_manifest(bundle)
    assert "holds engine_settings, format 9 content in a format 8 bundle" in failed(bundle)


# ------------------------------------------------------------------------------------- the report

def _section(records, plan=None) -> list[str]:
    """The Runtime settings section of ``records`` (of the mini bundle's one point, or ``plan``'s), required equal
    from both renderers."""
    plan = plan or {"points": [{"key": "B2C3"}]}
    mine = report_sections.runtime_settings(plan, records)
    theirs = check_settings.section(render.wording(contract.FORMAT["report"], contract.VERSION), plan, records)
    assert mine == theirs
    return mine


def test_both_renderers_show_the_runtime_settings_as_published(honest_bundle):
    assert json.loads((honest_bundle / "plan.json").read_text())["points"][0]["key"] == "B2C3"
    lines = _section(_records(honest_bundle))
    assert "\n".join(lines) + "\n\n## Children" in (honest_bundle / "report.md").read_text()
    assert lines[:3] == ["", "## Runtime settings", ""] and lines[3] == SPEC["text"]
    assert lines[5:10] == ["| setting | alias_prefix | native |", "|---|---|---|", "| kv_layout | alias | native |",
                           "| prefix_tiles | true | false |", ""]
    shared = lines[-1]
    assert shared.startswith("Shared by every arm: attention_backend=torch, batch_invariant=true, ") and \
        shared.endswith(".")
    for item in ("exit_policy=replay", "max_num_seqs=2", "model_device_type=cpu", 'model_wgmma_projections=""',
                 "model_pdl=false", "model_pdl_trigger=null", "num_blocks=null", "prefill_on_own_stream=false"):
        assert item in shared.split(": ", 1)[1].rstrip(".").split(", "), item


def test_an_arms_values_at_two_points_in_point_order_and_a_setting_it_lacks_as_na(honest_bundle):
    """Half of each arm's runs moved to a second point, listed first in the plan, where they ran at B4 (as the
    plan's points would have it): every arm holds "4 / 2", a setting they share; only native then runs one of
    its second-point runs with tile_size 64, and alias_prefix reports no trace_loops."""
    records = copy.deepcopy(_records(honest_bundle))
    for arm in ("native", "alias_prefix"):
        for rec in [r for r in records if r["arm"] == arm][1::2]:
            rec["point"], rec["engine_settings"]["max_num_seqs"] = "B4C3", 4
    plan = {"points": [{"key": "B4C3"}, {"key": "B2C3"}]}
    lines = _section(records, plan)
    assert "max_num_seqs=4 / 2" in lines[-1].split(": ", 1)[1].rstrip(".").split(", ")
    next(r for r in records if r["arm"] == "native" and r["point"] == "B4C3")["engine_settings"]["tile_size"] = 64
    for rec in records:
        if rec["arm"] == "alias_prefix":
            del rec["engine_settings"]["trace_loops"]
    lines = _section(records, plan)
    assert "| tile_size | 32 | 64 / 32 |" in lines and "| trace_loops | n/a | false |" in lines
    assert "tile_size=" not in lines[-1] and "trace_loops=" not in lines[-1] and "max_num_seqs=4 / 2" in lines[-1]


def test_one_arm_alone_has_no_table_and_no_settings_say_so(honest_bundle):
    native = [r for r in _records(honest_bundle) if r["arm"] == "native"]
    lines = _section(native)
    assert lines[3:5] == [SPEC["text"], ""] and lines[-1].startswith("Shared by every arm: ") and len(lines) == 6
    none = [{**r, "engine_settings": None} for r in native]
    assert _section(none) == ["", "## Runtime settings", "", SPEC["none"]]
    assert _section([]) == []          # no run at all (a run stopped before its first arm): no section


def test_a_forged_runtime_settings_line_is_named(bundle):
    edit_report(bundle, lambda lines: [line.replace("| prefix_tiles | true | false |", "| prefix_tiles | false | false |")
                                       for line in lines])
    rewrite_manifest(bundle)
    assert "(## Runtime settings) reads '| prefix_tiles | false | false |'" in failed(bundle)


def test_a_format_8_report_holds_no_runtime_settings_section(bundle):
    """Records stripped of format 9's field, the published section kept: not a format-8 report."""
    for path in sorted((bundle / "raw").glob("*/*.json")):
        edit_json(path, lambda r: r.pop("engine_settings"))
    edit_json(bundle / "manifest.json", lambda m: m.update(format_version=8))
    rewrite_manifest(bundle)
    assert "(## Runtime settings) is not in the re-derived report: '## Runtime settings'" in failed(bundle)
