"""A misspelt config key, through the ``loopbench`` command: one line naming the key by its dotted path as the
user wrote it, with the closest key (or the keys of its level), exit 2, nothing written; never the schema's
class names nor Hydra's "To append to your config use +key=" advice. The key may be misspelt in an override
(plain, ``+``, ``++``, ``~``, inside a value, a list item by dot or by brackets), in a preset's YAML, or in a
preset that preset extends. An override into a node that is null in the preset (``online.num_requests=3``
under ``online: null``) is refused the same way, with what to do instead, never with OmegaConf's traceback."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loopbench.harness import cli, conf

REPO = Path(__file__).resolve().parents[2]
BAD = "loopbench: bad configuration: "
IN_SMOKE = "loopbench: bad configuration in configs/cpu-smoke.yaml: "
ONLINE_NULL = ("online is null in preset cpu-smoke; an override cannot fill a null section, not online={...} either; "
               "use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one of your own in "
               "configs/")


def _refusal(tmp_path, monkeypatch, capsys, command: str, *args: str) -> str:
    """The stderr of a refused ``loopbench -q COMMAND --config-name cpu-smoke ARGS`` run in an empty folder,
    once its exit status, its empty stdout and the empty folder are checked."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = cli.main(["-q", command, "--config-name", "cpu-smoke", f"results_dir={work / 'r'}",
                   f"cache_dir={work / 'c'}", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert list(work.iterdir()) == []
    return err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("override, line", [
    ("exit.treshold=0.6", "unknown config key exit.treshold; did you mean exit.threshold?"),
    ("arms.native.kv_layot=alias", "unknown config key arms.native.kv_layot; did you mean arms.native.kv_layout?"),
    ("workload.prompt_length=64", "unknown config key workload.prompt_length; did you mean workload.prompt_len?"),
    ("+exit.treshold=0.6", "unknown config key exit.treshold; did you mean exit.threshold?"),    # composes; validate
    ("~exit.treshold", "unknown config key exit.treshold; did you mean exit.threshold?"),
    ("exti.threshold=0.6", "unknown config key exti.threshold; did you mean exit.threshold?"),
    ("points.0.max_num_seq=3", "unknown config key points.0.max_num_seq; did you mean points.0.max_num_seqs?"),
    ("exit={treshold:0.6}", "unknown config key exit.treshold; did you mean exit.threshold?"),
    ("comparisons=[{baseline:native,candidat:alias}]",
     "unknown config key comparisons.0.candidat; did you mean comparisons.0.candidate?"),
    ("comparisons.0.candidat=alias",
     "unknown config key comparisons.0.candidat; did you mean comparisons.0.candidate?"),
    # brackets, as our value messages name an item: Hydra's lexer refuses them; named as the dotted key is
    ("comparisons[0].candidat=alias",
     "unknown config key comparisons.0.candidat; did you mean comparisons.0.candidate?"),
    ("+points[0].max_num_seq=3", "unknown config key points.0.max_num_seq; did you mean points.0.max_num_seqs?"),
    ("online.num_request=3", "unknown config key online.num_request; did you mean online.num_requests?"),  # online: null
    ("exit.zzz=1", "unknown config key exit.zzz; exit has max_loops, min_loops, policy, threshold"),
    ("zzz=1", "unknown config key zzz; the top level has arms, cache_dir, comparisons, evidence, executor, exit, "),
])
def test_a_misspelt_override_is_one_line_with_the_closest_key(tmp_path, monkeypatch, capsys, command, override, line):
    err = _refusal(tmp_path, monkeypatch, capsys, command, override)
    assert len(err.splitlines()) == 1 and err.startswith(BAD + line), err
    assert "Conf" not in err and "+" not in err.replace(override, ""), err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("override, line", [
    ("online.num_requests=3", "cannot apply online.num_requests=3: " + ONLINE_NULL),
    ("+online.num_requests=3", "cannot apply +online.num_requests=3: " + ONLINE_NULL),
    ("online.rates=[1.0]", "cannot apply online.rates=[1.0]: " + ONLINE_NULL),
    ("online={num_requests:3}", "cannot apply online={num_requests:3}: " + ONLINE_NULL),   # whole: no better
    ("online={}", "cannot apply online={}: " + ONLINE_NULL),        # composes, but to no online track
    ("executor.gpus.0=1", "cannot apply executor.gpus.0=1: executor.gpus is null in preset cpu-smoke; set it whole "
                          "(executor.gpus=[...])"),
    ("comparisons.7.candidate=alias", "cannot apply comparisons.7.candidate=alias: comparisons has items 0-2, not 7; "
                                      "to add items, set it whole (comparisons=[...])"),
    ("comparisons[0].candidate=alias",
     "comparisons[0].candidate=alias: an override names a list item by a dot, not brackets: "
     "comparisons.0.candidate=alias"),
])
def test_a_valid_key_hydra_cannot_apply_is_one_line_that_says_what_to_do(tmp_path, monkeypatch, capsys, command,
                                                                         override, line):
    err = _refusal(tmp_path, monkeypatch, capsys, command, override)
    assert err.splitlines() == [BAD + line], err


