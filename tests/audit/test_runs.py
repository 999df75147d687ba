"""Tampered tokens, exit depths, timings, plans and wall clocks are named (manifest rewritten or not)."""
import pytest

from loopbench.audit.auditor import audit
from tests.audit.tamper import edit_json, edit_table, failed, forge_elapsed, raw, rewrite_manifest


@pytest.mark.parametrize("manifest_rewritten", [False, True])
def test_changed_token_in_tokens_table_is_named(bundle, manifest_rewritten):
    def change(df):
        i = df.index[(df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001")
                     & (df["position"] == 2)][0]
        df.loc[i, "token_id"] = (df.loc[i, "token_id"] + 1) % 256
        return df
    edit_table(bundle, "tokens", change)
    if manifest_rewritten:
        rewrite_manifest(bundle)
    text = failed(bundle)
    assert "tokens.parquet: token_id of cpu0 seq 3 measured request r0001 position 2" in text
    assert ("manifest: tables/tokens.parquet changed" in text) != manifest_rewritten


@pytest.mark.parametrize("manifest_rewritten", [False, True])
def test_changed_exit_depth_is_named(bundle, manifest_rewritten):
    def change(rec):
        d = rec["measured"]["outputs"]["r0002"]["exit_depths"]
        d[1] = 4 if d[1] != 4 else 3
    edit_json(raw(bundle, 5), change)
    if manifest_rewritten:
        rewrite_manifest(bundle)
    text = failed(bundle)
    assert "exit_depths: cpu0 seq 5" in text and "request 'r0002' position 1" in text
    assert "tokens.parquet: exit_depth of cpu0 seq 5 measured request r0002 position 1" in text
    assert ("manifest: raw/cpu0/" in text) != manifest_rewritten


@pytest.mark.parametrize("manifest_rewritten", [False, True])
def test_changed_timing_in_arms_table_is_named(bundle, manifest_rewritten):
    def change(df):
        df.loc[df["seq"] == 2, "elapsed_s"] *= 0.9
        return df
    edit_table(bundle, "arms", change)
    if manifest_rewritten:
        rewrite_manifest(bundle)
    text = failed(bundle)
    assert "arms.parquet: elapsed_s of cpu0 seq 2" in text
    assert ("manifest: tables/arms.parquet changed" in text) != manifest_rewritten


def test_changed_timing_in_raw_record_is_named(bundle):
    edit_json(raw(bundle, 6), lambda rec: rec["measured"].update(elapsed_s=rec["measured"]["elapsed_s"] * 1.5))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "record cpu0 seq 6" in text and "tokens_per_s" in text
    assert "arms.parquet: elapsed_s of cpu0 seq 6" in text


def test_changed_token_in_raw_record_and_table_is_caught_by_the_reference(bundle):
    """A forger who edits the raw record and the table alike still differs from the frozen reference."""
    def change_rec(rec):
        rec["warmup"]["outputs"]["r0000"]["token_ids"][3] = (rec["warmup"]["outputs"]["r0000"]["token_ids"][3] + 1) % 256
    edit_json(raw(bundle, 1), change_rec)
    edit_table(bundle, "tokens", lambda df: df.assign(token_id=df["token_id"].where(
        ~((df["seq"] == 1) & (df["phase"] == "warmup") & (df["request_id"] == "r0000") & (df["position"] == 3)),
        (df["token_id"] + 1) % 256)))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "tokens: cpu0 seq 1 B2C3" in text and "request 'r0000' position 3" in text
    assert "summary.json: checks.ok is True, the audit derives False" in text


def test_changed_plan_is_named(bundle):
    edit_json(bundle / "plan.json", lambda p: p["config"].update(pairs=3))
    text = failed(bundle)
    assert "manifest: plan.json changed" in text and "plan: config sha256" in text


def test_forged_elapsed_longer_than_the_wall_clock_span_is_named(bundle):
    def stretch(rec):
        wall = rec["wall_clock"]
        rec["measured"]["elapsed_s"] = 2 * (wall["measured_end_unix_s"] - wall["measured_start_unix_s"]) + 0.01
    rec = forge_elapsed(bundle, 6, stretch)
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    # everything else re-derives; the session log, which printed the true figure, also disagrees (check_logs)
    timing, logs = verdict["discrepancies"]
    assert timing.startswith(
        f"timing: record cpu0 seq 6 ({rec['arm']}): measured elapsed_s {rec['measured']['elapsed_s']!r} is longer "
        "than its wall-clock span")
    assert logs.startswith("logs: ") and f"record cpu0 seq 6 ({rec['arm']}) gives" in logs, logs


def test_record_without_a_wall_clock_span_is_named(bundle):
    rec = forge_elapsed(bundle, 3, lambda r: r.pop("wall_clock"))
    verdict = audit(bundle)
    assert verdict["status"] == "fail"
    assert verdict["discrepancies"] == [f"timing: record cpu0 seq 3 ({rec['arm']}): no wall-clock span to bound "
                                        "its measured elapsed_s: wall_clock is None"]


def test_a_record_claiming_a_later_schema_than_the_contract_knows_is_named(bundle):
    """A forged schema would select rules the auditor cannot know; the contract's latest_schema is the writer's."""
    from loopbench.harness.evidence import FORMAT
    from loopbench.harness.records import RECORD_SCHEMA

    assert RECORD_SCHEMA == FORMAT["documents"]["record"]["latest_schema"]
    edit_json(raw(bundle, 5), lambda rec: rec.update(schema=99))
    rewrite_manifest(bundle)
    assert f"schema is 99, later than the contract's latest record schema {RECORD_SCHEMA}" in failed(bundle)
