"""A bad config value through the ``loopbench`` command: one line naming the key and the value as the user wrote it,
exit 2, before anything is measured or written. Here the values that composition used to take silently: a switch
(a bool key) written as a number or a word (``warmup=2`` ran with warmups on)."""
import shutil

import pytest
from omegaconf import OmegaConf

from loopbench.harness import cli, conf, rules

BAD = "loopbench: bad configuration: "


def _run(tmp_path, monkeypatch, capsys, command: str, preset: str, *args: str, files: dict | None = None):
    """``loopbench -q COMMAND --config-name PRESET ARGS`` in an empty folder, over a copy of configs/ with ``files``
    ({name: YAML text}) added; (exit code, stdout, stderr), once checked that nothing was written beside the copy."""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    for name, text in (files or {}).items():
        (configs / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-q", command, "--config-name", preset, f"results_dir={tmp_path / 'r'}",
                   f"cache_dir={tmp_path / 'c'}", *args])
    out, err = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]
    return rc, out, err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("override, line", [
    ("warmup=2", "warmup must be true or false, got 2"),
    ("warmup=0", "warmup must be true or false, got 0"),
    ("warmup=yes", "warmup must be true or false, got 'yes'"),
    ("reuse_references=5", "reuse_references must be true or false, got 5"),
    ("arms.alias_prefix.prefix_tiles=2", "arms.alias_prefix.prefix_tiles must be true or false, got 2"),
    ("arms.native={kv_layout:native,cuda_graphs:0}", "arms.native.cuda_graphs must be true or false, got 0"),
    ("+arms={naive:{kv_layout:alias,prefix_tiles:1}}", "arms.naive.prefix_tiles must be true or false, got 1"),
])
def test_a_switch_set_to_anything_but_true_or_false_is_refused(tmp_path, monkeypatch, capsys, command, override, line):
    """OmegaConf turns any int and words such as yes into a bool: `warmup=2` ran with warmups, `warmup=0` without."""
    rc, out, err = _run(tmp_path, monkeypatch, capsys, command, "cpu-smoke", override)
    assert rc == 2 and out == "" and err.splitlines() == [BAD + line], err


def test_a_switch_in_a_preset_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    files = {"mine": "defaults:\n  - cpu-smoke\n  - _self_\nname: mine\nwarmup: 2\n"}
    rc, out, err = _run(tmp_path, monkeypatch, capsys, "plan", "mine", files=files)
    assert rc == 2 and out == "" and err.splitlines() == [BAD + "warmup in configs/mine.yaml must be true or false, "
                                                                "got 2"], err


def test_a_sweep_names_the_job_whose_switch_is_bad(tmp_path, monkeypatch, capsys):
    rc, out, err = _run(tmp_path, monkeypatch, capsys, "plan", "cpu-smoke", "-m", "warmup=true,2")
    assert rc == 2 and out == "", err
    assert err.splitlines() == ["loopbench: bad configuration in sweep job 2 of 2 (warmup=2): warmup must be true or "
                                "false, got 2"], err


@pytest.mark.parametrize("override, value", [("warmup=false", False), ("warmup=True", True),
                                             ("arms.native.cuda_graphs=false", False)])
def test_true_and_false_still_set_a_switch(override, value):
    key = override.split("=")[0]
    assert OmegaConf.select(conf.compose("cpu-smoke", [override]), key) is value


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("overrides, words", [
    (["pairs=100000"], "pairs x sessions = 100000 x 1 = 100000 pairs per comparison and device, more than the 1000 "),
    (["pairs=400", "sessions=3"], "pairs x sessions = 400 x 3 = 1200 pairs per comparison and device, more than "),
    (["verdict.n_resamples=1000000000"], "verdict.n_resamples = 1000000000 resamples of 3 pairs per comparison hold "
                                         "3,000,000,000 values at once, more than 100,000,000 "),
])
def test_a_sample_too_large_to_publish_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys, command,
                                                                              overrides, words):
    """pairs=100000 was planned and run: days of measuring, then an exact signed-rank p per result that takes days
    more (minutes already at 5,000 pairs) and a bootstrap that holds every resample at once, in the publisher and
    again in the auditor."""
    rc, out, err = _run(tmp_path, monkeypatch, capsys, command, "cpu-smoke", *overrides)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith(BAD + words), err


@pytest.mark.parametrize("overrides", [[f"pairs={rules.MAX_PAIRS_PER_COMPARISON}"],
                                       [f"pairs={rules.MAX_PAIRS_PER_COMPARISON // 4}", "sessions=4"],
                                       [f"verdict.n_resamples={rules.MAX_RESAMPLED_VALUES // 3}"]])
def test_a_sample_at_the_bounds_is_valid(overrides):
    spec = conf.validate(conf.compose("cpu-smoke", overrides))
    assert spec.pairs * spec.sessions <= rules.MAX_PAIRS_PER_COMPARISON
    assert spec.verdict.n_resamples * spec.pairs * spec.sessions <= rules.MAX_RESAMPLED_VALUES
