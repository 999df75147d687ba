"""Typed configs: presets compose, and a misspelt key, a wrong type or a bad value fails naming the key."""
import pytest
from hydra.errors import ConfigCompositionException

from loopbench.harness import conf, spec


def _error_text(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


def test_presets_compose_and_validate():
    smoke = conf.validate(conf.compose("cpu-smoke")).to_plain()
    assert smoke["model"]["preset"] == "tiny" and smoke["pairs"] == 3
    # first-alias positions at the last key of a 32-position tile (31, 63), at a tile start and past it
    assert smoke["workload"]["prompt_len"] is None and smoke["workload"]["prompt_lens"] == [31, 32, 63, 33]
    assert smoke["exit"] == {"policy": "ouro", "threshold": 0.55, "min_loops": 1, "max_loops": 4}  # depth-1 exits
    assert [c["name"] for c in smoke["comparisons"]] == [
        "native_vs_alias_prefix", "alias_vs_alias_prefix", "native_vs_native"]
    big_spec = conf.validate(conf.compose("ouro-1.4b"))
    big = big_spec.to_plain()
    assert big["model"] == {"preset": "ouro-1.4b", "checkpoint": None, "dtype": "bfloat16", "seed": 0}
    assert [(p["max_num_seqs"], p["num_requests"]) for p in big["points"]] == [(16, 32), (32, 64)]
    assert (big["workload"]["prompt_len"], big["workload"]["output_len"], big["pairs"]) == (128, 128, 7)
    assert big["exit"] == {"policy": "ouro_delayed", "threshold": 0.5, "min_loops": 2, "max_loops": 4}
    assert set(big["arms"]) == {"native", "alias", "alias_prefix"}
    assert all(a["attention_backend"] == "triton" and a["cuda_graphs"] for a in big["arms"].values())
    assert [(c["baseline"], c["candidate"]) for c in big["comparisons"]] == [
        ("native", "alias_prefix"), ("alias", "alias_prefix")]
    assert big_spec.reference == "native"
    assert {a["engine"] for a in big["arms"].values()} == {"loopbench.runtime.engine:LoopEngine"}  # the default


@pytest.mark.parametrize("override, key", [
    ("pairs=abc", "pairs"),
    ("model.dtype=bf16", "model.dtype"),
    ("arms.alias.cuda_graphs=maybe", "arms.alias.cuda_graphs"),
])
def test_wrong_type_fails_at_composition(override, key):
    with pytest.raises(ConfigCompositionException) as err:
        conf.compose("cpu-smoke", [override])
    assert key in _error_text(err.value)


@pytest.mark.parametrize("override, message", [
    ("pairz=3", "unknown config key pairz; did you mean pairs?"),
    ("workload.promt_len=3", "unknown config key workload.promt_len; did you mean workload.prompt_len?"),
    ("arms.native.kv_layot=alias", "unknown config key arms.native.kv_layot; did you mean arms.native.kv_layout?"),
    ("comparisons=[{baseline:native,candidat:alias}]",
     "unknown config key comparisons.0.candidat; did you mean comparisons.0.candidate?"),
    ("verdict.zzz=1", "unknown config key verdict.zzz; verdict has bootstrap_seed, confidence, eager_fraction_tolerance, "
                      "min_effect, min_pairs, n_resamples"),
])
def test_misspelt_key_is_named_with_the_closest_key_not_hydras_append_hint(override, message):
    with pytest.raises(ValueError) as err:
        conf.compose("cpu-smoke", [override])
    assert str(err.value) == message


@pytest.mark.parametrize("preset, overrides, message", [
    ("cpu-smoke", ["online.num_requests=3"],
     "cannot apply online.num_requests=3: online is null in preset cpu-smoke; an override cannot fill a null section, "
     "not online={...} either; use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one "
     "of your own in configs/"),
    ("cpu-smoke", ["online={}"],            # composes, to a null section: a run without the online track it asks for
     "cannot apply online={}: online is null in preset cpu-smoke; an override cannot fill a null section, "
     "not online={...} either; use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one "
     "of your own in configs/"),
    ("cpu-smoke", ["online={\t}"],
     "cannot apply online={\t}: online is null in preset cpu-smoke; an override cannot fill a null section, "
     "not online={...} either; use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one "
     "of your own in configs/"),
    ("cpu-smoke", ["online={}", "online.num_requests=3"],
     "cannot apply online={}: online is null in preset cpu-smoke; an override cannot fill a null section, "
     "not online={...} either; use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one "
     "of your own in configs/"),
    ("cpu-online", ["online=null", "online.num_requests=3"],   # nulled by an earlier override, not by the preset
     "cannot apply online.num_requests=3: online is null after online=null; an override cannot fill a null section, "
     "not online={...} either; use a preset that sets online (--config-name cpu-online or ouro-1.4b-online) or one "
     "of your own in configs/"),
    ("ouro-1.4b", ["workload.prompt_lens.0=5"],
     "cannot apply workload.prompt_lens.0=5: workload.prompt_lens is null in preset ouro-1.4b; set it whole "
     "(workload.prompt_lens=[...])"),
])
def test_an_override_into_a_null_node_is_named_with_what_to_do(preset, overrides, message):
    with pytest.raises(ValueError) as err:
        conf.compose(preset, overrides)
    assert str(err.value) == message


@pytest.mark.parametrize("overrides, message", [
    (["comparisons.5.candidate=alias"],
     "cannot apply comparisons.5.candidate=alias: comparisons has items 0-2, not 5; to add items, set it whole "
     "(comparisons=[...])"),
    (["points.2={max_num_seqs: 4}"],
     "cannot apply points.2={max_num_seqs: 4}: points has items 0-1, not 2; to add items, set it whole (points=[...])"),
    (["comparisons.1_0.candidate=alias"],                                   # Hydra reads 1_0 as 10
     "cannot apply comparisons.1_0.candidate=alias: comparisons has items 0-2, not 10; to add items, set it whole "
     "(comparisons=[...])"),
    (["comparisons=[{baseline: native, candidate: alias}]", "comparisons.1.candidate=alias"],   # set by an override
     "cannot apply comparisons.1.candidate=alias: comparisons has item 0, not 1; to add items, set it whole "
     "(comparisons=[...])"),
])
def test_an_override_past_a_lists_end_names_the_list_and_its_items(overrides, message):
    # OmegaConf's own message there is "Invalid type assigned: dict is not a subclass of ComparisonConf. value: {}"
    with pytest.raises(ValueError) as err:
        conf.compose("cpu-smoke", overrides)
    assert str(err.value) == message


def test_what_the_list_index_message_advises_composes():
    cfg = conf.compose("cpu-smoke", ["comparisons=[{baseline: native, candidate: alias}, {baseline: native, "
                                     "candidate: alias}]", "comparisons.1.candidate=native"])
    assert [c.candidate for c in cfg.comparisons] == ["alias", "native"]


def test_what_the_null_node_messages_advise_composes():
    assert conf.compose("cpu-online", ["online.num_requests=3"]).online.num_requests == 3
    assert list(conf.compose("cpu-smoke", ["executor.gpus=[0,2]", "executor.gpus.0=1"]).executor.gpus) == [1, 2]
    assert conf.compose("cpu-smoke", ["comparisons.0.candidate=alias"]).comparisons[0].candidate == "alias"


def test_an_omegaconf_failure_no_check_places_is_still_a_value_error(monkeypatch):
    monkeypatch.setattr(conf, "_check_override_targets", lambda *args: None)
    with pytest.raises(ValueError) as err:
        conf.compose("cpu-smoke", ["pairs=3", "online.num_requests=3"])
    assert str(err.value) == "preset cpu-smoke does not compose with pairs=3 online.num_requests=3"
    assert isinstance(err.value.__cause__, AssertionError)    # the CLI shows its first line in parentheses


def test_unknown_preset_is_named_with_the_presets_there_are():
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; configs/ has \[.*'cpu-smoke'.*'ouro-1.4b'"):
        conf.compose("nope")


@pytest.mark.parametrize("override, key", [
    ("+workload.promt_len=3", "workload.promt_len"),      # '+' lifts Hydra's struct flag; validate does not
    ("+verdict.min_efect=0.1", "verdict.min_efect"),
    ("comparisons=[{baseline:native,candidate:alias_prefx}]", "comparisons[0].candidate"),
    ("exit.min_loops=5", "exit.min_loops"),
    ("pairs=0", "pairs"),
    ("verdict.confidence=1.5", "verdict.confidence"),
    ("arms.native.prefix_tiles=true", "arms.native.prefix_tiles"),
    ("points=[]", "points"),
    ("reference_arm=nativ", "reference_arm"),
    ("order_seed=-1", "order_seed"),
    ("workload.prompt_seed=-1", "workload.prompt_seed"),
    ("verdict.bootstrap_seed=-1", "verdict.bootstrap_seed"),
    ("model.seed=-1", "model.seed"),
    ("workload.prompt_len=5", "workload.prompt_lens"),          # cpu-smoke sets prompt_lens: both set
    ("workload.prompt_lens=[]", "workload.prompt_lens"),
    ("workload.prompt_lens=[3,0]", "workload.prompt_lens[1]"),
    ("workload.prompt_lens=null", "workload.prompt_len"),       # neither set
    ("workload.prompts_file=/no/such.jsonl", "workload.prompt_lens"),   # a file keeps its own lengths
])
def test_semantic_errors_fail_in_validate_naming_the_key(override, key):
    with pytest.raises(ValueError) as err:
        conf.validate(conf.compose("cpu-smoke", [override]))
    assert key in str(err.value)


@pytest.mark.parametrize("override, keys", [
    ("exit.max_loops=5", ("exit.max_loops=5", "total_ut_steps=4")),
    ("workload.prompt_len=1000", ("workload.prompt_len (1000)", "workload.output_len (32)", "1031 positions",
                                  "max_position_embeddings=1024")),
    ("workload.prompt_lens=[5,1000]", ("the longest of workload.prompt_lens (1000)", "1031 positions")),
])
def test_config_that_does_not_fit_the_model_fails_naming_the_keys(override, keys):
    from loopbench.runtime.model import PRESETS

    extra = ["workload.prompt_lens=null"] if "prompt_len=" in override else ["workload.prompt_len=null"]
    checked = conf.validate(conf.compose("cpu-smoke", [override, *extra]))
    longest = checked.workload.prompt_len or max(checked.workload.prompt_lens)
    with pytest.raises(ValueError) as err:
        spec.check_fits_model(checked, PRESETS["tiny"].to_dict(), longest)
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_config_at_the_model_limits_fits():
    from loopbench.runtime.model import PRESETS

    checked = conf.validate(conf.compose("cpu-smoke", ["workload.prompt_len=993", "workload.prompt_lens=null",
                                                       "exit.max_loops=4"]))
    spec.check_fits_model(checked, PRESETS["tiny"].to_dict(), 993)   # 993 + 32 - 1 = 1024 positions


def test_overrides_and_list_replacement():
    plain = conf.validate(conf.compose("cpu-smoke", [
        "pairs=5", "points=[{max_num_seqs:2,num_requests:3}]",
        "comparisons=[{baseline:alias_prefix,candidate:alias_prefix,name:aa}]", "arms.native.block_size=32"])).to_plain()
    assert plain["pairs"] == 5 and plain["points"] == [{"max_num_seqs": 2, "num_requests": 3, "prompt_len": None, "output_len": None}]
    assert plain["comparisons"] == [{"baseline": "alias_prefix", "candidate": "alias_prefix", "name": "aa",
                                     "track": "replay"}]
    assert plain["arms"]["native"]["block_size"] == 32


@pytest.mark.parametrize("override, match", [
    ("+workload.promt_len=3", "workload.promt_len"),
    ("order_seed=-1", "order_seed"),
    ("verdict.bootstrap_seed=-1", "verdict.bootstrap_seed"),
    ("exit.max_loops=5", "exit.max_loops=5 exceeds the model's total_ut_steps=4"),
    ("workload.prompt_len=1000", r"workload.prompt_len \(1000\) \+ workload.output_len \(32\) - 1 = 1031 positions"),
    ("arms.alias.cuda_graphs=true", "arms.alias.cuda_graphs = true needs a CUDA device"),
    ("arms.alias.attention_backend=triton", "arms.alias.attention_backend = triton would run under the Triton interpreter"),
    ("workload.prompt_lens=[4,0]", r"workload.prompt_lens\[1\] must be a positive integer, got 0"),
    ("arms.alias.engine=nomodule_xyz:make_engine", r"arms.alias.engine = 'nomodule_xyz:make_engine' names no engine"),
    ("executor.poll_s=inf", "executor.poll_s must be a finite number > 0, got inf"),
    ("executor.stop_grace_s=nan", "executor.stop_grace_s must be a finite number > 0, got nan"),
    ("executor.gpus=[-1]", r"executor.gpus lists a negative GPU index: \[-1\]"),
    ("executor.gpus=[0,1]", r"executor.gpus = \[0, 1\] names GPUs, but "),
    ("workload.prompts_file=/", "workload.prompts_file '/' is a folder, not a file"),
])
def test_bad_config_fails_before_anything_is_written_or_measured(tmp_path, override, match):
    from loopbench.harness import controller

    own_lens = override.startswith(("workload.prompt_len=", "workload.prompts_file="))
    one_len = ["workload.prompt_lens=null"] if own_lens else []
    cfg = conf.compose("cpu-smoke", [override, *one_len, f"results_dir={tmp_path / 'results'}",
                                     f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match=match):
        controller.run(cfg)
    assert not (tmp_path / "results").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("overrides, match", [
    (["executor.poll_s=1e9"], r"executor.poll_s = 1e\+09 s must be below executor.reference_timeout_s = 300 s"),
    (["executor.poll_s=600"], r"executor.poll_s = 600 s must be below executor.reference_timeout_s = 300 s"),
    (["executor.poll_s=60", "executor.session_timeout_s=60"],
     "executor.poll_s = 60 s must be below executor.session_timeout_s = 60 s"),
])
def test_a_poll_interval_not_below_the_timeouts_is_refused(overrides, match):
    """The controller sees a child's end, and its timeout, once per poll: executor.poll_s=1e9 passed, and the run
    waited that long after its reference child had ended, before it measured anything (a Ctrl-C still stops it)."""
    with pytest.raises(ValueError, match=match):
        conf.validate(conf.compose("cpu-smoke", overrides))


def test_executor_gpus_of_a_slurm_run_are_refused_since_slurm_allocates_them():
    with pytest.raises(ValueError, match=r"executor.gpus = \[0\] picks local GPUs, but executor.kind = slurm; leave it "
                                         "null and set executor.slurm.gpus_per_task"):
        conf.validate(conf.compose("cpu-smoke", ["executor.kind=slurm", "executor.device=auto", "executor.gpus=[0]"]))


def test_validate_returns_a_frozen_spec_and_leaves_its_input_alone():
    import copy
    import dataclasses

    plain = conf.to_plain(conf.compose("cpu-smoke"))
    before = copy.deepcopy(plain)
    checked = conf.validate(plain)
    assert plain == before                                   # the default comparison names are not filled in
    assert [c.name for c in checked.comparisons][0] == "native_vs_alias_prefix"
    assert checked.SCHEMA_VERSION == 1 and checked.arms["native"].SCHEMA_VERSION == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.pairs = 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.arms["native"].kv_layout = "alias"
    assert conf.validate(checked.to_plain()) == checked      # to_plain is the plan's config; it reads back


@pytest.mark.parametrize("value, words", [
    ("nomodule_xyz:make_engine", "module 'nomodule_xyz' cannot be imported"),
    ("loopbench.runtime.engine:NoSuchFactory", "has no callable 'NoSuchFactory'"),
    ("loopbench.runtime.engine", "is not an import path"),
    ("loopbench.runtime.api:choice_values", "cannot be called as factory(model, config)"),
    ("this_file_is_not_python:make_engine", "cannot be imported (SyntaxError"),
])
def test_bad_engine_path_fails_naming_the_arm_and_the_value(value, words, tmp_path, monkeypatch):
    (tmp_path / "this_file_is_not_python.py").write_text("def make_engine(model, config:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        conf.validate(conf.compose("cpu-smoke", [f"arms.alias.engine={value}"]))
    assert f"arms.alias.engine = {value!r}" in str(err.value) and words in str(err.value)


def test_arm_spec_maps_onto_one_engine_config():
    from loopbench.runtime.api import EngineConfig

    arm = conf.validate(conf.compose("cpu-smoke")).arms["alias_prefix"]
    cfg = arm.engine_config(4, 96, "ouro")
    assert cfg == EngineConfig(max_num_seqs=4, max_model_len=96, exit_policy="ouro", kv_layout="alias",
                               prefix_tiles=True, attention_backend="torch", cuda_graphs=False)


def test_config_choices_mirror_the_runtime_choices():
    from loopbench.runtime import api
    pairs = [(conf.KVLayout, api.KVLayout), (conf.AttentionBackend, api.AttentionBackendName),
             (conf.DescriptorMode, api.DescriptorMode)]
    for ours, runtime in pairs:
        assert [m.value for m in ours] == [m.value for m in runtime], ours.__name__
        assert all(m.name == m.value for m in ours), f"{ours.__name__}: Hydra parses overrides by member name"
    assert [m.value for m in conf.ExitPolicy] == [m.value for m in api.ExitPolicyName if m.value != "replay"]


def test_plain_error_words_omegaconf_trailers_for_people():
    from loopbench.harness.conf import plain_error
    assert plain_error("Missing mandatory value: num_requests full_key: points[0].num_requests "
                       "reference_type=PointConf object_type=PointConf") == \
        "missing required key points[0].num_requests: give it a value"
    assert plain_error("Value 'x' of type 'str' could not be converted to Integer full_key: pairs "
                       "object_type=BenchConf") == \
        "Value 'x' of type 'str' could not be converted to Integer (key pairs)"
    assert plain_error("pairs must be a positive integer, got 0") == "pairs must be a positive integer, got 0"


@pytest.mark.parametrize("edit, message", [
    # an arm's name lands in report.md's table cells: a '|' there made the audit fail after the whole run
    (lambda p: (p["arms"].__setitem__("x|y", dict(p["arms"]["native"])),
                p.__setitem__("comparisons", [{**p["comparisons"][0], "candidate": "x|y", "name": "ok"}])),
     "arms: 'x|y' is not a plain token (an arm's name holds no '/', '\\', '|' or whitespace)"),
    (lambda p: (p["arms"].__setitem__("a\nb", dict(p["arms"]["native"])),
                p.__setitem__("comparisons", [{**p["comparisons"][0], "candidate": "a\nb", "name": "ok"}])),
     "arms: 'a\\nb' is not a plain token (an arm's name holds no '/', '\\', '|' or whitespace)"),
    (lambda p: p["comparisons"][0].__setitem__("name", "a|b"),
     "comparisons[0].name = 'a|b' is repeated or not a plain token (no '/', '\\', '|' or whitespace)"),
    (lambda p: p["comparisons"][0].__setitem__("name", "a\tb"),
     "comparisons[0].name = 'a\\tb' is repeated or not a plain token (no '/', '\\', '|' or whitespace)"),
])
def test_an_arm_or_comparison_name_that_would_break_report_tables_is_refused(edit, message):
    plain = conf.to_plain(conf.compose("cpu-smoke"))
    edit(plain)
    with pytest.raises(ValueError) as err:
        conf.validate(plain)
    assert str(err.value) == message
