"""The ``loopbench`` command: help, plan (creates nothing), a multirun checked up front, show, compare."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loopbench.harness import cli, conf, keys

REPO = Path(__file__).resolve().parents[2]
TINY = ["--config-name", "cpu-smoke", "name=cli", "points=[{max_num_seqs:2,num_requests:2}]", "workload.prompt_len=5",
        "workload.prompt_lens=null", "workload.output_len=2", "pairs=2",
        "comparisons=[{baseline:native,candidate:alias_prefix}]", "executor.poll_s=0.1"]


def loopbench(cwd: Path, *args: str):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("LOOPBENCH_QUIET", None)
    return subprocess.run([sys.executable, "-m", "loopbench", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_every_config_key_has_a_meaning_and_help_lists_them(capsys):
    assert {k for k, _, _ in keys.schema_keys()} == set(keys.MEANINGS)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "workload.output_len (int; 128): D: output tokens" in out and "arms.<name>.kv_layout" in out
    assert "exit status:" in out and "3  the run or bundle is incomplete" in out and "LOOPBENCH_CACHE" in out
    for command in ("plan", "show", "compare", "audit"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "exit status:" in capsys.readouterr().out, command


def _multirun_help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    start = out.index("-m, --multirun")
    return " ".join(out[start:out.index("\n\n", start)].split())   # the option's help, up to its section's end


def test_multirun_help_says_what_each_command_does_with_a_sweep(capsys):
    """plan's -m said bench's words, 'runs one benchmark per combination, each into its own bundle', of a command
    that creates nothing; neither said that a preset's own hydra.sweeper.params sweep is one -m runs too."""
    plan, bench = _multirun_help("plan", capsys), _multirun_help("bench", capsys)
    assert "runs one benchmark" not in plan and "plan of each job" in plan, plan
    assert "each into its own bundle" in bench, bench
    assert all("hydra.sweeper.params" in text for text in (plan, bench)), (plan, bench)


def test_plan_prints_the_order_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["plan", *TINY, f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "arms: 4 measured runs per device = 1 point x 1 comparison x 2 pairs x 1 session x 2 arms" in out
    assert "B2C2 pair 0:  native_vs_alias_prefix [" in out and "B2C2 pair 1:" in out
    assert "to be synthesized once" in out and "estimated duration: unknown" in out
    assert "detectable effect: unknown (2 pairs per comparison; no noise estimate" in out
    assert "verdicts: none possible: 2 pairs per comparison, fewer than verdict.min_pairs = 6; every result will " \
           "read inconclusive" in out
    assert list(tmp_path.iterdir()) == []      # no bundle, no cache, no outputs/ of Hydra's


@pytest.mark.parametrize("overrides, line", [
    (["pairs=7", "verdict.confidence=0.99"], "  verdicts: none possible: 7 pairs per comparison, so the signed-rank p "
     "is at least 2 / 2^7 = 0.0156, never below 1 - verdict.confidence = 0.01; every result will read inconclusive"),
    (["pairs=4", "sessions=2", "verdict.confidence=0.99"], None),     # 8 pairs: 2 / 256 < 0.01
    (["pairs=7"], None),
])
def test_plan_says_when_no_verdict_is_possible(tmp_path, monkeypatch, capsys, overrides, line):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", *TINY, *overrides, f"results_dir={tmp_path / 'r'}",
                     f"cache_dir={tmp_path / 'c'}"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  verdicts:")]
    assert lines == ([line] if line else [])


def test_plan_prints_sessions_and_the_detectable_effect_of_the_plan(tmp_path, monkeypatch, capsys):
    from loopbench.harness import stats
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["plan", *TINY, "sessions=2", "evidence.noise_sigma=0.04", f"results_dir={tmp_path / 'r'}",
                   f"cache_dir={tmp_path / 'c'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(2 sessions each" in out and "2 pairs x 2 sessions x 2 arms" in out
    mde = stats.detectable_effect(0.04, 4, 0.05, 0.8)["mde_relative"]     # n = pairs x sessions
    assert f"detectable effect: {mde:+.2%} speedup (4 pairs per comparison, alpha 0.05, power 80%, noise sigma 0.04 (declared))" in out
    assert list(tmp_path.iterdir()) == []


def test_plan_names_a_bad_key_and_quiet_silences_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOOPBENCH_QUIET", raising=False)
    assert cli.main(["plan", "pairs=0"]) == 2
    err = capsys.readouterr().err
    assert "loopbench: preset: cpu-smoke" in err and "bad configuration: pairs must be a positive integer" in err
    assert cli.main(["-q", "plan", "exit.treshold=0.2"]) == 2
    err = capsys.readouterr().err
    assert "exit.treshold" in err and "loopbench: preset" not in err
    # a required value left out is named by its path, without OmegaConf's type trailers
    assert cli.main(["-q", "plan", "points=[{max_num_seqs:3}]"]) == 2
    err = capsys.readouterr().err
    assert "bad configuration: missing required key points[0].num_requests: give it a value" in err
    assert "object_type" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, named", [
    (["bench", "--confg-name", "cpu-smoke"], "--confg-name"),     # once: "'cpu-smoke' is not an override"
    (["bench", "--pairs", "3"], "--pairs"),                        # once: "'3' is not an override"
    (["bench", "--pairs=3"], "--pairs=3"),                         # once: Hydra's usage text
    (["bench", "-m", "--pairs=3", "pairs=1,2"], "--pairs=3"),      # once: after "sweep: 2 jobs, every ... valid"
    (["plan", "--confg-name", "cpu-smoke"], "--confg-name"),
    (["plan", "--hydra-help"], "--hydra-help"),                    # passed on to Hydra by bench alone
])
def test_an_unknown_option_is_named_before_anything_runs(tmp_path, monkeypatch, capsys, argv, named):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == f"loopbench: error: unrecognized arguments: {named}"
    assert "sweep:" not in out + err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--cfg", "job", "-m", "pairs=2,3"], "-m and --cfg cannot be combined"),     # once: Hydra's ValueError traceback
    (["--info", "config", "-m", "pairs=2,3"], "-m and --info cannot be combined"),
    (["--cfg", "job", "--info"], "--cfg and --info cannot be combined"),
    (["--hydra-help", "pairs=3"], "--hydra-help shows Hydra's help and takes no overrides (got pairs=3)"),  # once: a
])                                                                  # traceback, the override applied to Hydra's help
def test_hydra_modes_that_do_not_go_together_are_named_in_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1].startswith(f"loopbench: error: {message}"), err
    assert "Traceback" not in out + err and list(tmp_path.iterdir()) == []


