"""Evidence bundle pieces: atomic files, parquet schema version, pairs, the seed-style row, manifest."""
import json

import pandas as pd
import pyarrow.parquet as pq

from loopbench.harness import evidence, report


def test_atomic_writes_leave_no_temporaries(tmp_path):
    p = tmp_path / "sub" / "a.json"
    evidence.atomic_write_json(p, {"b": 1, "a": [1, 2]})
    evidence.atomic_write_json(p, {"b": 2})
    assert json.loads(p.read_text()) == {"b": 2}
    assert [q.name for q in p.parent.iterdir()] == ["a.json"]
    assert evidence.canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


def test_bundle_dir_never_reuses_a_folder(tmp_path):
    import datetime as dt

    day = dt.date(2026, 11, 30)
    a = evidence.bundle_dir(tmp_path, "x", "abc12345", day)
    b = evidence.bundle_dir(tmp_path, "x", "abc12345", day)
    assert a.name == "2026-11-30-x-abc12345" and b.name == "2026-11-30-x-abc12345-2"


def test_tables_carry_the_schema_version(tmp_path):
    evidence.write_table(tmp_path / "t.parquet", pd.DataFrame({"a": [1, 2]}))
    meta = pq.read_schema(tmp_path / "t.parquet").metadata
    assert meta[b"loopbench_schema_version"] == str(evidence.SCHEMA_VERSION).encode()


def test_pairs_need_both_arms():
    arms = pd.DataFrame([
        {"job": "g0", "device": "d", "point": "B1C1", "max_num_seqs": 1, "num_requests": 1, "output_len": 2,
         "comparison": "c", "pair": p, "position": pos, "slot": slot, "arm": pos[0], "seq": 2 * p + slot,
         "elapsed_s": e}
        for p, pos, slot, e in [(0, "baseline", 0, 2.0), (0, "candidate", 1, 1.0), (1, "candidate", 0, 1.0)]])
    pairs = evidence.build_pairs(arms)
    assert len(pairs) == 1 and pairs.iloc[0]["ratio"] == 2.0 and pairs.iloc[0]["first"] == "baseline"


def test_seed_style_row():
    res = {"device": "5090 #0", "max_num_seqs": 16, "num_requests": 32, "baseline_tokens_per_s": 387.054,
           "candidate_tokens_per_s": 380.449, "verdict": "slower",
           "stats": {"speedup": 0.98254, "ci": [0.97904, 0.98371]}}
    assert report.table_row(res, "128 / 64") == \
        "| 5090 #0 | 16 / 32 | 128 / 64 | 387.05 | 380.45 | 0.9825× [0.9790, 0.9837] | -1.75% | slower |"
    assert report.table_row({**res, "verdict": None, "stats": {"speedup": 1.0, "ci": None}}, "128 / 64").endswith(
        "| 1.0000× [n/a] | +0.00% | none |")


def test_manifest_lists_every_file_but_itself_and_the_audit(tmp_path):
    (tmp_path / "raw" / "j").mkdir(parents=True)
    (tmp_path / "raw" / "j" / "1.json").write_text("{}")
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "audit.json").write_text("{}")
    manifest = evidence.write_manifest(tmp_path)
    assert sorted(manifest["files"]) == ["plan.json", "raw/j/1.json"]
    assert manifest["files"]["plan.json"]["sha256"] == evidence.sha256_bytes(b"{}")


def test_plot_writes_a_png(tmp_path):
    pairs = pd.DataFrame({"job": ["g"] * 3, "point": ["B1C1"] * 3, "comparison": ["c"] * 3, "ratio": [0.9, 1.0, 1.1]})
    summary = {"status": "complete", "results": [{"job": "g", "point": "B1C1", "comparison": "c", "device": "cpu",
                                                  "max_num_seqs": 1, "num_requests": 1,
                                                  "stats": {"speedup": 1.0, "ci": [0.9, 1.1]}}]}
    report.plot_ratios(summary, pairs, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.png"]


def test_incomplete_reasons_are_status_codes_of_the_contract():
    child = {"name": "cpu0", "session": "cpu0.r1", "device": "cpu", "exit_code": None, "state": "interrupted",
             "wall_s": None, "log": "cpu0.r1.log", "interrupted_by": "SIGTERM"}
    reasons = evidence.incomplete_reasons([{**child, "session": "cpu0", "state": "completed", "exit_code": 0,
                                            "interrupted_by": None}, child], None, 3, 8)
    assert reasons == [{"code": "stopped", "by": "SIGTERM"},
                       {"code": "child_failed", "child": "cpu0.r1", "state": "interrupted", "exit_code": None},
                       {"code": "arms_missing", "recorded": 3, "planned": 8}]
    assert all(r["code"] in evidence.STATUS_CODES for r in reasons)
    assert report.reasons_text({"incomplete_reasons": reasons, "children": [child]}) == (
        "the controller received SIGTERM and stopped its children; child cpu0.r1 ended interrupted, never started; "
        "3 of 8 planned arms recorded")
    assert evidence.incomplete_reasons([], "reference_failed", 0, 0) == [{"code": "reference_failed"}]


def test_plan_point_requests_name_their_prompts():
    assert evidence.point_requests(3) == [{"request_id": "r0000", "prompt_index": 0},
                                          {"request_id": "r0001", "prompt_index": 1},
                                          {"request_id": "r0002", "prompt_index": 2}]
