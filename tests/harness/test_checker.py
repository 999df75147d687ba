"""The checker: any arm that departs from the frozen reference is named and bars every verdict."""
import copy

import pytest

from loopbench.harness import checker, evidence, report

ARM = {"kv_layout": "native", "prefix_tiles": False, "attention_backend": "torch", "cuda_graphs": False,
       "graph_cache_size": 16, "descriptor_mode": "h2d", "block_size": 16, "tile_size": 32}
TOKENS = {"r0000": ([5, 9, 2], [3, 4, 3]), "r0001": ([7, 7, 1], [3, 3, 4])}
WORK = {"rows_per_depth": [6, 6, 6, 2], "prefill_tokens": 10, "prefill_rows": 40, "decode_tokens": 4,
        "steps": 12, "decode_steps": 8}


def reference() -> dict:
    return {"schedule": {"requests": [{"request_id": rid, "token_ids": t, "exit_depths": d}
                                      for rid, (t, d) in TOKENS.items()], "trace_sha256": "abc"},
            "work": dict(WORK)}


def phase(elapsed_s: float) -> dict:
    return {"elapsed_s": elapsed_s,
            "outputs": {rid: {"token_ids": list(t), "exit_depths": list(d), "finish_reason": "length"}
                        for rid, (t, d) in TOKENS.items()},
            "work": copy.deepcopy(WORK), "graphs": {"captures": 0, "replays": 0, "fallbacks": 0},
            "memory": {"peak_allocated_bytes": None, "peak_reserved_bytes": None}, "kv_blocks_used": 4,
            "trace_sha256": "abc"}


def records(n_pairs: int = 6, speedup: float = 1.10) -> list[dict]:
    out, seq = [], 0
    for pair in range(n_pairs):
        for slot, pos in enumerate(("baseline", "candidate") if pair % 2 == 0 else ("candidate", "baseline")):
            elapsed = 1.0 + 0.01 * pair if pos == "baseline" else (1.0 + 0.01 * pair) / speedup
            arm = "native" if pos == "baseline" else "alias_prefix"
            out.append({"job": "cpu0", "seq": seq, "device": {"label": "cpu"}, "point": "B2C2", "max_num_seqs": 2,
                        "num_requests": 2, "output_len": 3, "comparison": "native_vs_alias_prefix", "pair": pair,
                        "position": pos, "slot": slot, "arm": arm, "arm_config": dict(ARM),
                        "tokens_per_s": 6 / elapsed, "warmup": phase(2 * elapsed), "measured": phase(elapsed),
                        "telemetry": {"start": None, "end": None}})
            seq += 1
    return out


def plan_for(recs: list[dict]) -> dict:
    order = [{k: r[k] for k in ("seq", "point", "comparison", "pair", "position", "slot", "arm")} for r in recs]
    return {"name": "unit", "devices": [{"name": "cpu0"}], "points": [{"key": "B2C2"}], "order": {"cpu0": order},
            "config": {"comparisons": [{"name": "native_vs_alias_prefix", "baseline": "native",
                                        "candidate": "alias_prefix"}],
                       "verdict": {"confidence": 0.95, "n_resamples": 2000, "bootstrap_seed": 0, "min_effect": 0.01,
                                   "min_pairs": 6, "eager_fraction_tolerance": 0.001},
                       "pairs": 6, "sessions": 1, "evidence": {"alpha": 0.05, "power": 0.8, "noise_bundle": None,
                                                               "noise_sigma": None}},
            "detectable_effect": {"method": "normal", "alpha": 0.05, "power": 0.8, "pairs_per_session": 6, "sessions": 1,
                                  "n_pairs": 6, "mde_log_ratio": None, "mde_relative": None,
                                  "noise": {"source": "unknown", "bundle": None, "summary_sha256": None, "ratios": None,
                                            "sigma_log_ratio": None}}}


def test_clean_records_pass():
    rep = checker.check(records(), {"B2C2": reference()})
    assert rep.ok and rep.arms_checked == 12 and rep.phases_checked == 24 and rep.tokens_checked == 24 * 6