@pytest.mark.parametrize("preset, edit, line", [
    ("cpu-smoke", ("threshold: 0.55", "treshold: 0.55"),
     "unknown config key exit.treshold in configs/cpu-smoke.yaml; did you mean exit.threshold?"),
    ("cpu-smoke", ("- {max_num_seqs: 3,", "- {max_num_seq: 3,"),
     "unknown config key points.0.max_num_seq in configs/cpu-smoke.yaml; did you mean points.0.max_num_seqs?"),
    ("cpu-smoke", ("native: {kv_layout: native,", "native: {kv_layot: native,"),
     "unknown config key arms.native.kv_layot in configs/cpu-smoke.yaml; did you mean arms.native.kv_layout?"),
    ("cpu-context", ("threshold: 0.55", "treshold: 0.55"),   # in the preset cpu-context extends
     "unknown config key exit.treshold in configs/cpu-smoke.yaml; did you mean exit.threshold?"),
])
def test_a_misspelt_key_in_a_preset_names_its_file(tmp_path, monkeypatch, capsys, preset, edit, line):
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    text = (configs / "cpu-smoke.yaml").read_text()
    assert text.count(edit[0]) == 1
    (configs / "cpu-smoke.yaml").write_text(text.replace(*edit))
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", preset]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [BAD + line], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


@pytest.mark.parametrize("setting, line", [
    ("points: {max_num_seqs: 3, num_requests: 5}",
     "points in configs/mine.yaml must be a list, got {'max_num_seqs': 3, 'num_requests': 5}"),
    ("exit: 5", "exit in configs/mine.yaml must be a mapping of keys, got 5"),
    ("exit: [1, 2]", "exit in configs/mine.yaml must be a mapping of keys, got [1, 2]"),
    ("arms: {native: [1]}", "arms.native in configs/mine.yaml must be a mapping of keys, got [1]"),
    ("workload: {prompt_lens: {a: 1}}", "workload.prompt_lens in configs/mine.yaml must be a list, got {'a': 1}"),
])
def test_a_list_or_section_of_the_wrong_kind_in_a_preset_names_its_key_and_file(tmp_path, monkeypatch, capsys,
                                                                                 setting, line):
    """Hydra refuses a mapping where a list belongs (and the like) while it merges a preset, in words whose key is
    empty and that name no file: `In 'mine': ConfigTypeError raised while composing config: Cannot merge DictConfig
    with ListConfig full_key:`."""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    (configs / "mine.yaml").write_text(f"defaults: [cpu-smoke, _self_]\nname: mine\n{setting}\n")
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", "mine"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [BAD + line], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_a_misspelt_key_in_a_preset_with_its_own_sweep_is_not_blamed_on_a_job(tmp_path, monkeypatch, capsys,
                                                                             command):
    """A preset that does not compose has no sweep to read: -m named its error 'sweep job 1 of 1 ()', one job of a
    sweep that declares two, and no override. The error is the preset's, named as a run without -m names it."""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    (configs / "my-sweep.yaml").write_text("defaults:\n  - cpu-smoke\n  - _self_\nname: my-sweep\npair: 6\n"
                                           "hydra:\n  sweeper:\n    params:\n      order_seed: 0,1\n")
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", command, "--config-name", "my-sweep", "-m"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        BAD + "unknown config key pair in configs/my-sweep.yaml; did you mean pairs?"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


