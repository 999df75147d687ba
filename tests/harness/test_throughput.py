"""The throughput probe end to end on the CPU (tiny preset): natural vs replay, the profile report, bad arguments."""
import dataclasses
import json
import os

import pytest
import torch

from loopbench.harness import machine, throughput
from loopbench.runtime.model import OuroModel
from loopbench.runtime.schedule import Schedule, ScheduleMismatchError

SMALL = ["--preset", "tiny", "--max-num-seqs", "2", "--num-requests", "2", "--prompt-len", "4", "--output-len", "3",
         "--repeats", "1"]
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _an_idle_machine(monkeypatch):
    """The probe sees an idle machine (no busy-CPU warning on stderr) unless a test says otherwise: the CI
    machine's load is not the test's input."""
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 0.0)


def test_both_policies_with_a_profile_write_two_sections(tmp_path, capsys):
    report = tmp_path / "out" / "p.md"
    rc = throughput.main([*SMALL, "--cache", str(tmp_path / "c"), "--policy", "both", "--profile", str(report)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("natural warmup:", "replay warmup:", "natural run 1:", "replay run 1:",
                 "natural profiled run:", "replay profiled run:", "natural/replay throughput ratio"):
        assert line in out, out
    assert out.index("natural run 1:") < out.index("replay run 1:")
    assert "no GPU kernels in the trace" in out
    md = report.read_text()
    assert "## natural: one measured run" in md and "## replay: one measured run" in md
    assert "no GPU kernels in the trace (a CPU run)" in md and "| B | 2 |" in md
    assert "| cpu_threads | 1 |" in md or HAS_CUDA                 # the default, as a measured CPU session's
    assert out.startswith("probe on cpu (") and "torch threads: 1 (--cpu-threads)" in out.splitlines()[0] or HAS_CUDA
    doc = json.loads(report.with_suffix(".json").read_text())
    assert [s["params"]["policy"] for s in doc["sections"]] == ["natural", "replay"]
    for s in doc["sections"]:
        assert s["summary"]["num_kernels"] == 0
        assert s["summary"]["parts"][0]["ranges"] == s["params"]["decode_steps"] > 0
    assert sorted(p.name for p in report.parent.iterdir()) == ["p.json", "p.md"]     # the trace stayed out


def test_natural_policy_alone_and_a_kept_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    rc = throughput.main([*SMALL, "--cache", str(tmp_path / "c"), "--policy", "natural",
                          "--profile", str(tmp_path / "p.md"), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0 and "replay warmup" not in out and "median natural:" in out
    assert "traceEvents" in json.loads(trace.read_text()) and f"traces kept: {trace}" in out


def test_both_policies_keep_one_trace_each(tmp_path, capsys):
    rc = throughput.main([*SMALL, "--cache", str(tmp_path / "c"), "--policy", "both",
                          "--profile", str(tmp_path / "p.md"), "--trace", str(tmp_path / "t.json")])
    assert rc == 0, capsys.readouterr().out
    assert (tmp_path / "t.natural.json").exists() and (tmp_path / "t.replay.json").exists()


def test_a_run_that_misses_the_schedule_exits_nonzero(tmp_path, capsys, monkeypatch):
    def mismatch(self, outputs, trace_sha256=None):
        raise ScheduleMismatchError("request 'r0' token_ids[1] = 5, frozen schedule has 6")
    monkeypatch.setattr(Schedule, "verify", mismatch)
    rc = throughput.main([*SMALL, "--cache", str(tmp_path / "c"), "--policy", "natural"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAIL: the natural warmup does not reproduce the captured schedule: request 'r0'" in captured.err


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--num-requests", "--prompt-len", "--output-len", "--repeats",
                                  "--prefill-gemm-rows", "--cpu-threads"])
def test_counts_below_one_are_argparse_errors_naming_the_value(flag, tmp_path, capsys):
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exc:
        throughput.main(["--cache", str(tmp_path / "c"), flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()                    # nothing ran
    assert torch.get_num_threads() == threads


class _Loaded(Exception):
    """Raised by the stand-in loader: the probe got past its checks to loading the model."""


def _threads_at_load(monkeypatch, argv: list[str], tmp_path) -> int:
    """main(argv) up to its model load, which a stand-in replaces: the torch threads the probe would run on."""
    def loaded(args, device, max_len):
        raise _Loaded(torch.get_num_threads())
    monkeypatch.setattr(throughput, "load", loaded)
    with pytest.raises(_Loaded) as exc:
        throughput.main(["--cache", str(tmp_path / "c"), *argv])
    return exc.value.args[0]


def test_cpu_threads_default_to_one_and_a_bad_value_is_named_before_anything_runs(tmp_path, capsys):
    assert throughput.parse_args([]).cpu_threads == 1 and throughput.parse_args(["--cpu-threads", "3"]).cpu_threads == 3
    for bad, message in (("two", "argument --cpu-threads: 'two' is not an integer"),
                         ("-1", "argument --cpu-threads: must be >= 1, got -1")):
        with pytest.raises(SystemExit) as exc:
            throughput.main(["--cache", str(tmp_path / "c"), "--cpu-threads", bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(HAS_CUDA, reason="--cpu-threads pins the CPU only")
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_threads_are_what_the_probe_runs_on_and_are_put_back(threads, tmp_path, capsys, monkeypatch):
    # an idle machine of more cores than the threads, whatever this one is: no warning belongs on stderr
    monkeypatch.setattr(machine, "usable_cores", lambda: 4)
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 0.0)
    before = torch.get_num_threads()
    argv = [] if threads == 1 else ["--cpu-threads", str(threads)]
    assert _threads_at_load(monkeypatch, argv, tmp_path) == threads
    assert torch.get_num_threads() == before
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("probe on cpu (") and out.splitlines()[0].endswith(
        f", torch threads: {threads} (--cpu-threads)") and err == ""


def test_cpu_threads_pin_the_cpu_only():
    before = torch.get_num_threads()
    restore = throughput.pin_cpu_threads("cuda", before + 1)
    assert torch.get_num_threads() == before
    restore()
    restore = throughput.pin_cpu_threads("cpu", before + 1)
    assert torch.get_num_threads() == before + 1
    restore()
    assert torch.get_num_threads() == before


@pytest.mark.skipif(HAS_CUDA, reason="the warning is of CPU timings")
def test_a_cpu_probe_on_a_machine_busier_than_its_cores_warns_once_on_stderr(tmp_path, capsys, monkeypatch):
    assert 1 <= machine.usable_cores() <= (os.cpu_count() or 1)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 1.7)
    _threads_at_load(monkeypatch, [], tmp_path)       # the probe's default --cpu-threads 1: 0.3 cores idle
    assert capsys.readouterr().err == ("warning: other work keeps 1.7 of the 2 usable cores busy, leaving fewer idle "
                                       "than the run's 1 thread: CPU timings are for smoke checks, not performance "
                                       "evidence\n")


def test_bad_profile_path_and_non_integer_are_argparse_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--cache", str(tmp_path / "c"), "--profile", str(tmp_path / "p.txt")])
    assert "p.txt' does not end in .md" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--max-num-seqs", "two"])
    assert "argument --max-num-seqs: 'two' is not an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--trace", "t.json"])
    assert "--trace 't.json' needs --profile" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_prefill_gemm_rows_reach_the_engine_config():
    from loopbench.harness.records import ArmSpec
    arm = ArmSpec(kv_layout="native", attention_backend="torch")
    given = throughput.parse_args(["--prefill-gemm-rows", "32"])
    assert throughput.engine_config(arm, given, 64, "ouro_delayed").prefill_call_rows == 32
    default = throughput.parse_args([])
    assert throughput.engine_config(arm, default, 2112, "ouro_delayed").prefill_call_rows == 1024



@pytest.mark.parametrize("text, message", [
    ("gate_up.num_stages", "is not ROLE.FIELD=VALUE"),
    ("gateup.num_stages=3", "unknown role 'gateup'"),
    ("gate_up.stages=3", "unknown field 'stages'"),
    ("gate_up.num_stages=three", "num_stages must be an integer, got 'three'"),
    ("gate_up.tma=yes", "tma must be true or false, got 'yes'"),
    ("down.split_k=-1", "split_k must be >= 0, got -1"),
    ("qkv.early_epilogue=false", "only qkv_rope's epilogue has inputs to load early"),
])
def test_bad_gemm_config_overrides_are_argparse_errors_naming_the_part(text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        throughput.parse_args(["--gemm-config", text])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_gemm_config_overrides_reach_the_tables_and_are_put_back():
    from loopbench.kernels import gemm, qkv_rope
    from loopbench.runtime.model import PRESETS
    before = (dict(gemm.CONFIGS), dict(gemm.FASTER_UP_TO), dict(gemm.SWIGLU_CONFIGS), dict(qkv_rope.FASTER_UP_TO))
    args = throughput.parse_args(["--gemm-config", "swiglu.num_stages=3", "--gemm-config", "down.split_k=8",
                                  "--gemm-config", "qkv_rope.faster_up_to=128", "--gemm-config", "lm_head.tma=false",
                                  "--prefetch-tiles", "2"])
    restore = throughput.apply_kernel_options(args)
    try:
        throughput.apply_gemm_overrides(PRESETS["ouro-1.4b"], args.gemm_config)
        glu, down, lm = gemm.SWIGLU_CONFIGS[(11264, 2048)], gemm.CONFIGS[(2048, 5632)], gemm.CONFIGS[(49152, 2048)]
        assert (glu.num_stages, glu.prefetch_tiles) == (3, 2)          # --prefetch-tiles first, then the override
        assert down.split_k == 8 and down.block_k == before[0][(2048, 5632)].block_k
        assert lm.tma is False and qkv_rope.FASTER_UP_TO[(6144, 2048)] == 128
        assert gemm.CONFIGS[(11264, 2048)] == dataclasses.replace(before[0][(11264, 2048)], prefetch_tiles=2)
    finally:
        restore()
    assert (gemm.CONFIGS, gemm.FASTER_UP_TO, gemm.SWIGLU_CONFIGS, qkv_rope.FASTER_UP_TO) == before


@pytest.mark.parametrize("override, message", [
    (("qkv_rope", "tma", True), "qkv_rope_write_kv needs block_n dividing head_dim (128), split_k 1 and no tma"),
    (("qkv_rope", "block_n", 256), "qkv_rope_write_kv needs block_n dividing head_dim"),
    (("swiglu", "split_k", 2), "gemm_swiglu needs split_k == 1"),
    (("o_proj", "num_warps", 3), "GemmConfig.num_warps must be a power of two, got 3"),
])
def test_gemm_config_values_the_launchers_refuse_are_refused_before_anything_runs(override, message):
    from loopbench.runtime.model import PRESETS
    saved = throughput.snapshot_tables()
    try:
        with pytest.raises(ValueError, match=rf"--gemm-config {override[0]}\.{override[1]}=.*{message[:30]}"):
            throughput.apply_gemm_overrides(PRESETS["ouro-1.4b"], [override])
    finally:
        throughput.load_tables(saved)


def test_gemm_config_for_an_unconfigured_shape_or_a_refused_value_names_it(tmp_path, capsys):
    from loopbench.kernels import gemm
    from loopbench.runtime.model import PRESETS
    with pytest.raises(ValueError, match=r"no gate_up configuration for weight shape \(256, 64\)"):
        throughput.apply_gemm_overrides(PRESETS["tiny"], [("gate_up", "num_stages", 3)])
    saved = dict(gemm.CONFIGS)
    try:
        with pytest.raises(ValueError, match=r"--gemm-config down.block_n=48: GemmConfig.block_n must be a power of two"):
            throughput.apply_gemm_overrides(PRESETS["ouro-1.4b"], [("down", "block_n", 48)])
    finally:
        gemm.CONFIGS.clear()
        gemm.CONFIGS.update(saved)
    # the probe itself: exit 2 with the message before anything is written (the tiny preset has no configured
    # shape; its qkv weight is [(4 + 2 * 4) * 16, 64])
    rc = throughput.main(["--cache", str(tmp_path / "c"), "--gemm-config", "qkv.split_k=2"])
    assert rc == 2
    assert "no qkv configuration for weight shape (192, 64)" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    rc = throughput.main(["--cache", str(tmp_path / "c"), "--checkpoint", str(tmp_path / "none"),
                          "--gemm-config", "qkv.split_k=2"])
    assert rc == 2
    assert f"{tmp_path / 'none'}: checkpoint directory does not exist" in capsys.readouterr().err
    # a mistyped --checkpoint alone is named too: never a synthetic model written there and timed under its name
    rc = throughput.main(["--cache", str(tmp_path / "c"), "--checkpoint", str(tmp_path / "none"), "--repeats", "1"])
    assert rc == 2 and not (tmp_path / "none").exists()
    assert f"{tmp_path / 'none'}: checkpoint directory does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        throughput.parse_args(["--preset", "tinyy"])
    assert exc.value.code == 2
    assert "invalid choice: 'tinyy' (choose from 'ouro-1.4b', 'tiny')" in capsys.readouterr().err


def test_prefetch_next_parses_into_the_model_option_and_bad_values_are_argparse_errors(capsys):
    args = throughput.parse_args(["--prefetch-next", "gate_up=0.5,qkv=1", "--prefetch-next", "down=0.25"])
    assert args.prefetch_next == {"gate_up": 0.5, "qkv": 1.0, "down": 0.25}
    assert throughput.parse_args([]).prefetch_next is None
    for argv, message in ((["gate_up"], "'gate_up' is not TARGET=FRACTION"), (["gate_up=half"], "is not TARGET=FRACTION"),
                          (["lm_head=0.5"], "unknown target 'lm_head'"), (["down=1.5"], "must be a fraction in (0, 1]"),
                          (["down=0.5,down=1"], "target 'down' given twice (0.5 and 1)"),
                          (["down=0.5", "--prefetch-next", "down=1"], "target 'down' given twice")):
        with pytest.raises(SystemExit) as exc:
            throughput.parse_args(["--prefetch-next", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_variant_sweep_times_each_variant_in_one_process_and_puts_everything_back(tmp_path, capsys):
    from loopbench.kernels import gemm
    before = dict(gemm.CONFIGS)
    rc = throughput.main([*SMALL, "--cache", str(tmp_path / "c"), "--repeats", "2",
                          "--variant", "", "--variant", "--prefetch-next gate_up=0.5,qkv=1 --prefetch-tiles 2"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("replay [as configured] run ") == 2 and out.count("replay [--prefetch-next") == 3   # + warmup
    assert "| variant | median tok/s | vs 'as configured' | runs | schedule (tokens, exits) |" in out
    assert "| as configured | " in out and " | 1.0000 | 2 | the first's |" in out
    # the prefetch changes no bit, so the second variant's natural run froze the same schedule
    assert out.count(" | the first's |") == 2
    assert gemm.CONFIGS == before
    assert "note: --prefetch-next changes nothing in this run (it needs our small-M GEMM with PDL on an sm_90 GPU)" in \
        err or torch.cuda.is_available()


@pytest.mark.parametrize("argv, message", [
    (["--variant", "--bogus 1"], "unrecognized arguments: --bogus 1"),
    (["--variant", "--prefetch-next lm_head=1"], "unknown target 'lm_head'"),
    (["--variant", "--prefetch-tiles -1"], "must be >= 0, got -1"),
    (["--variant", "", "--policy", "both"], "--variant times replays only"),
])
def test_bad_variants_are_argparse_errors_naming_them(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        throughput.main(["--cache", str(tmp_path / "c"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_variant_override_of_an_unconfigured_shape_exits_2_before_anything_is_written(tmp_path, capsys):
    rc = throughput.main(["--cache", str(tmp_path / "c"), "--variant", "", "--variant", "--gemm-config qkv.split_k=2"])
    assert rc == 2
    assert "--variant '--gemm-config qkv.split_k=2': --gemm-config qkv.split_k: no qkv configuration" in \
        capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def _loader_must_not_run(monkeypatch):
    """The probe's model loader (and the weights' constructor under it) fail the test if called."""
    def never(*a, **kw):
        pytest.fail("the probe loaded a model before refusing its configuration")
    monkeypatch.setattr(throughput, "load", never)
    monkeypatch.setattr(OuroModel, "from_tensors", never)


O_PROJ_NO_GATE_UP = ("o_proj's GemmConfig.prefetch_programs=4 (gemm.CONFIGS[(2048, 2048)]) needs a next-weight "
                     "region, but prefetch_next has no 'gate_up' (the weight o_proj prefetches)")


@pytest.mark.parametrize("argv, message", [
    (["--gemm-config", "o_proj.prefetch_programs=4"], O_PROJ_NO_GATE_UP),
    (["--gemm-config", "o_proj.prefetch_programs=4", "--prefetch-next", "down=0.5,qkv=1"], O_PROJ_NO_GATE_UP),
    (["--gemm-config", "lm_head.prefetch_programs=2", "--prefetch-next", "gate_up=1"],
     "lm_head's GemmConfig.prefetch_programs=2 (gemm.CONFIGS[(49152, 2048)]) needs a next-weight region, and "
     "lm_head has no next weight to prefetch"),
    (["--variant", "", "--variant", "--gemm-config swiglu.prefetch_programs=4"],
     "--variant '--gemm-config swiglu.prefetch_programs=4': swiglu's GemmConfig.prefetch_programs=4 "
     "(gemm.SWIGLU_CONFIGS[(11264, 2048)]) needs a next-weight region, but prefetch_next has no 'down'"),
    # the first variant runs on the probe's own plan (it has gate_up); the second's own plan replaces it
    (["--gemm-config", "o_proj.prefetch_programs=4", "--prefetch-next", "gate_up=0.5",
      "--variant", "", "--variant", "--prefetch-next down=0.5"],
     f"--variant '--prefetch-next down=0.5': {O_PROJ_NO_GATE_UP}"),
])
def test_prefetch_programs_without_their_region_exit_2_before_any_weight_loads(argv, message, tmp_path, capsys,
                                                                              monkeypatch):
    """check_prefetch_programs runs on the probe's configuration (or each variant's tables and plan) right after the
    overrides are applied: one line on stderr, exit 2, no model built, nothing written, the tables put back."""
    _loader_must_not_run(monkeypatch)
    before = throughput.snapshot_tables()
    rc = throughput.main(["--preset", "ouro-1.4b", "--cache", str(tmp_path / "c"), *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {message}"), err
    assert "its extra programs would never be launched" in err
    assert not (tmp_path / "c").exists()
    assert throughput.snapshot_tables() == before


@pytest.mark.parametrize("argv", [
    ["--gemm-config", "o_proj.prefetch_programs=4", "--prefetch-next", "gate_up=0.5"],
    # a variant inherits the probe's plan ...
    ["--prefetch-next", "gate_up=0.5", "--variant", "", "--variant", "--gemm-config o_proj.prefetch_programs=4"],
    # ... and the probe's own configuration, which no variant runs as it is, need not pass on its own
    ["--gemm-config", "o_proj.prefetch_programs=4",
     "--variant", "--prefetch-next gate_up=1", "--variant", "--gemm-config o_proj.prefetch_programs=0"],
])
def test_prefetch_programs_with_their_region_go_on_to_load_the_model(argv, tmp_path, capsys, monkeypatch):
    def loaded(args, device, max_len):
        from loopbench.kernels import gemm
        raise _Loaded(gemm.CONFIGS[(2048, 2048)].prefetch_programs)
    monkeypatch.setattr(throughput, "load", loaded)
    before = throughput.snapshot_tables()
    with pytest.raises(_Loaded):
        throughput.main(["--preset", "ouro-1.4b", "--cache", str(tmp_path / "c"), *argv])
    assert capsys.readouterr().err == ""
    assert throughput.snapshot_tables() == before


def test_gemm_roles_are_the_probes_roles_and_the_models_weight_shapes(tiny_ckpt):
    """runtime/model.py gemm_roles is the one role -> (table, weight shape) map: --gemm-config parses the same role
    names, and its shapes are those of the weights the model holds."""
    from loopbench.kernels import gemm, qkv_rope
    from loopbench.runtime.model import gemm_roles
    cfg, tensors = tiny_ckpt
    roles = gemm_roles(cfg)
    assert set(roles) == set(throughput.GEMM_ROLES)
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.float32)
    w = model.layers[0]
    weights = {"qkv": w.qkv, "qkv_rope": w.qkv, "o_proj": w.o, "gate_up": w.gate_up, "swiglu": w.gate_up,
               "down": w.down, "lm_head": model.lm_head}
    assert {r: g.shape for r, g in roles.items()} == {r: tuple(t.shape) for r, t in weights.items()}
    assert roles["swiglu"].configs is gemm.SWIGLU_CONFIGS and roles["qkv_rope"].faster_up_to is qkv_rope.FASTER_UP_TO


def test_attention_config_parses_through_the_kernels_own_checks(capsys):
    args = throughput.parse_args(["--backend", "triton", "--attention-config", "block_n=64, exit_ahead=false,maxnreg=0"])
    assert args.attention_config == {"block_n": 64, "exit_ahead": False, "maxnreg": 0}
    assert set(throughput.attention_knobs()) == {"block_n", "min_split_tokens", "max_splits", "num_warps", "num_stages",
                                                 "maxnreg", "exit_ahead", "pipe_stages", "early_kv",
                                                 "early_trigger", "prefetch_kv"}
    for argv, message in ((["block_n=48"], "block_n must be a power of two >= 16, got 48"),
                          (["blockn=64"], "'blockn=64' is not KNOB=VALUE with KNOB one of block_n"),
                          (["exit_ahead=maybe"], "exit_ahead must be true or false, got 'maybe'"),
                          (["block_n=64,block_n=32"], "knob 'block_n' given twice"),
                          (["min_split_tokens=16"], "need min_split_tokens >= block_n"),
                          (["num_warps=3"], "num_warps must be None or a power of two, got 3")):
        with pytest.raises(SystemExit) as exc:
            throughput.parse_args(["--backend", "triton", "--attention-config", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--backend", "torch", "--variant", "--attention-config block_n=64"])
    assert "--attention-config needs --backend triton, got torch" in capsys.readouterr().err


def test_attention_config_reaches_every_decode_attention_call_of_the_engine(tiny_ckpt, monkeypatch):
    from loopbench.kernels import decode_attention as da
    from loopbench.runtime.api import EngineConfig
    from loopbench.runtime.engine import LoopEngine
    from loopbench.runtime.model import OuroModel
    calls = []
    monkeypatch.setattr(da, "decode_attention", lambda *a, **kw: calls.append(kw))
    model = OuroModel.from_tensors(*tiny_ckpt)
    engine = LoopEngine(model, EngineConfig(max_model_len=16, attention_backend="triton"))
    assert throughput.with_attention_config(engine, {}) is engine and engine.runner.backend.decode_attention is not None
    throughput.with_attention_config(engine, {"block_n": 64, "exit_ahead": False})
    engine.runner.backend.decode_attention("q", layout="alias")
    assert calls == [{"block_n": 64, "exit_ahead": False, "layout": "alias"}]
    torch_engine = LoopEngine(model, EngineConfig(max_model_len=16, attention_backend="torch"))
    with pytest.raises(ValueError, match="needs the triton attention backend, got 'torch'"):
        throughput.with_attention_config(torch_engine, {"block_n": 64})


def test_greedy_from_logits_is_a_variant_option_left_unset_unless_given():
    assert throughput._variant("--greedy-from-logits").greedy_from_logits is True
    assert throughput._variant("--prefetch-tiles 2").greedy_from_logits is None      # the probe's own setting
    assert throughput.parse_args(["--greedy-from-logits"]).greedy_from_logits is True


def test_norm_in_gemm_is_a_variant_option_left_unset_unless_given():
    assert throughput._variant("--norm-in-gemm").norm_in_gemm is True
    assert throughput._variant("").norm_in_gemm is None                       # the probe's own setting
    assert throughput.parse_args(["--norm-in-gemm"]).norm_in_gemm is True
    assert throughput.parse_args([]).norm_in_gemm is None


def test_norm_record_says_where_the_model_fuses_the_norm_step(tiny_ckpt, monkeypatch):
    """The profile's norm_in_gemm entry asks the model (OuroModel.norm_gemm_config), so the prefetch plan and
    the GEMM tables of the run count: "on", "<role> only", or "off" with why."""
    from types import SimpleNamespace
    from loopbench.kernels import gemm as gm
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    split = gm.GemmConfig(block_n=64, block_k=16, split_k=4, num_stages=1)
    chosen = {"config": split}
    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", lambda configs, faster, w, x, rows: chosen["config"])
    args = SimpleNamespace(max_num_seqs=4)
    assert throughput._norm_record(model, args) == "off"
    model.norm_in_gemm = True
    assert throughput._norm_record(model, args) == "on"
    model.prefetch_next = {"gate_up": 1.0}                 # o_proj prefetches gate_up's weight: it keeps its norm kernel
    assert throughput._norm_record(model, args) == "down only"
    model.prefetch_next = {}
    chosen["config"] = gm.GemmConfig(block_n=64, split_k=4, tma=True)
    assert throughput._norm_record(model, args).startswith("off (")


def test_a_variant_of_one_flag_is_its_value_not_an_option():
    """``--variant --greedy-from-logits`` (one option, no space) is --variant's value, as a quoted list is."""
    args = throughput.parse_args(["--variant", "", "--variant", "--greedy-from-logits"])
    assert [v.greedy_from_logits for v in args.variant] == [None, True]


def test_an_abbreviated_option_is_an_error_naming_it(capsys):
    """``--var X`` is no abbreviation of --variant (nor any prefix of any option): argparse would otherwise take
    ``--var --greedy-from-logits`` as a missing value, and a prefix can come to mean another option."""
    with pytest.raises(SystemExit) as e:
        throughput.parse_args(["--var", "--greedy-from-logits"])
    assert e.value.code == 2
    assert "--var" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--max-num", "8"])


def test_greedy_record_says_off_where_lm_head_cannot_sample_from_tiles():
    """The profile's greedy_tiles entry: "on" only where decode really samples from lm_head's tiles."""
    from types import SimpleNamespace
    lm_head = torch.empty(49152, 2048)

    def stub(greedy_tiles, small_m_gemm):       # the model's own rule (OuroModel.greedy_tiles_config) on a stand-in
        m = SimpleNamespace(greedy_tiles=greedy_tiles, small_m_gemm=small_m_gemm, lm_head=lm_head, dtype=torch.bfloat16)
        m.greedy_tiles_config = lambda rows: throughput.OuroModel.greedy_tiles_config(m, rows)
        return m

    args = SimpleNamespace(backend="triton", max_num_seqs=16)
    model = stub(True, True)
    assert throughput._greedy_record(model, args) == "on"
    assert throughput._greedy_record(model, SimpleNamespace(backend="triton", max_num_seqs=64)).startswith("off (")
    assert throughput._greedy_record(model, SimpleNamespace(backend="torch", max_num_seqs=16)).startswith("off (")
    assert throughput._greedy_record(stub(True, False), args).startswith("off (")
    assert throughput._greedy_record(stub(False, True), args) == "off"


@pytest.mark.parametrize("text, message", [
    ("lm_head:pre=1", "role 'lm_head' is not one of o_proj, down, swiglu"),
    ("qkv:pre=1", "role 'qkv' is not one of o_proj, down, swiglu"),
    ("swiglu:split_k=2", "split_k must be 1, got 2"),
    ("o_proj:block_n=256", "bytes of shared memory a program at 64 rows"),
    ("swiglu:stages=7", "with SwiGLU, more than the 232,448"),
    ("down:bogus=1", "'bogus=1' is not FIELD=VALUE"),
    ("down:stages", "'stages' is not FIELD=VALUE"),
    ("down:stages=x", "stages must be an integer, got 'x'"),
    ("down:pre=7", "WgmmaConfig.pre must be an int in 0..stages (4), got 7"),
    ("down:early_trigger=maybe", "'down:early_trigger=maybe': early_trigger must be true or false, got 'maybe'"),
])
def test_bad_wgmma_options_are_argparse_errors_naming_them(text, message, capsys):
    with pytest.raises(SystemExit):
        throughput.parse_args(["--wgmma", text])
    assert message in capsys.readouterr().err


def test_wgmma_options_fill_and_empty_the_tables_and_are_put_back():
    """--no-wgmma empties kernels/wgmma_gemm.py's tables, then each --wgmma puts one role's configuration in at that
    role's gemm.CONFIGS split (swiglu: its own table, split 1); the probe's restore puts the tables as they were."""
    from loopbench.kernels import wgmma_gemm as wg
    from loopbench.runtime.model import PRESETS
    before = (dict(wg.CONFIGS), dict(wg.SWIGLU_CONFIGS))
    args = throughput.parse_args(["--no-wgmma", "--wgmma", "down:stages=2,pre=1", "--wgmma", "swiglu:early_trigger=1",
                                  "--norm-trigger", "early"])
    restore = throughput.apply_kernel_options(args)
    try:
        from loopbench.kernels import fused_ops
        assert fused_ops.NORM_TRIGGER == "early"
        throughput.apply_wgmma(PRESETS["ouro-1.4b"], args.wgmma, args.no_wgmma)
        assert wg.CONFIGS == {(2048, 5632): wg.WgmmaConfig(split_k=4, stages=2, pre=1)}
        assert wg.SWIGLU_CONFIGS == {(11264, 2048): wg.WgmmaConfig(early_trigger=True)}
    finally:
        restore()
    assert (dict(wg.CONFIGS), dict(wg.SWIGLU_CONFIGS)) == before and fused_ops.NORM_TRIGGER == "late"
    assert throughput._variant("--no-wgmma").no_wgmma is True and throughput._variant("").no_wgmma is None
    assert throughput._variant("--wgmma o_proj:pre=0").wgmma == (("o_proj", (("pre", 0),)),)


def test_a_gemm_override_of_a_projection_on_wgmma_puts_it_back_on_gemm():
    """A --gemm-config field of o_proj / down / swiglu asks for kernels/gemm.py's kernel with it, so that role leaves
    the wgmma tables (it would change nothing there); faster_up_to keeps it; a role given to both options is
    refused."""
    from loopbench.kernels import wgmma_gemm as wg
    from loopbench.runtime.model import PRESETS
    cfg = PRESETS["ouro-1.4b"]
    saved = dict(wg.CONFIGS)
    try:
        throughput.apply_wgmma(cfg, [], gemm_overrides=[("o_proj", "faster_up_to", 16), ("qkv_rope", "block_n", 64)])
        assert wg.CONFIGS == saved
        throughput.apply_wgmma(cfg, [], gemm_overrides=[("o_proj", "split_k", 2)])
        assert (2048, 2048) not in wg.CONFIGS and (2048, 5632) in wg.CONFIGS
        with pytest.raises(ValueError, match=r"--gemm-config down.\* and --wgmma down:... both given"):
            throughput.apply_wgmma(cfg, [("down", (("pre", 1),))], gemm_overrides=[("down", "num_stages", 3)])
    finally:
        wg.CONFIGS.clear()
        wg.CONFIGS.update(saved)


def test_wgmma_record_says_where_the_model_ran_it(tiny_ckpt, monkeypatch):
    """The profile's wgmma entry asks the model (OuroModel.wgmma_config): the projections whose shapes the tables
    hold at these rows, none above wgmma_gemm.MAX_M, none with an L2 prefetch asked for, o_proj / down not where
    their norm step runs in their own launch."""
    from types import SimpleNamespace
    from loopbench.kernels import gemm as gm
    from loopbench.kernels import wgmma_gemm as wg
    cfg, tensors = tiny_ckpt
    model = OuroModel.from_tensors(cfg, tensors, dtype=torch.bfloat16, fused=True)
    monkeypatch.setattr(model, "small_m_gemm", True)
    monkeypatch.setattr(model, "_fused_config", lambda configs, faster, w, x, rows: gm.GemmConfig(split_k=2))
    w = model.layers[0]
    monkeypatch.setattr(wg, "CONFIGS", {tuple(w.o.shape): wg.WgmmaConfig(split_k=2)})
    monkeypatch.setattr(wg, "SWIGLU_CONFIGS", {tuple(w.gate_up.shape): wg.WgmmaConfig()})
    assert throughput._wgmma_record(model, SimpleNamespace(max_num_seqs=16)).startswith("o_proj (WgmmaConfig(")
    assert "swiglu (" in throughput._wgmma_record(model, SimpleNamespace(max_num_seqs=16))
    assert throughput._wgmma_record(model, SimpleNamespace(max_num_seqs=65)) == "off"
    model.prefetch_next = {"gate_up": 1.0, "down": 1.0}     # o_proj and gate_up then prefetch: gemm.py runs them
    assert throughput._wgmma_record(model, SimpleNamespace(max_num_seqs=16)) == "off"