def test_a_deletion_after_multirun_is_an_override_too(tmp_path, monkeypatch, capsys):
    """`~key` in the positionals after -m was left to the unknown-option check ("unrecognized arguments: ~arms.alias")
    by a filter that took only KEY=VALUE there; before -m it was always an override."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "pairs=1", "-m", "~arms.alias", "comparisons=[{baseline:native,candidate:alias_prefix}]"]) == 0
    assert "native_vs_alias_prefix [native -> alias_prefix]" in capsys.readouterr().out


def test_bench_passes_on_hydras_version_flag(tmp_path):
    proc = loopbench(tmp_path, "bench", "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("Hydra "), proc.stdout + proc.stderr


def test_multirun_checks_every_job_before_the_first_runs(tmp_path):
    proc = loopbench(tmp_path, "bench", *TINY, f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}",
                     "-m", "pairs=1,0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "bad configuration in sweep job 2 of 2 (pairs=0): pairs must be a positive integer" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_presets_own_sweep_is_checked_and_planned_job_by_job(tmp_path, monkeypatch, capsys):
    """A preset's ``hydra.sweeper.params`` sweep under ``-m`` as Hydra runs them (before the command line's, which
    win). They were left out of the checks: ``bench -m`` said "sweep: 1 jobs, every configuration valid", ran job 1
    and then "job 2 of 1" unchecked; ``plan -m`` printed one plan."""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    sweep = "defaults:\n  - cpu-smoke\n  - _self_\nname: my-sweep\nhydra:\n  sweeper:\n    params:\n      pairs: {}\n"
    (configs / "my-sweep.yaml").write_text(sweep.format("1,2"))
    assert conf.sweeper_params("my-sweep") == ["pairs=1,2"] and conf.sweeper_params("cpu-smoke") == []
    assert cli.main(["-q", "plan", "--config-name", "my-sweep", "-m"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" = ")[1].split(",")[0] for line in out.splitlines() if line.startswith("  arms: ")] == [
        "2 points x 3 comparisons x 1 pair x 1 session x 2 arms", "2 points x 3 comparisons x 2 pairs x 1 session x 2 arms"]
    # each plan named its job only by "1 override", which the user never typed: now as the sweep's refusals name it
    assert [line for line in out.splitlines() if line.startswith("sweep job")] == [
        "sweep job 1 of 2 (pairs=1):", "sweep job 2 of 2 (pairs=2):"], out
    assert cli.main(["-q", "plan", "--config-name", "my-sweep", "-m", "pairs=4"]) == 0     # the command line wins
    assert capsys.readouterr().out.count("  arms: ") == 1
    assert cli.main(["-q", "plan", "--config-name", "my-sweep"]) == 0     # without -m Hydra sweeps nothing
    assert capsys.readouterr().out.count("  arms: ") == 1
    (configs / "my-sweep.yaml").write_text(sweep.format("1,0"))
    for command in ("plan", "bench"):
        assert cli.main(["-q", command, "--config-name", "my-sweep", "-m", f"results_dir={tmp_path / 'r'}"]) == 2
        err = capsys.readouterr().err
        assert "bad configuration in sweep job 2 of 2 (pairs=0): pairs must be a positive integer" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


@pytest.fixture(scope="module")
def two_bundles(tmp_path_factory):
    """Two cpu bundles of one configuration (a two-job multirun), run from an empty working directory."""
    tmp = tmp_path_factory.mktemp("sweep")
    work = tmp / "cwd"
    work.mkdir()
    proc = loopbench(work, "bench", *TINY, f"results_dir={tmp / 'r'}", f"cache_dir={tmp / 'c'}", "-m", "order_seed=0,1")
    return proc, work, sorted((tmp / "r").iterdir())


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_multirun_makes_two_audited_bundles_with_progress_and_no_hydra_folders(two_bundles):
    proc, work, bundles = two_bundles
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(json.loads((b / "plan.json").read_text())["config"]["order_seed"] for b in bundles) == [0, 1]
    assert all(json.loads((b / "audit.json").read_text())["status"] == "pass" for b in bundles)
    assert list(work.iterdir()) == []          # no outputs/, multirun/, multirun.yaml or log file
    for line in ("loopbench: sweep: 2 jobs, every configuration valid", "loopbench: sweep: job 2 of 2; the sweep "
                 "should end in about", "loopbench: checkpoint: ", "loopbench: calibration: gate bias",
                 "loopbench: references: B2C2: captured", "loopbench: references: B2C2: reused", "loopbench: audit: "):
        assert line in proc.stderr, line


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_resuming_a_complete_bundle_is_bad_usage_named_in_one_line(two_bundles, tmp_path, monkeypatch, capsys):
    _, work, (a, _) = two_bundles
    before = sorted((p.relative_to(a), p.stat().st_mtime_ns) for p in a.rglob("*"))
    args = [*TINY, f"results_dir={a.parent}", f"cache_dir={tmp_path / 'c'}", f"resume={a}"]
    proc = loopbench(work, "bench", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "loopbench: bad configuration: resume = " in proc.stderr
    assert "a complete bundle cannot be resumed" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted((p.relative_to(a), p.stat().st_mtime_ns) for p in a.rglob("*")) == before
    monkeypatch.chdir(tmp_path)   # plan refuses it too, with bench's line, and creates nothing
    assert cli.main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    refusal = [line for line in proc.stderr.splitlines() if "bad configuration" in line]
    assert out == "" and err.splitlines() == refusal and len(refusal) == 1
    assert sorted((p.relative_to(a), p.stat().st_mtime_ns) for p in a.rglob("*")) == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_plan_estimates_from_the_latest_created_bundle_whatever_the_folder_times(two_bundles, tmp_path, monkeypatch,
                                                                                 capsys):
    """A copy or a checkout reorders folder mtimes; the bundle the estimate comes from follows plan.json."""
    _, _, (a, b) = two_bundles
    results = tmp_path / "r"
    older, newer = results / "z-created-first", results / "a-created-last"   # names sort against creation
    for src, dst, created in ((a, older, "2026-01-01T00:00:00+00:00"), (b, newer, "2026-01-02T00:00:00+00:00")):
        shutil.copytree(src, dst)
        plan = json.loads((dst / "plan.json").read_text())
        (dst / "plan.json").write_text(json.dumps({**plan, "created_utc": created}))
    os.utime(older, (2e9, 2e9))      # the folder created first was touched last
    os.utime(newer, (1e9, 1e9))
    monkeypatch.chdir(tmp_path)
    args = ["plan", *TINY, f"results_dir={results}", f"cache_dir={a.parent.parent / 'c'}"]
    assert cli.main(args) == 0
    assert "audit; from a-created-last" in capsys.readouterr().out
    plan = json.loads((newer / "plan.json").read_text())   # created in the same second: the later folder name
    (newer / "plan.json").write_text(json.dumps({**plan, "created_utc": "2026-01-01T00:00:00+00:00"}))
    os.utime(newer, (3e9, 3e9))
    assert cli.main(args) == 0
    assert "audit; from z-created-first" in capsys.readouterr().out


def test_plan_estimate_counts_each_session_of_a_resumed_bundle_once():
    """A bundle stopped by a dead controller and resumed: its first session's wall time is lost (null) and the
    second measured only the arms left. Each session's fixed cost is its own wall time less its own runs."""
    from types import SimpleNamespace

    import pandas as pd

    from loopbench.harness import planning

    # 4 arms in the lost session cpu0, 32 in cpu0.r1; every run 1.5 s (1 s warmup + 0.5 s measured)
    arms = pd.DataFrame({"point": ["B2C2"] * 36, "job": ["cpu0"] * 36, "session": ["cpu0"] * 4 + ["cpu0.r1"] * 32,
                         "warmup_elapsed_s": [1.0] * 36, "elapsed_s": [0.5] * 36})
    children = [{"name": "reference", "session": "reference", "wall_s": 4.0},
                {"name": "cpu0", "session": "cpu0", "wall_s": None},
                {"name": "cpu0", "session": "cpu0.r1", "wall_s": 32 * 1.5 + 10.0}]   # 10 s of fixed cost
    earlier = SimpleNamespace(arms=arms, summary={"children": children})
    order = [SimpleNamespace(point="B2C2")] * 36
    assert planning.estimate_s(earlier, order) == (4.0, 36 * 1.5 + 10.0)
    # an uninterrupted bundle: one session, its fixed cost once; older bundles name no session (job only)
    whole = SimpleNamespace(arms=arms.drop(columns="session"),
                            summary={"children": [children[0], {"name": "cpu0", "wall_s": 36 * 1.5 + 8.0}]})
    assert planning.estimate_s(whole, order) == (4.0, 36 * 1.5 + 8.0)
    # a plan of two sessions a device (sessions=2): two processes, each loading the model, so the fixed cost twice
    restarted = SimpleNamespace(arms=arms.assign(session=["cpu0"] * 18 + ["cpu0.s1"] * 18), summary={"children": [
        children[0], {"name": "cpu0", "session": "cpu0", "wall_s": 18 * 1.5 + 10.0},
        {"name": "cpu0", "session": "cpu0.s1", "wall_s": 18 * 1.5 + 10.0}]})
    assert planning.estimate_s(restarted, order, sessions=2) == (4.0, 36 * 1.5 + 20.0)