@pytest.mark.parametrize("preset, overrides, line", [
    ("cpu-smoke", [], IN_SMOKE + "exit.threshold must be in (0, 1], got 1.5"),
    ("cpu-smoke", ["pairs=4"], IN_SMOKE + "exit.threshold must be in (0, 1], got 1.5"),
    # the value lies in the preset cpu-context extends
    ("cpu-context", [], IN_SMOKE + "exit.threshold must be in (0, 1], got 1.5"),
    # an override's own bad value: the user has it in front of them, and no preset holds it
    ("cpu-smoke", ["exit.threshold=2"], BAD + "exit.threshold must be in (0, 1], got 2.0"),
    ("cpu-smoke", ["-m"], IN_SMOKE + "exit.threshold must be in (0, 1], got 1.5"),   # no job to name
    ("cpu-smoke", ["-m", "pairs=4,5"], "loopbench: bad configuration in sweep job 1 of 2 (pairs=4) in "
                                       "configs/cpu-smoke.yaml: exit.threshold must be in (0, 1], got 1.5"),
])
def test_a_bad_value_in_a_preset_names_its_file(tmp_path, monkeypatch, capsys, preset, overrides, line):
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    text = (configs / "cpu-smoke.yaml").read_text()
    assert text.count("threshold: 0.55") == 1
    (configs / "cpu-smoke.yaml").write_text(text.replace("threshold: 0.55", "threshold: 1.5"))
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", preset, *overrides]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [line], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


def test_an_overrides_value_is_not_blamed_on_a_preset_the_run_s_preset_overrides(tmp_path, monkeypatch, capsys):
    """cpu-smoke holds exit.threshold 1.5, cpu-context (which extends it) sets 0.6 and plans fine alone: a bad
    exit.threshold=1.5 then comes from the override (plain or swept), not from cpu-smoke.yaml, whose value
    cpu-context overrides. (It was named 'in configs/cpu-smoke.yaml': that preset alone is refused alike.)"""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    text = (configs / "cpu-smoke.yaml").read_text()
    (configs / "cpu-smoke.yaml").write_text(text.replace("threshold: 0.55", "threshold: 1.5"))
    (configs / "cpu-context.yaml").write_text((configs / "cpu-context.yaml").read_text() + "exit:\n  threshold: 0.6\n")
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", "cpu-context"]) == 0
    capsys.readouterr()
    for overrides, line in (
            (["exit.threshold=1.5"], BAD + "exit.threshold must be in (0, 1], got 1.5"),
            (["-m", "exit.threshold=0.5,1.5"], "loopbench: bad configuration in sweep job 2 of 2 (exit.threshold=1.5): "
                                               "exit.threshold must be in (0, 1], got 1.5")):
        assert cli.main(["-q", "plan", "--config-name", "cpu-context", *overrides]) == 2
        out, err = capsys.readouterr()
        assert err.splitlines() == [line], err