@pytest.mark.parametrize("phase_name", ["warmup", "measured"])
def test_planted_token_mismatch_is_named(phase_name):
    recs = records()
    recs[5][phase_name]["outputs"]["r0001"]["token_ids"][2] = 99
    rep = checker.check(recs, {"B2C2": reference()})
    assert not rep.ok and len(rep.findings) == 1
    f = rep.findings[0]
    assert (f.kind, f.arm, f.phase, f.request_id, f.position, f.expected, f.got) == (
        "tokens", recs[5]["arm"], phase_name, "r0001", 2, 1, 99)
    assert f"arm {recs[5]['arm']!r}" in f.message() and "request 'r0001' position 2" in f.message()


@pytest.mark.parametrize("phase_name", ["warmup", "measured"])
def test_planted_exit_depth_difference_is_named_in_either_phase(phase_name):
    """Equal tokens but one exit one loop early: a warmup that exits differently is as wrong as a measured run."""
    recs = records()
    frozen = TOKENS["r0000"][1][1]
    recs[4][phase_name]["outputs"]["r0000"]["exit_depths"][1] = frozen - 1
    rep = checker.check(recs, {"B2C2": reference()})
    assert not rep.ok and len(rep.findings) == 1
    f = rep.findings[0]
    assert (f.kind, f.arm, f.pair, f.phase, f.request_id, f.position, f.expected, f.got) == (
        "exit_depths", recs[4]["arm"], recs[4]["pair"], phase_name, "r0000", 1, frozen, frozen - 1)
    assert f"{phase_name} request 'r0000' position 1" in f.message()


def test_exit_depth_work_capture_trace_and_coverage_findings():
    recs = records()
    recs[0]["measured"]["outputs"]["r0000"]["exit_depths"][1] = 3
    recs[1]["warmup"]["work"]["rows_per_depth"] = [6, 6, 5, 2]
    recs[2]["measured"]["graphs"]["captures"] = 2
    recs[3]["measured"]["trace_sha256"] = "other"
    recs[4]["measured"]["graphs"]["fallbacks"] = 1           # its pair partner has 0 and the same graph settings
    recs[6]["measured"]["outputs"].pop("r0001")
    kinds = sorted(f.kind for f in checker.check(recs, {"B2C2": reference()}).findings)
    assert kinds == ["captures", "exit_depths", "graph_coverage", "requests", "trace", "work"]


def test_planted_mismatch_bars_every_verdict():
    recs = records(speedup=1.10)
    tables = evidence.build_tables(recs)
    plan = plan_for(recs)
    children = [{"name": "cpu0", "exit_code": 0, "state": "completed", "device": "cpu", "wall_s": 1.0}]
    clean = evidence.summarize(plan, "x", tables, checker.check(recs, {"B2C2": reference()}).to_dict(), children)
    assert clean["status"] == "complete" and clean["verdicts_published"]
    assert clean["results"][0]["verdict"] == "faster"
    recs[7]["measured"]["outputs"]["r0000"]["token_ids"][0] = 6
    findings = checker.check(recs, {"B2C2": reference()})
    summary = evidence.summarize(plan, "x", evidence.build_tables(recs), findings.to_dict(), children)
    assert summary["status"] == "complete" and not summary["verdicts_published"]
    assert summary["verdicts_barred_by"] == "checks failed"
    assert [r["verdict"] for r in summary["results"]] == [None]
    assert summary["results"][0]["stats"]["verdict"] == "faster"     # the rule's outcome is kept, not published
    text = report.render_report({**plan, "code": {"git_sha": "x", "git_dirty": False},
                                   "checkpoint": {"description": "d", "sha256": "s"}, "prompts": {"sha256": "p"},
                                   "reference_arm": "native",
                                   "config": {**plan["config"], "workload": {"prompt_len": 1, "output_len": 3,
                                                                             "prompts_file": None},
                                              "exit": {"policy": "ouro_delayed", "threshold": 0.5, "min_loops": 2,
                                                       "max_loops": 4},
                                              "model": {"dtype": "float32"}, "pairs": 6, "order_seed": 0,
                                              "warmup": True}},
                                  summary, evidence.build_tables(recs)["arms"], {})
    assert "every verdict is barred" in text and "request 'r0000' position 0" in text
    assert "| CPU | 2 / 2 |" in text and "| none |" in text


def test_missing_warmup_is_a_finding_unless_warmup_is_off():
    recs = records(2)
    recs[0]["warmup"] = None
    assert [f.kind for f in checker.check(recs, {"B2C2": reference()}).findings] == ["missing"]
    assert checker.check(recs, {"B2C2": reference()}, warmup=False).ok