def _earlier_of_tiny(run_s: float, fixed_s: float):
    """A complete earlier bundle of TINY's point as the estimate reads one: every arm run ``run_s`` (warmup +
    measured), its one session ``fixed_s`` more than its runs."""
    from types import SimpleNamespace

    import pandas as pd

    arms = pd.DataFrame({"point": ["B2C2"] * 4, "job": ["cpu0"] * 4, "session": ["cpu0"] * 4,
                         "warmup_elapsed_s": [run_s / 2] * 4, "elapsed_s": [run_s / 2] * 4})
    children = [{"name": "reference", "session": "reference", "wall_s": 1.0},
                {"name": "cpu0", "session": "cpu0", "wall_s": 4 * run_s + fixed_s}]
    return SimpleNamespace(path=Path("2026-01-01-cli-earlier"), arms=arms, summary={"children": children})


def test_the_timeout_bounds_one_session_its_fixed_cost_plus_its_own_arms():
    """executor.session_timeout_s bounds each session child, so a plan of two sessions a device is held to its
    longest session, not to the device's whole order."""
    from types import SimpleNamespace

    from loopbench.harness import planning

    run_s, fixed_s = 1.5, 10.0
    earlier = _earlier_of_tiny(run_s, fixed_s)
    order = [SimpleNamespace(point="B2C2", pair=pair) for pair in (0, 0, 1, 1, 2, 2)]   # 2 pairs a session
    assert planning.longest_session_s(earlier, order, pairs_per_session=2) == fixed_s + 4 * run_s
    assert planning.longest_session_s(earlier, order, pairs_per_session=3) == fixed_s + 6 * run_s
    # a resume is warned, never refused (its killed session's arms are kept), and told the timeout it may set
    over = planning.SessionTiming(timeout_s=1.0, estimate_s=10.0, source="b", resuming=True)
    assert not over.refused and over.close
    assert f"raise executor.session_timeout_s, which a resume may change, to at least {over.needed_s()}" in \
        over.warning()