def test_preset_files_lists_a_preset_after_those_it_extends_and_survives_a_cycle(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    assert conf.preset_files("cpu-context") == ["cpu-smoke", "cpu-context"]
    assert conf.preset_files("cpu-smoke") == ["cpu-smoke"]
    (configs / "a.yaml").write_text("defaults:\n  - b\n  - _self_\n")
    (configs / "b.yaml").write_text("defaults:\n  - a\n  - _self_\n")
    assert conf.preset_files("a") == ["b", "a"]


def _loopbench(cwd: Path, *args: str):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "loopbench", "-q", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


@pytest.mark.parametrize("args, line", [
    # Hydra's own flags skip our rules, not the key check: Hydra's message would advise "+exit.treshold=0.6"
    (["exit.treshold=0.6", "--cfg", "job"], BAD + "unknown config key exit.treshold; did you mean exit.threshold?"),
    (["-m", "exit.treshold=0.5,0.6"], "loopbench: bad configuration in sweep job 1 of 2 (exit.treshold=0.5): unknown "
                                      "config key exit.treshold; did you mean exit.threshold?"),
    (["online.num_requests=3", "--cfg", "job"], BAD + "cannot apply online.num_requests=3: " + ONLINE_NULL),
    (["-m", "online.num_requests=3,4"], "loopbench: bad configuration in sweep job 1 of 2 (online.num_requests=3): "
                                        "cannot apply online.num_requests=3: " + ONLINE_NULL),
])
def test_hydras_own_refusal_of_a_key_reads_as_ours(tmp_path, args, line):
    proc = _loopbench(tmp_path, "bench", "--config-name", "cpu-smoke", f"results_dir={tmp_path / 'r'}",
                      f"cache_dir={tmp_path / 'c'}", *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [line], proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("override, line", [
    # `~pairs` composed, and the run then failed with a KeyError traceback, exit 1
    ("~pairs", "cannot apply ~pairs: pairs is a key of the schema, which a run cannot do without; set it (pairs=...) "
               "instead"),
    ("~exit", "cannot apply ~exit: exit is a key of the schema, which a run cannot do without; set its keys "
              "(exit.<key>=...) instead"),
    # Hydra: "Could not delete from config. 'resume' does not exist." of a key that is there, null
    ("~resume", "cannot apply ~resume: resume is a key of the schema, which a run cannot do without; set it to null "
                "(resume=null) or to a value"),
    # Hydra: "list indices must be integers or slices, not str"
    ("~comparisons.2", "cannot apply ~comparisons.2: an override cannot delete a list item; set the list whole "
                       "(comparisons=[...]) without it"),
    # Hydra: "Config group override must be a string or a list. Got int"
    ("=3", "=3: an override needs a key before its value (KEY=VALUE, e.g. pairs=6)"),
    # Hydra: "LexerNoViableAltException: exit.=0.6 ^ See https://hydra.cc/..."
    ("exit.=0.6", "'exit.=0.6': the key 'exit.' is not dotted names of ASCII letters, digits and _ "
                  "(e.g. exit.threshold=0.6)"),
    ("ëxit.threshold=0.6", "'ëxit.threshold=0.6': the key 'ëxit.threshold' is not dotted names of ASCII letters, "
                           "digits and _ (e.g. exit.threshold=0.6)"),
    ("pairs", "'pairs' is not an override: KEY=VALUE needs an '=' (e.g. pairs=6)"),
    # Hydra: "mismatched input '=' expecting <EOF> See ...", which does not name the override
    ("exit.threshold=0.6=1", "cannot parse the value of 'exit.threshold=0.6=1': mismatched input '=' expecting <EOF>"),
])
def test_an_override_hydra_words_badly_or_lets_through_is_one_line_naming_it(tmp_path, monkeypatch, capsys, command,
                                                                              override, line):
    err = _refusal(tmp_path, monkeypatch, capsys, command, override)
    assert len(err.splitlines()) == 1 and err.startswith(BAD + line), err


def test_a_dict_entry_may_still_be_deleted(tmp_path, monkeypatch, capsys):
    """`~arms.alias` is no key of the schema: the arm goes, and the rules then name the comparison that used it."""
    err = _refusal(tmp_path, monkeypatch, capsys, "plan", "~arms.alias")
    assert err == BAD + "comparisons[1].baseline = 'alias' is not an arm; arms are ['alias_prefix', 'native']\n", err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("key", ["results_dir", "cache_dir"])
@pytest.mark.parametrize("below", [False, True])
def test_a_results_or_cache_folder_that_is_a_file_is_named_before_anything_is_written(tmp_path, monkeypatch, capsys,
                                                                                     command, key, below):
    """Once a traceback with exit 1 from the first mkdir (cache_dir: after the bundle folder was made)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    path = notes / "sub" if below else notes
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"{key}={path}")
    where = f"is below {notes}, which is a file" if below else "is a file"
    assert err == BAD + f"{key} = '{path}' {where}, not a folder; name a folder (it is made where missing)\n", err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("key", ["results_dir", "cache_dir"])
@pytest.mark.parametrize("below", [False, True])
def test_a_results_or_cache_folder_that_cannot_be_written_is_named_before_anything_is_written(
        tmp_path, monkeypatch, capsys, command, key, below):
    """Once a traceback with exit 1 from the first mkdir (cache_dir: after an empty bundle folder was made). The
    folder is read-only to os.access only (the tests may run as root, whom permissions do not stop)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    path = locked / "sub" if below else locked
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"{key}={path}")
    where = f"is below {locked}, a folder" if below else "is a folder"
    assert err == BAD + f"{key} = '{path}' {where} this user cannot write; name a folder you can write (it is made " \
                        "where missing)\n", err


def test_loopbench_cache_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    monkeypatch.setenv("LOOPBENCH_CACHE", str(notes))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", "cpu-smoke", f"results_dir={tmp_path / 'r'}"]) == 2
    assert capsys.readouterr().err == BAD + (f"$LOOPBENCH_CACHE = '{notes}' is a file, not a folder; name a folder "
                                             "(it is made where missing)\n")


def test_a_results_dir_under_home_is_expanded_as_cache_dir_is(tmp_path, monkeypatch):
    """`results_dir='~/r'` once made a folder named `~` below the repository."""
    from loopbench.harness import inputs
    from loopbench.harness.spec import BenchSpec

    monkeypatch.setenv("HOME", str(tmp_path))
    spec = BenchSpec.from_plain(conf.to_plain(conf.compose("cpu-smoke", ["results_dir='~/r'"])))
    assert inputs.results_path(spec) == tmp_path / "r"


def test_an_empty_preset_name_is_unknown_not_the_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", ""]) == 2
    assert capsys.readouterr().err.startswith(BAD + "unknown preset ''; configs/ has ['cpu-context', ")


def test_a_bracketed_key_in_a_sweep_is_worded_as_outside_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-q", "plan", "--config-name", "cpu-smoke", "-m", "comparisons[0].candidate=alias,native"]) == 2
    assert capsys.readouterr().err == ("loopbench: bad configuration in sweep job (the sweep's overrides): "
                                       "comparisons[0].candidate=alias,native: an override names a list item by a "
                                       "dot, not brackets: comparisons.0.candidate=alias,native\n")


@pytest.mark.parametrize("flags", [["--cfg", "job", "pairs=4"], ["pairs=4", "--cfg", "job"], ["-c", "job", "pairs=4"]])
def test_hydras_cfg_flag_shows_the_config_wherever_it_is_written_and_exits_0(tmp_path, flags):
    """`--cfg job` before the overrides once had its `job` taken for an override ("Error parsing override 'job'"),
    and after them it printed the config and exited 1."""
    proc = _loopbench(tmp_path, "bench", "--config-name", "cpu-smoke", f"results_dir={tmp_path / 'r'}",
                      f"cache_dir={tmp_path / 'c'}", *flags)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert "\npairs: 4\n" in proc.stdout and "name: cpu-smoke" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_bundle_folder_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """results_dir=/proc/foo passes the folder check (root may write /proc) and was a traceback with exit 1 from the
    bundle folder's mkdir (FileNotFoundError), as is any results_dir that turns read-only after the check."""
    from loopbench.harness import evidence

    def refused(results_dir, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(results_dir))

    monkeypatch.setattr(evidence, "bundle_dir", refused)
    err = _refusal(tmp_path, monkeypatch, capsys, "bench", "pairs=1")
    r = tmp_path / "work" / "r"
    assert err == BAD + (f"results_dir = '{r}': cannot make the bundle folder there (Read-only file system: {r}); "
                         "nothing was measured\n"), err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("value", ["''", "' '"])
def test_an_empty_results_dir_is_named(tmp_path, monkeypatch, capsys, command, value):
    """`results_dir=` (an unset shell variable) passed plan and bench wrote its bundle into the repository root."""
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"results_dir={value}")
    assert err == BAD + f"results_dir must name a folder, got {value} (the default is 'results')\n", err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("value", ["''", "' '"])
