"""Format 15's two flags, from a CPU run measured on a machine made busy (machine.busy_cores_now patched) with 6 pairs,
enough for a verdict: environment.json's ``cpu_load`` and its warning under report.md's header; and an A/A control
whose candidate runs were made slower (raw records and their session's log lines, then the harness's republish, as
a forger with the harness would): summary.json's ``noise_floor`` and its warning above the result tables. The
auditor re-derives both warnings and the flag; a removed or forged one is named."""
import json
import re
import shutil
from pathlib import Path

import pytest

from loopbench.audit.auditor import audit
from loopbench.harness import conf, controller, evidence, machine, stats
from tests.audit.conftest import MINI
from tests.audit.tamper import edit_json, edit_report, failed, republish, rewrite_manifest

LOG = evidence.FORMAT["documents"]["log"]


@pytest.fixture(scope="module")
def busy_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flags")
    cfg = conf.compose("cpu-smoke", [o for o in MINI if not o.startswith("pairs=")]
                       + ["pairs=6", f"results_dir={root / 'results'}", f"cache_dir={root / 'cache'}"])
    with pytest.MonkeyPatch.context() as patch:   # the controller samples in this process; 1.9 of 2 cores busy
        patch.setattr(machine, "usable_cores", lambda: 2)
        patch.setattr(machine, "busy_cores_now", lambda: 1.9)
        patch.setattr(machine, "load_average_1m", lambda: 3.25)
        result = controller.run(cfg)
    assert result.summary["status"] == "complete" and result.summary["checks"]["ok"]
    return result.bundle


@pytest.fixture
def bundle(busy_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(busy_bundle, tmp_path / busy_bundle.name))


def _passes(bundle: Path) -> dict:
    verdict = audit(bundle)
    assert verdict["status"] == "pass", verdict["discrepancies"]
    return verdict


def _report(bundle: Path) -> list[str]:
    return (bundle / "report.md").read_text().split("\n")


def test_busy_machine_is_recorded_and_warned_of(bundle):
    load = json.loads((bundle / "environment.json").read_text())["cpu_load"]
    assert load == {"sampled": "run start", "usable_cores": 2, "threads": 1, "busy_cores": 1.9, "window_s": 0.2,
                    "load_average_1m": 3.25}
    lines = _report(bundle)
    warning = ("**Warning: at the run's start other work kept 1.9 of the 2 usable cores busy, fewer idle than the "
               "run's 1 thread: CPU timings are for smoke checks, not performance evidence** (environment.json "
               "cpu_load).")
    assert lines[lines.index("## Result") - 2] == warning       # the header's last line, after a blank line
    assert lines[lines.index(warning) - 1] == ""
    assert _passes(bundle)["checked"]["cpu_load"] == 1


@pytest.mark.parametrize("edit, named", [
    (lambda load: load.update(busy_cores=0.2),    # an idle machine claimed: the warning no longer follows
     "report.md: line 9 (header) is not in the re-derived report"),
    (lambda load: load.update(threads=4), "environment.json: cpu_load has threads 4, where the plan's CPU sessions run 1"),
    (lambda load: load.update(busy_cores=7.5), "environment.json: cpu_load has busy_cores 7.5 outside 0 .. usable_cores 2"),
    (lambda load: load.clear(), "environment.json: is not the environment document of loopbench/bundle_format.json "
                                "version 15: cpu_load.sampled is missing"),
])
def test_forged_cpu_load_is_named(bundle, edit, named):
    edit_json(bundle / "environment.json", lambda env: edit(env["cpu_load"]))
    rewrite_manifest(bundle)
    assert named in failed(bundle)


def test_removed_cpu_load_or_its_warning_is_named(bundle, tmp_path):
    other = Path(shutil.copytree(bundle, tmp_path / "other"))
    edit_json(bundle / "environment.json", lambda env: env.pop("cpu_load"))
    rewrite_manifest(bundle)
    assert "environment.json: is not the environment document of loopbench/bundle_format.json version 15: " \
        "cpu_load is missing" \
        in failed(bundle)
    edit_report(other, lambda lines: [line for line in lines if not line.endswith("(environment.json cpu_load).")])
    rewrite_manifest(other)
    assert 'report.md: lacks the re-derived line "**Warning: at the run\'s start other work kept 1.9' in failed(other)