def test_a_session_that_cannot_finish_before_its_timeout_is_refused_before_anything_runs(tmp_path, monkeypatch,
                                                                                      capsys):
    """plan estimated the sessions but never compared them with executor.session_timeout_s: a run whose session
    was sure to be killed mid-run was planned and started. Past TIMEOUT_MARGIN x the timeout it is refused (exit 2,
    one line naming both figures and what to change), close to it warned, well within it stated."""
    from loopbench.harness import planning

    run_s, fixed_s = 1.5, 10.0
    estimate = fixed_s + 4 * run_s                     # TINY: 1 point x 1 comparison x 2 pairs x 2 arms, 1 session
    monkeypatch.setattr(planning, "_cached_checkpoint_sha", lambda spec, got: "0" * 64)   # as if cached
    monkeypatch.setattr(planning, "_earlier_bundle", lambda results, plan_like: _earlier_of_tiny(run_s, fixed_s))
    monkeypatch.chdir(tmp_path)
    results, cache = tmp_path / "r", tmp_path / "c"
    base = [*TINY, f"results_dir={results}", f"cache_dir={cache}"]
    too_short = estimate / 2                         # past the refusal margin (checked below)
    for command in (["plan"], ["bench"], ["bench", "-m"]):
        extra = [f"executor.session_timeout_s={too_short},{estimate * 10}"] if "-m" in command else [
            f"executor.session_timeout_s={too_short}"]
        assert cli.main([*command, *base, *extra]) == 2, command
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("loopbench: bad configuration" + (" in sweep job 1 of 2" if "-m" in command else ""))
        assert f"executor.session_timeout_s = {too_short:g} s" in err and "2026-01-01-cli-earlier" in err, err
        assert f"estimated at about {estimate:.0f} s" in err and "would be killed mid-run" in err, err
        assert f"raise executor.session_timeout_s to at least {math.ceil(estimate * planning.TIMEOUT_MARGIN)}" in err
    assert list(tmp_path.iterdir()) == []              # nothing measured or written
    assert estimate / too_short > planning.TIMEOUT_MARGIN

    close = estimate                                   # the estimate at the timeout: it may or may not fit
    assert cli.main(["plan", *base, f"executor.session_timeout_s={close}"]) == 0
    out = capsys.readouterr().out
    assert f"  warning: executor.session_timeout_s = {close:g} s" in out and "may be killed mid-run" in out, out
    warned = []
    planning.check("cpu-smoke", [*base[2:], f"executor.session_timeout_s={close}"], warned.append)
    assert len(warned) == 1 and "may be killed mid-run" in warned[0]     # bench prints it on stderr

    ample = estimate * planning.TIMEOUT_MARGIN * 2
    assert cli.main(["plan", *base, f"executor.session_timeout_s={ample}"]) == 0
    out = capsys.readouterr().out
    assert f"  session timeout: {ample:g} s; the longest session is estimated at about {estimate:.0f} s" in out
    assert "warning" not in out


