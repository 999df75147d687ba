"""Format 9: each raw record holds what its engine resolved and ran with (``engine_settings``); the auditor
requires an object of JSON scalars (or null) in every record and equal settings within an arm's runs at one
point and track in one session, and still audits a format-8 bundle, which has none, as before."""
import json

from loopbench.audit import contract
from loopbench.harness import evidence
from tests.audit.tamper import edit_json, failed, passes_as_version, raw, rewrite_manifest, strip_version_9


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
    assert contract.VERSION == evidence.FORMAT_VERSION == 9
    for rec in _records(honest_bundle):
        settings = rec["engine_settings"]
        assert all(type(v) in (str, int, float, bool, type(None)) for v in settings.values())
        assert settings["kv_layout"] == rec["arm_config"]["kv_layout"]
        assert settings["max_num_seqs"] == rec["max_num_seqs"] and settings["exit_policy"] == "replay"
        assert settings["model_device_type"] == "cpu" and settings["prefill_on_own_stream"] is False
        assert len(settings["schedule_sha256"]) == 64


def test_a_run_whose_settings_differ_from_its_arms_other_runs_is_named(bundle):
    first, second = _two_runs_of_one_arm(bundle)
    edit_json(raw(bundle, second["seq"]), lambda r: r["engine_settings"].update(batch_invariant=False))
    rewrite_manifest(bundle)
    assert (f"engine_settings: record cpu0 seq {second['seq']} ({second['arm']}, {second['point']}, session cpu0): "
            f"engine_settings.batch_invariant is false, where seq {first['seq']}, a run of the same arm at the same "
            f"point and track in the same session, holds true") in failed(bundle)


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


def test_a_format_8_bundle_has_no_settings_and_audits_as_before(bundle):
    strip_version_9(bundle)
    passes_as_version(bundle, 8)
    edit_json(raw(bundle, 0), lambda r: r.update(engine_settings={"kv_layout": "native"}))   # format 9 content
    rewrite_manifest(bundle)
    assert "holds engine_settings, format 9 content in a format 8 bundle" in failed(bundle)