def test_an_empty_cache_dir_is_named(tmp_path, monkeypatch, capsys, command, value):
    """`cache_dir=` (an unset shell variable) passed plan and bench used $LOOPBENCH_CACHE or ~/.cache/loopbench
    unsaid, where an empty results_dir is refused; null is the key's way to ask for the default."""
    monkeypatch.setenv("LOOPBENCH_CACHE", str(tmp_path / "env-cache"))
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"cache_dir={value}")
    assert err == BAD + (f"cache_dir must name a folder, got {value} (null, the default, is $LOOPBENCH_CACHE or "
                         "~/.cache/loopbench)\n"), err
    assert not (tmp_path / "env-cache").exists()


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("value", ["''", "' '"])
def test_an_empty_checkpoint_is_named(tmp_path, monkeypatch, capsys, command, value):
    """`model.checkpoint=` (an unset shell variable, `model.checkpoint=$CKPT`) passed plan and bench measured the
    preset's synthetic checkpoint unsaid, where the real one was asked for; null is the key's way to ask for it."""
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"model.checkpoint={value}")
    assert err == BAD + (f"model.checkpoint must name an HF checkpoint directory, got {value} (null, the default, is "
                         "the preset's synthetic checkpoint)\n"), err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("text, why", [
    ("not json", "{file} is not readable JSON (Expecting value: line 1 column 1 (char 0))"),
    ("{}", "{file}: missing config key 'hidden_size'"),
])
def test_a_checkpoint_whose_config_json_is_bad_names_the_key_and_file(tmp_path, monkeypatch, capsys, command, text,
                                                                       why):
    """A checkpoint folder whose config.json is no JSON was refused in json's words alone (`loopbench: bad
    configuration: Expecting value: line 1 column 1 (char 0)`), naming neither model.checkpoint nor the file; one
    without a required key named only `config.json`."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(text)
    err = _refusal(tmp_path, monkeypatch, capsys, command, f"model.checkpoint={ckpt}")
    assert err == BAD + f"model.checkpoint = '{ckpt}': " + why.format(file=ckpt / "config.json") + "\n", err


def test_a_cache_folder_that_cannot_be_made_is_one_line_exit_2_and_leaves_no_bundle_folder(tmp_path, monkeypatch,
                                                                                            capsys):
    """cache_dir=/proc/foo/c passes the folder check as root (os.access) and was a traceback with exit 1 from the
    cache's mkdir after the bundle folder was made, which was left empty in results_dir (e33dd1d handled results_dir
    only). Here os.access is made to pass for any user, and nothing may be made below /proc."""
    from loopbench.harness import rules

    monkeypatch.setattr(rules.os, "access", lambda *args, **kwargs: True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    rc = cli.main(["-q", "bench", "--config-name", "cpu-smoke", "pairs=1", f"results_dir={work / 'r'}",
                   "cache_dir=/proc/loopbench-no-such/c"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith(BAD + "cache_dir = '/proc/loopbench-no-such/c': cannot make the cache folder there (") \
        and err.endswith("); nothing was measured\n") and err.count("\n") == 1, err
    assert [p for p in work.rglob("*") if p != work / "r"] == [], list(work.rglob("*"))   # no bundle folder in r/


def _run_with_presets(tmp_path, monkeypatch, capsys, command, preset, files):
    """``loopbench -q COMMAND --config-name PRESET`` over a copy of configs/ with ``files`` ({name: YAML text}) added
    or replaced; (exit code, stdout, stderr). Asserts the run wrote nothing beside that copy."""
    configs = tmp_path / "configs"
    shutil.copytree(conf.CONFIG_DIR, configs)
    for name, text in files.items():
        (configs / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(conf, "CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-q", command, "--config-name", preset, f"results_dir={tmp_path / 'r'}"])
    out, err = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]
    return rc, out, err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("preset, text, line", [
    # a flow list left open
    ("my-sweep", "defaults:\n  - cpu-smoke\n  - _self_\nname: my-sweep\npairs: 2\n  bad: [\n",
     "configs/my-sweep.yaml is not valid YAML: mapping values are not allowed here (line 6, column 6)"),
    ("my-sweep", "defaults:\n  - cpu-smoke\n  - _self_\npairs: 3\npairs: 4\n",
     "configs/my-sweep.yaml is not valid YAML: found duplicate key pairs (line 5, column 1)"),
    # the broken file is one the run's preset extends
    ("my-sweep", "defaults:\n  - my-base\n  - _self_\nname: my-sweep\n",
     "configs/my-base.yaml is not valid YAML: found character '\\t' that cannot start any token (line 4, column 1)"),
])
def test_a_preset_that_is_not_valid_yaml_is_named_in_one_line(tmp_path, monkeypatch, capsys, command, preset, text,
                                                               line):
    """A YAML syntax error in a preset (or one it extends) was a yaml.scanner traceback from inside Hydra, exit 1."""
    files = {"my-base": "defaults:\n  - cpu-smoke\n  - _self_\n\tpairs: 3\n", preset: text}
    rc, out, err = _run_with_presets(tmp_path, monkeypatch, capsys, command, preset, files)
    assert rc == 2 and out == "" and err.splitlines() == [BAD + line], err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("text", ["", "name: mine\npairs: 3\n", "defaults:\n  - _self_\nname: mine\n"])
def test_a_preset_that_does_not_extend_the_schema_is_named_in_one_line(tmp_path, monkeypatch, capsys, command, text):
    """A preset whose defaults list names neither bench_schema nor a preset composes without the schema's keys:
    that was a KeyError traceback from rules.check (KeyError: 'name' / 'model'), exit 1."""
    rc, out, err = _run_with_presets(tmp_path, monkeypatch, capsys, command, "mine", {"mine": text})
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(BAD + "configs/mine.yaml does not extend the schema: its defaults list must name "
                                "bench_schema or a preset that does (e.g. defaults: [cpu-smoke, _self_]); "
                                "it lacks "), err
    assert "model" in err


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize("files, preset, line", [
    ({"mine": "defaults:\n  - mine\n  - _self_\n"}, "mine", "configs/mine.yaml extends itself: mine -> mine"),
    ({"a": "defaults:\n  - b\n  - _self_\n", "b": "defaults:\n  - cpu-smoke\n  - a\n  - _self_\n"}, "a",
     "configs/a.yaml extends itself: a -> b -> a"),
    ({"c": "defaults:\n  - a\n  - _self_\n", "a": "defaults:\n  - b\n  - _self_\n", "b": "defaults:\n  - a\n"}, "c",
     "configs/a.yaml extends itself: a -> b -> a"),
])
def test_a_preset_whose_defaults_extend_it_again_is_named_in_one_line(tmp_path, monkeypatch, capsys, command, files,
                                                                      preset, line):
    """A cycle in the presets' defaults lists was Hydra's RecursionError traceback, exit 1."""
    rc, out, err = _run_with_presets(tmp_path, monkeypatch, capsys, command, preset, files)
    assert rc == 2 and out == "" and err.splitlines() == [BAD + line], err