def test_show_all_of_a_missing_folder_is_bad_usage(tmp_path, capsys):
    assert cli.main(["show", "--all", "--results", str(tmp_path / "none")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_compare_of_two_cpu_bundles_prints_a_table(two_bundles):
    _, work, (a, b) = two_bundles
    proc = loopbench(work, "compare", str(a), str(b))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| B / C | arm | A tokens/s (runs) | B tokens/s (runs) | change [95% interval] | |" in proc.stdout
    assert f"A: {a.name} (code " in proc.stdout and "; CPU; complete)" in proc.stdout
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| 2 / 2 |")]
    assert [r.split(" | ")[1] for r in rows] == ["alias_prefix", "native"]
    # pairs=2 is below the default verdict.min_pairs (6): both bundles are named and no row gives a verdict
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert [w.split()[1] for w in warnings] == ["A", "B"] and all("minimum of 6 (verdict.min_pairs)" in w
                                                                  for w in warnings), warnings
    assert lines.index(warnings[-1]) < lines.index(rows[0])
    assert all(r.endswith("| withheld: A 2 pairs < min 6; B 2 pairs < min 6 |") for r in rows), rows
    assert "2 intervals shown, each a 95% interval on its own with no multiplicity correction" in proc.stdout


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_compare_of_different_workloads_is_not_comparable_and_says_why(two_bundles, tmp_path):
    _, work, (a, b) = two_bundles
    other = tmp_path / b.name
    shutil.copytree(b, other)
    plan = json.loads((other / "plan.json").read_text())
    plan["config"]["workload"]["output_len"] = 3
    plan["prompts"]["sha256"] = "0" * 64
    (other / "plan.json").write_text(json.dumps(plan))
    proc = loopbench(work, "compare", str(a), str(other))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "not comparable" in proc.stdout
    assert "config.workload.output_len: 2 vs 3" in proc.stdout and "prompts.sha256:" in proc.stdout
    assert "| 2 / 2 |" not in proc.stdout


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_show_a_bundle_and_show_all(two_bundles, tmp_path):
    _, work, (a, b) = two_bundles
    proc = loopbench(work, "show", str(a))
    assert proc.returncode == 0, proc.stderr
    assert "| CPU | 2 / 2 |" in proc.stdout and "status: complete" in proc.stdout and "audit pass" in proc.stdout
    proc = loopbench(work, "show", "--all", "--results", str(a.parent))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [a.name, b.name]
    assert all("cli  model tiny  complete (audit pass)" in line and "native_vs_alias_prefix B2C2 " in line
               for line in lines), lines


def test_show_of_an_online_bundle_gives_the_online_line_bench_printed(capsys):
    """bench prints the online track's line after the status line (online.report.status_line); show does too."""
    assert cli.main(["show", str(REPO / "results" / "2026-12-06-ouro-1.4b-online-e87ddf11")]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = next(i for i, line in enumerate(lines) if line.startswith("status: "))
    assert lines[status + 1] == ("online: complete, 3 of 3 runs, capacity 15.0030 requests/s; served tokens equal "
                                 "the frozen reference; 0 failed requests"), lines
    assert cli.main(["show", str(REPO / "results" / "2026-12-06-ouro-1.4b-7a9bcca8")]) == 0
    assert "online:" not in capsys.readouterr().out


def test_show_all_lists_every_committed_bundle(capsys):
    assert cli.main(["show", "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plans = {p.name: json.loads((p / "plan.json").read_text()) for p in (REPO / "results").iterdir()
             if (p / "plan.json").is_file()}
    bundles = sorted(plans, key=lambda name: (plans[name]["created_utc"], name))   # oldest first, one clock (UTC)
    assert [line.split()[0] for line in lines] == bundles    # with any a local `make bench` added
    gpu = [line for line in lines if "-ouro-1.4b-" in line.split()[0]]
    assert len(gpu) >= 4 and all("complete (audit pass)" in line and re.search(r" B16C\d+\S* [01]\.\d{4}x", line)
                                 for line in gpu), gpu   # the context bundle's points are B16C16P<P>D64


def test_show_compare_and_audit_refuse_what_is_no_bundle_in_one_wording_and_write_nothing(tmp_path, capsys):
    folder, missing = tmp_path / "notes", tmp_path / "none"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a bundle")
    bundle = str(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c")
    refusals = ((missing, f"no bundle folder at {missing}"), (folder, f"{folder} is not a bundle (no plan.json)"))
    for path, words in refusals:
        said = set()
        for command, *args in (("audit", path), ("show", path), ("compare", path, bundle), ("compare", bundle, path)):
            assert cli.main([command, *map(str, args)]) == 2, (command, args)
            out, err = capsys.readouterr()
            assert out == "" and err.startswith(f"loopbench {command}: "), (command, out, err)
            said.add(err.removeprefix(f"loopbench {command}: "))
        assert len(said) == 1 and words in said.pop(), said
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes", "notes.txt"]
    assert cli.main(["show"]) == 2


def test_audit_and_finish_refuse_a_folder_that_is_no_bundle_and_write_nothing_there(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a bundle")
    for command in ("audit", "finish"):
        assert cli.main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path} is not a bundle (no plan.json)" in err and "delete" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "the auditor wrote into a non-bundle folder"


def test_finish_refuses_a_bundle_that_other_code_measured_and_changes_nothing(tmp_path, capsys):
    """The publisher writes its own code's summary, report and format version; the committed cpu-smoke bundle
    was measured by older code (another code_sha256), so finishing it here is refused, naming both."""
    plan = json.loads((REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c" / "plan.json").read_text())
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert cli.main(["finish", str(tmp_path)]) == 1      # as a bundle published already: finish refused
    err = capsys.readouterr().err
    assert f"{tmp_path} was measured by other code (git {plan['code']['git_sha']}, code_sha256 " \
           f"{plan['code']['code_sha256'][:12]})" in err and "run finish from a checkout of that commit" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("plan, named", [([], "plan.json is [], not an object"),
                                         ({"code": "x"}, "plan.json's code is 'x', not an object")])
def test_finish_refuses_a_plan_that_names_no_code_naming_it_not_a_traceback(tmp_path, capsys, plan, named):
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert cli.main(["finish", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path}/{named}: it does not say which code measured it" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_finish_names_a_damaged_plan_or_a_missing_environment_not_a_traceback(tmp_path, capsys):
    from loopbench.harness.identity import code_identity

    (tmp_path / "plan.json").write_text('{"code": ')                 # a controller killed mid-write
    assert cli.main(["finish", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'plan.json'} cannot be read (JSONDecodeError: " in err and "Traceback" not in err, err
    (tmp_path / "plan.json").write_text(json.dumps({"code": code_identity()}))     # this code's, no environment
    assert cli.main(["finish", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'environment.json'} cannot be read (FileNotFoundError: " in err and "damaged" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_an_unpublished_bundle_is_incomplete_to_audit_show_and_compare_alike_and_each_names_finish(tmp_path, capsys):
    """Exit 3 (incomplete), as the README's exit statuses define it, from every command that reads a published
    bundle; a path that is no bundle at all still gives 2 (usage), named first."""
    bundle = str(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c")
    shutil.copy(Path(bundle) / "plan.json", tmp_path / "plan.json")
    said = set()
    for command, *args in (("audit", tmp_path), ("show", tmp_path), ("compare", tmp_path, bundle),
                           ("compare", bundle, tmp_path)):
        assert cli.main([command, *map(str, args)]) == 3, (command, args)
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"loopbench {command}: "), (command, out, err)
        said.add(err.removeprefix(f"loopbench {command}: ").replace(f"nothing to {command} yet", "nothing to X yet"))
    assert len(said) == 1, said
    err = said.pop()
    assert f"{tmp_path} is not published (no manifest.json)" in err and f"loopbench finish {tmp_path}" in err, err
    assert cli.main(["compare", str(tmp_path), str(tmp_path / "none")]) == 2
    assert f"no bundle folder at {tmp_path / 'none'}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_show_and_compare_name_a_bundle_whose_files_changed_since_it_was_published(tmp_path, capsys):
    """audit.json is the verdict on the files as published; an edited table must not pass as audited evidence."""
    committed = REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c"
    edited = tmp_path / "edited"
    shutil.copytree(committed, edited)
    with open(edited / "report.md", "a") as f:
        f.write("\nfaster\n")
    assert cli.main(["show", str(edited)]) == 0
    out = capsys.readouterr().out
    assert f"audit pass, but its files changed since (report.md changed): `loopbench audit {edited}`" in out, out
    assert cli.main(["compare", str(committed), str(edited)]) == 0     # comparable; its rows withheld
    out = capsys.readouterr().out
    assert "warning: B no longer matches its manifest.json (report.md changed), so its figures may not be the " \
           "ones published" in out, out
    assert "; B changed since published;" in out, out
    cli.main(["show", str(committed)])
    assert "changed since" not in capsys.readouterr().out
    manifest = json.loads((edited / "manifest.json").read_text())
    (edited / "manifest.json").write_text(json.dumps({**manifest, "files": {"../outside": {"sha256": "0"}}}))
    (edited / "audit.json").unlink()
    assert cli.main(["show", str(edited)]) == 0
    assert "; not audited, but its files changed since (manifest.json lists ../outside, outside the bundle)" in \
        capsys.readouterr().out
    (edited / "manifest.json").write_text("{")      # damaged: still shown, named, never a traceback
    assert cli.main(["show", str(edited)]) == 0
    assert "but its files changed since (manifest.json is damaged)" in capsys.readouterr().out


def test_show_of_an_edited_bundle_whose_audit_failed_names_the_audit_not_a_later_change(tmp_path, capsys):
    """An audit run on the edited files failed: show says so and where, not that the files changed since the audit."""
    edited = tmp_path / "edited"
    shutil.copytree(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c", edited)
    record = sorted((edited / "raw").glob("*/00001-*.json"))[0]
    rel = record.relative_to(edited).as_posix()
    record.write_text(record.read_text().replace('"seq": 1', '"seq": 1 '))
    assert cli.main(["audit", str(edited)]) == 1
    capsys.readouterr()
    found = json.loads((edited / "audit.json").read_text())["discrepancies"]
    assert cli.main(["show", str(edited)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "changed since" not in first and "checks them again" not in first, first
    assert found[0].startswith(f"manifest: {rel} changed: sha256 "), found
    noun = "discrepancy" if len(found) == 1 else "discrepancies"
    assert f"; audit fail ({len(found)} {noun}, the first: manifest: {rel} changed: sha256 " in first, first
    assert first.endswith(f"; its files no longer match its manifest.json ({rel} changed)"), first


def test_show_words_each_committed_bundle_as_its_own_report_does(capsys):
    """An old bundle keeps its own wording (format 6: GPU, native tokens/s, Throughput change): show's result tables
    are its report.md's, line for line, for every committed bundle."""
    bundles = sorted(p for p in (REPO / "results").glob("2026-*") if (p / "manifest.json").is_file())
    assert any(p.name == "2026-12-01-ouro-1.4b-natural-b0940b1" for p in bundles)
    for bundle in bundles:
        assert cli.main(["show", str(bundle)]) == 0, bundle
        out = capsys.readouterr().out.splitlines()
        tables = [line for line in out[out.index("") + 1:] if line.startswith(("### ", "|"))]
        report = (bundle / "report.md").read_text().splitlines()
        assert tables and all(line in report for line in tables), (bundle.name, [x for x in tables if x not in report])
    natural = next(p for p in bundles if p.name == "2026-12-01-ouro-1.4b-natural-b0940b1")
    cli.main(["show", str(natural)])
    assert "| GPU | B / C | P / D | native tokens/s | alias_prefix tokens/s | Paired speedup [95% CI] | Throughput " \
           "change | Verdict |" in capsys.readouterr().out


def test_show_all_words_an_unpublished_unaudited_bundle_once(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    shutil.copy(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c" / "plan.json", tmp_path / "b" / "plan.json")
    assert cli.main(["show", "--all", "--results", str(tmp_path)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("b  ")]
    assert len(line) == 1 and " unpublished (not audited) " in line[0], line


def test_an_unpublished_bundle_a_controller_holds_is_named_as_being_measured_not_as_finishable(tmp_path, capsys):
    """While a run or a resume measures a bundle (its controller holds the folder's lock), show and audit say so
    instead of advising `finish`, which would refuse it."""
    from loopbench.harness.fileio import try_lock

    shutil.copy(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c" / "plan.json", tmp_path / "plan.json")
    lock = try_lock(tmp_path)
    try:
        for command in ("show", "audit"):
            assert cli.main([command, str(tmp_path)]) == 3
            err = capsys.readouterr().err
            assert err.strip() == (f"loopbench {command}: {tmp_path} is not published (no manifest.json): nothing to "
                                   f"{command} yet; a controller is measuring it now (a run or a resume), and "
                                   "publishes it when it ends"), err
    finally:
        os.close(lock)
    assert cli.main(["show", str(tmp_path)]) == 3
    assert f"loopbench finish {tmp_path}" in capsys.readouterr().err


def test_show_of_a_folder_of_bundles_points_to_show_all(tmp_path, capsys):
    """`loopbench show results` (the results folder, not a bundle in it): usage, naming `show --all`."""
    (tmp_path / "b").mkdir()
    shutil.copy(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c" / "plan.json", tmp_path / "b" / "plan.json")
    assert cli.main(["show", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"loopbench show: {tmp_path} is not a bundle (no plan.json); it holds "
                                               f"bundles: `loopbench show --all --results {tmp_path}` lists them")


def test_show_renders_every_committed_bundle_whatever_its_format(capsys):
    bundles = sorted(p for p in (REPO / "results").iterdir() if (p / "summary.json").is_file())
    assert len(bundles) >= 14
    for bundle in bundles:
        assert cli.main(["show", str(bundle)]) == 0, bundle
        out, err = capsys.readouterr()
        assert out.startswith(f"{bundle.name} (code ") and "\nstatus: " in out and err == "", (bundle, err)


def test_show_words_the_sentences_of_an_incomplete_format_1_bundle(tmp_path, capsys):
    """A format-1 summary's incomplete reasons are English sentences (loopbench/bundle_format.json versions), not
    the status codes that report.md words: show gives them as they are, where it once raised a traceback."""
    src = REPO / "results" / "2026-12-01-ouro-1.4b-e4b8faf"     # manifest layout_version 1: bundle format 1
    assert json.loads((src / "manifest.json").read_text()).get("format_version") is None
    bundle = tmp_path / src.name
    (bundle / "tables").mkdir(parents=True)
    for name in ("plan.json", "manifest.json", "tables/arms.parquet"):
        shutil.copy(src / name, bundle / name)
    summary = json.loads((src / "summary.json").read_text())
    reason = "child cuda0 ended interrupted with exit code -15"
    (bundle / "summary.json").write_text(json.dumps({**summary, "status": "incomplete", "incomplete_reasons": [reason],
                                                     "verdicts_published": False}))
    assert cli.main(["show", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert f"\nstatus: incomplete ({reason}); checks passed; verdicts barred\n" in out, out
    del summary["verdicts_published"]      # the field compare.withheld allows an old summary to lack
    (bundle / "summary.json").write_text(json.dumps(summary))
    assert cli.main(["show", str(bundle)]) == 0
    assert "\nstatus: complete; checks passed; verdicts not recorded\n" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """`loopbench show --all | head -1`: the pipe's reader leaves before the output is written."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "loopbench", "show", "--all"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                 # before the command has imported anything, let alone printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_show_of_both_and_compare_of_one_bundle_with_itself_say_so(capsys):
    a = str(REPO / "results" / "2026-12-01-ouro-1.4b-c16d2c0")
    assert cli.main(["show", "--all", a]) == 2
    assert "give a BUNDLE or --all, not both" in capsys.readouterr().err
    assert cli.main(["compare", a, a]) == 0
    assert "A and B are the same bundle" in capsys.readouterr().err


def test_compare_names_its_level_from_the_config_or_the_flag_and_refuses_a_bad_one(capsys):
    a, b = (str(REPO / "results" / n) for n in ("2026-11-30-ouro-1.4b-nogit", "2026-12-01-ouro-1.4b-c16d2c0"))
    assert cli.main(["compare", a, b, "--confidence", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "change [90% interval]" in out and "a 90% percentile bootstrap interval" in out and "95%" not in out
    assert cli.main(["compare", a, b, "--confidence", "95"]) == 2
    assert "--confidence 95.0 is not a level between 0 and 1" in capsys.readouterr().err


def test_show_all_marks_the_speedups_of_a_bundle_whose_verdicts_are_barred(tmp_path, capsys):
    from loopbench.harness import compare
    src = REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c"
    bundle = tmp_path / src.name
    bundle.mkdir()
    for name in ("plan.json", "summary.json", "audit.json"):
        shutil.copy(src / name, bundle / name)
    published = compare.bundle_line(bundle)
    assert "no verdicts" not in published and re.search(r" [01]\.\d{4}x", published)
    summary = json.loads((bundle / "summary.json").read_text())
    summary.update(status="incomplete", verdicts_published=False, verdicts_barred_by="run incomplete")   # a string
    (bundle / "summary.json").write_text(json.dumps(summary))
    line = compare.bundle_line(bundle)
    assert "incomplete (audit " in line and "no verdicts (run incomplete); measured, not evidence: " in line


def _copy_bundle(dst: Path, src: Path = REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c") -> Path:
    """A committed bundle copied to ``dst`` whole (show and compare check its files against its manifest)."""
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name, text, words", [
    ("plan.json", '{"name": "cpu-sm', "plan.json is not valid JSON (Unterminated string starting at: line 1 column 10"),
    ("plan.json", "", "plan.json is not valid JSON (Expecting value: line 1 column 1 (char 0)); the bundle is damaged"),
    ("plan.json", "[]", "plan.json holds a JSON list, not an object; the bundle is damaged"),        # was a traceback
    ("summary.json", "[1]", "summary.json holds a JSON list, not an object; the bundle is damaged"),  # was a traceback
])
def test_show_and_compare_name_the_damaged_document_of_a_bundle(tmp_path, capsys, name, text, words):
    """Once the decoder's bare "Expecting value: line 1 column 1 (char 0)", naming no file, or a traceback."""
    good, bad = _copy_bundle(tmp_path / "good"), _copy_bundle(tmp_path / "bad")
    (bad / name).write_text(text)
    for command, *args in (("show", bad), ("compare", good, bad), ("compare", bad, good)):
        assert cli.main([command, *map(str, args)]) == 2, (command, args)
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"loopbench {command}: {bad / name} ") and words in err, err
        assert len(err.splitlines()) == 1, err


def test_show_and_compare_name_a_bundle_whose_document_lacks_a_field(tmp_path, capsys):
    good, bad = _copy_bundle(tmp_path / "good"), _copy_bundle(tmp_path / "bad")
    plan = json.loads((bad / "plan.json").read_text())
    del plan["code"]
    (bad / "plan.json").write_text(json.dumps(plan))
    assert cli.main(["show", str(bad)]) == 2
    assert capsys.readouterr().err == (f"loopbench show: cannot read {bad}: a document lacks or mistypes a field "
                                       "(KeyError: 'code'); `loopbench audit BUNDLE` names what is wrong\n")
    assert cli.main(["compare", str(good), str(bad)]) == 2
    assert f"loopbench compare: cannot read {good} or {bad}: " in capsys.readouterr().err


def test_show_survives_a_damaged_audit_json(tmp_path, capsys):
    bundle = _copy_bundle(tmp_path / "b")
    (bundle / "audit.json").write_text("{")
    assert cli.main(["show", str(bundle)]) == 0
    assert "; audit unreadable (audit.json is damaged; loopbench audit writes it again)\n" in capsys.readouterr().out


def test_show_all_gives_a_damaged_bundle_its_own_line_and_lists_the_rest(tmp_path, capsys):
    """One truncated summary.json once made `show --all` a traceback that listed nothing."""
    for name, doc, text in (("a-good", None, None), ("b-summary", "summary.json", "{"), ("c-plan", "plan.json", "[]"),
                            ("d-audit", "audit.json", "nul"), ("e-field", "summary.json", '{"results": []}')):
        bundle = _copy_bundle(tmp_path / name)
        if doc:
            (bundle / doc).write_text(text)
    assert cli.main(["show", "--all", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # oldest first: a plan that cannot be read has no creation time and comes first, the copies by name
    assert [line.split()[0].rstrip(":") for line in lines] == ["c-plan", "a-good", "b-summary", "d-audit", "e-field"]
    assert "complete (audit pass)" in lines[1]
    assert [lines[0], *lines[2:4]] == ["c-plan: unreadable plan.json (ValueError)",
                                       "b-summary: unreadable summary.json (ValueError)",
                                       "d-audit: unreadable audit.json (ValueError)"]
    assert lines[4] == "e-field: damaged bundle (KeyError: 'status'); loopbench audit names what is wrong"


def test_a_bundle_with_a_summary_but_no_manifest_is_unpublished_to_every_command(tmp_path, capsys):
    """Publishing writes the manifest last and a resume removes it first (evidence.finalize, unpublish): a summary
    without one is a publication cut short, which `finish` completes. audit once audited it (exit 1, with the
    discrepancies of a bundle of unknown format), show and compare read it as published."""
    bundle = _copy_bundle(tmp_path / "b")
    (bundle / "manifest.json").unlink()
    other = str(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c")
    for command, *args in (("audit", bundle), ("show", bundle), ("compare", bundle, other), ("compare", other, bundle)):
        assert cli.main([command, *map(str, args)]) == 3, (command, args)
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"loopbench {command}: {bundle} is not published (no manifest.json)"), err
        assert f"`loopbench finish {bundle}` publishes it" in err, err


def test_a_published_bundle_without_its_summary_is_damaged_not_unpublished(tmp_path, capsys):
    """show once said "not a published bundle", and its finish hint led to finish's "published already"."""
    bundle = _copy_bundle(tmp_path / "b")
    (bundle / "summary.json").unlink()
    assert cli.main(["show", str(bundle)]) == 2
    assert capsys.readouterr().err == (f"loopbench show: {bundle} is damaged: published (a manifest.json) but without "
                                       f"summary.json; `loopbench audit {bundle}` names what is wrong\n")


@pytest.mark.slow      # two_bundles: a sweep of two bundles, about 25 s on 2 cores
def test_plan_estimates_past_a_damaged_bundle_and_does_not_blame_the_configuration(two_bundles, tmp_path,
                                                                                   monkeypatch, capsys):
    """A damaged bundle created last in results_dir once failed `plan` as "bad configuration: list indices must be
    integers or slices, not str", exit 2."""
    _, _, (a, _) = two_bundles
    results = tmp_path / "r"
    shutil.copytree(a, results / "a-good")
    for name, text in (("b-list", "[]"), ("c-nodevices", None)):
        shutil.copytree(a, results / name)
        plan = json.loads((results / name / "plan.json").read_text())
        plan["created_utc"] = "2099-01-01T00:00:00+00:00"
        del plan["devices"]
        (results / name / "plan.json").write_text(text if text is not None else json.dumps(plan))
    (results / "b-list" / "summary.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", *TINY, f"results_dir={results}", f"cache_dir={a.parent.parent / 'c'}"]) == 0
    assert "audit; from a-good" in capsys.readouterr().out


# A SIGTERM the command sends itself at one moment: while its parser is built (the first 0.2 s of `loopbench bench`,
# before any stage installed a handler), while bench picks the preset (between the library imports and the checks),
# while plan reads the results folder for its estimate (no stage's handler: plan changes nothing)
_SELF_SIGTERM = """
import os, signal, sys
from loopbench.harness import cli, planning
target, name = {target}
real = getattr(target, name)
def stopped(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)
setattr(target, name, stopped)
sys.exit(cli.main({argv!r}))
"""


@pytest.mark.parametrize("command, target", [("bench", "cli, 'build_parser'"), ("bench", "cli, '_preset'"),
                                             ("plan", "planning, 'plan_text'")])
def test_a_sigterm_before_any_stage_handles_it_is_one_line_and_exit_3(tmp_path, command, target):
    """It killed the command with status 143 and no word (the shell's 128 + 15), as Ctrl-C there does not."""
    argv = ["-q", command, *TINY, f"results_dir={tmp_path / 'r'}", f"cache_dir={tmp_path / 'c'}"]
    code = _SELF_SIGTERM.format(target=target, argv=argv)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert run.returncode == 3 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    assert run.stderr.strip().splitlines() == ["loopbench: interrupted"], run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stop_while_finish_publishes_says_to_run_finish_again(tmp_path, monkeypatch, capsys):
    """It said only "loopbench: interrupted", leaving a half-written bundle (a summary, no manifest) without a word of
    what to do; finish completes such a bundle when run again."""
    from loopbench.harness import resume

    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "plan.json").write_text("{}")

    def stopped(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(resume, "finish", stopped)
    assert cli.main(["finish", str(bundle)]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"loopbench finish: interrupted before {bundle} was published; nothing measured was lost: run "
        f"`loopbench finish {bundle}` again"], err


def test_plan_words_counts_in_their_number_and_says_what_a_resume_estimate_is_for():
    """'1 balanced pair(s)' in the online line; a resume with no arms left estimated 'measuring the arms left'."""
    from loopbench.harness import compare, planning

    assert ", 1 balanced pair at each of " in planning.plan_text("cpu-online", ["online.pairs=1"])
    assert ", 2 balanced pairs at each of " in planning.plan_text("cpu-online", ["online.pairs=2"])
    spec = conf.validate(conf.compose("cpu-smoke", []))
    earlier = compare.Bundle.load(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c")
    line = planning._estimate_line(spec, [], earlier, resuming=True)
    assert "arms left, plus" not in line and " for a session with no arms left to measure (one session's cost beyond " \
        "its arms in 2026-12-01-cpu-smoke-0b0b425c: model load, engine builds and whatever it ran besides, such as the " \
        "online track's runs), plus set-up and audit" in line, line


def test_a_refused_resume_in_a_sweep_names_the_job(tmp_path, capsys):
    """plan -m resume=...: the refusal said 'cannot resume ...' without the job, where the sweep's other refusals say
    'in sweep job N of M (...)'."""
    bundle = tmp_path / "b"
    shutil.copytree(REPO / "results" / "2026-12-01-cpu-smoke-0b0b425c", bundle)
    assert cli.main(["plan", "--config-name", "cpu-smoke", "-m", "order_seed=0,1", f"resume={bundle}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopbench: bad configuration in sweep job 1 of 2 (order_seed=0): resume = "), err
    assert "a complete bundle cannot be resumed" in err, err


def test_a_sweep_prints_no_hydra_log_lines(tmp_path):
    """'[...][HYDRA] Launching 2 jobs locally' and '#1 : pairs=4 ...' reached stdout: the presets set
    hydra/hydra_logging to none, so only loopbench's own lines appear. Each job fails at once (/proc takes no folder),
    after Hydra launched both."""
    run = loopbench(tmp_path, "bench", "--config-name", "cpu-smoke", "-m", "pairs=3,4", "results_dir=/proc/lb",
                    f"cache_dir={tmp_path / 'cache'}")
    assert run.returncode == 2, run.stderr
    assert "loopbench: sweep: job 2 of 2" in run.stderr, run.stderr    # Hydra ran both jobs
    assert "HYDRA" not in run.stdout + run.stderr and "#1 : " not in run.stdout, run.stdout