def _slower_aa_candidates(bundle: Path) -> list[int]:
    """Every A/A candidate run's measured elapsed_s stretched to nearly its wall-clock span (the most the auditor
    admits; on a loaded machine a run's own elapsed_s scatters too widely for a factor to read a change), in its raw
    record and its session's log line, then every figure republished by the harness: a bundle whose A/A
    comparison reads slower."""
    log = bundle / "logs" / "cpu0.log"
    text, seqs = log.read_text(), []
    for path in sorted((bundle / "raw" / "cpu0").glob("*.json")):
        rec = json.loads(path.read_text())
        if rec["comparison"] != "native_vs_native" or rec["position"] != "candidate":
            continue
        old = LOG["arm_line"].format(key=LOG["arm_line_key"].format(**rec), elapsed_s=rec["measured"]["elapsed_s"],
                                     tokens_per_s=rec["tokens_per_s"])
        span = rec["wall_clock"]["measured_end_unix_s"] - rec["wall_clock"]["measured_start_unix_s"]
        rec["measured"]["elapsed_s"] = max(rec["measured"]["elapsed_s"], 0.995 * span)
        rec["tokens_per_s"] = stats.tokens_per_s(rec["num_requests"], rec["output_len"], rec["measured"]["elapsed_s"])
        new = LOG["arm_line"].format(key=LOG["arm_line_key"].format(**rec), elapsed_s=rec["measured"]["elapsed_s"],
                                     tokens_per_s=rec["tokens_per_s"])
        assert text.count(old) == 1
        text = text.replace(old, new)
        path.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
        seqs.append(rec["seq"])
    log.write_text(text)
    republish(bundle)
    return seqs


def test_aa_control_reading_slower_is_flagged_and_warned_of(bundle):
    assert json.loads((bundle / "summary.json").read_text())["noise_floor"] == []   # 1 ms apart: no change read
    assert len(_slower_aa_candidates(bundle)) == 6
    summary = json.loads((bundle / "summary.json").read_text())
    aa = next(r for r in summary["results"] if r["comparison"] == "native_vs_native")
    real = next(r for r in summary["results"] if r["comparison"] == "native_vs_alias_prefix")
    assert aa["verdict"] == "slower" and summary["verdicts_published"]   # the verdicts stay published, flagged
    assert summary["noise_floor"] == [{
        "job": "cpu0", "device": "cpu", "point": aa["point"], "comparison": "native_vs_native", "verdict": "slower",
        "speedup": aa["stats"]["speedup"], "ci": aa["stats"]["ci"], "affected": ["native_vs_alias_prefix"]}]
    lines = _report(bundle)
    warning = lines[lines.index("## Result") + 2]
    assert warning == (
        f"**Warning: the A/A control native_vs_native reads slower on CPU at B / C 2 / 3, P / D 17 / 4: "
        f"{aa['stats']['speedup']:.4f}× [{aa['stats']['ci'][0]:.4f}, {aa['stats']['ci'][1]:.4f}] "
        f"({100 * (aa['stats']['speedup'] - 1):+.2f}%).** Both of its arms run one configuration, so this point's "
        f"between-arm noise (order, drift, machine load) is larger than its 95% CI admits, and the verdicts of "
        f"native_vs_alias_prefix ({real['verdict']}) here may read that noise; they stay as the rule gives them, "
        f"flagged (summary.json noise_floor).")
    assert lines[lines.index(warning) + 1] == "" and lines[lines.index(warning) + 2].startswith("### ")
    _passes(bundle)


def test_removed_or_forged_noise_floor_is_named(bundle, tmp_path):
    honest = Path(shutil.copytree(bundle, tmp_path / "honest"))
    _slower_aa_candidates(bundle)
    flagged = Path(shutil.copytree(bundle, tmp_path / "flagged"))
    edit_json(bundle / "summary.json", lambda s: s.update(noise_floor=[]))
    rewrite_manifest(bundle)
    assert "summary.json: noise_floor has 0 entries, the audit derives 1" in failed(bundle)
    edit_report(flagged, lambda lines: [line for line in lines if not line.endswith("(summary.json noise_floor).")])
    rewrite_manifest(flagged)
    assert 'report.md: lacks the re-derived line "**Warning: the A/A control native_vs_native reads slower' \
        in failed(flagged)
    edit_json(honest / "summary.json", lambda s: s.update(noise_floor=[{"job": "cpu0", "comparison": "native_vs_native"}]))
    rewrite_manifest(honest)
    assert "summary.json: noise_floor has 1 entries, the audit derives 0" in failed(honest)
