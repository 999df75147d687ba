"""The server as a separate process (harness/online/process.py), the online plan and its config rules."""
import os

import httpx
import pytest
import torch

from loopbench.audit import check_online, contract
from loopbench.harness import conf
from loopbench.harness.fixtures import write_synthetic_checkpoint
from loopbench.harness.online.plan import online_order, online_plan
from loopbench.harness.plan import point_entries
from loopbench.harness.online import process
from loopbench.harness.online.process import ServerFailed, ServerProcess

ARM = {"kv_layout": "native", "prefix_tiles": False, "attention_backend": "torch", "cuda_graphs": False,
       "graph_cache_size": 16, "descriptor_mode": "h2d", "block_size": 16, "tile_size": 32,
       "engine": "loopbench.runtime.engine:LoopEngine"}


def _spec(checkpoint: str) -> dict:
    return {"checkpoint_path": checkpoint, "dtype": "float32", "device": {"kind": "cpu", "gpu_index": None, "cpu_threads": 1},
            "arm_config": ARM, "max_num_seqs": 2, "max_model_len": 64, "policy": "ouro",
            "exit": {"min_loops": 1, "max_loops": 4, "threshold": 0.55}, "host": "127.0.0.1"}


def test_the_server_process_starts_healthy_on_127_0_0_1_and_stops_cleanly(tmp_path):
    ckpt = write_synthetic_checkpoint(tmp_path / "tiny", "tiny", seed=0, dtype=torch.float32)
    server = ServerProcess(_spec(str(ckpt)), tmp_path / "server.log", health_timeout_s=120)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        assert server.health()["status"] == "ok"
        settings = server.engine_settings()          # what an online record's engine_settings holds (format 10)
        assert settings["kv_layout"] == "native" and settings["max_num_seqs"] == 2 and settings["exit_policy"] == "ouro"
        out = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60).json()
        assert len(out["choices"][0]["token_ids"]) == 4
    finally:
        code = server.stop()
    assert code == 0                                  # SIGTERM: uvicorn's graceful shutdown
    assert "serving on http://127.0.0.1:" in (tmp_path / "server.log").read_text()


def test_a_server_that_crashes_fails_with_its_log_tail(tmp_path):
    server = ServerProcess(_spec(str(tmp_path / "no-such-checkpoint")), tmp_path / "server.log", health_timeout_s=120)
    with pytest.raises(ServerFailed, match="the server ended before it was healthy, exit code 1; last lines of") as err:
        server.start()
    assert "no-such-checkpoint" in str(err.value)       # the traceback's last lines, from the server's log


def test_the_online_order_is_balanced_and_the_auditor_derives_the_same():
    order = online_order((0.5, 1.0), 4, "native", "alias_prefix", order_seed=3)
    assert order[0]["kind"] == "calibration" and order[0]["arm"] == "native"
    assert [o["seq"] for o in order] == list(range(len(order))) and len(order) == 1 + 2 * 4 * 2
    for ri in (0, 1):
        firsts = [o["position"] for o in order if o["rate_index"] == ri and o["slot"] == 0]
        assert sorted(firsts) == ["baseline", "baseline", "candidate", "candidate"]
    on = {"baseline": "native", "candidate": "alias_prefix", "pairs": 4, "rates": {"multiples": [0.5, 1.0]}}
    assert check_online.expected_order(on, 3, contract.VERSION) == order
    # format 14's rule (numpy's permutation) puts another arm first in some pair here: the rules are not alike
    assert check_online.expected_order(on, 3, contract.DOCS["plan"]["order_rule_since"] - 1) != order


@pytest.mark.parametrize("override, words", [
    ("online.num_requests=17", "online.num_requests = 17 exceeds the 16 requests of point B4C16"),
    ("online.slo_ttft_s=0.5", "online.slo_ttft_s and online.slo_tpot_s are set together"),
    ("online.candidate=alias", "online.candidate = 'alias' is not an arm"),
    ("online.rates=[]", "online.rates must list at least one multiple"),
    ("online.rates=[0.5,-1.0]", "online.rates[1] must be a positive finite number, got -1.0"),
    ("online.rates=[1.0,0.5,1.0]", "online.rates[2] = 1.0 is listed twice: [1.0, 0.5, 1.0]"),
    ("online.max_duration_s=inf", "online.max_duration_s must be a positive finite number, got inf"),
    ("online.point=B9C9", "online.point = 'B9C9' is not a point of this run"),
    # an empty name is a bad one, not the default (it read as null)
    ("online.point=''", "online.point = '' is not a point of this run"),
    ("online.candidate=''", "online.candidate = '' is not an arm"),
    ("online.baseline=''", "online.baseline = '' is not an arm"),
])
def test_bad_online_config_is_named(override, words):
    with pytest.raises(ValueError, match=None) as err:
        conf.validate(conf.compose("cpu-online", [override]))
    assert words in str(err.value)


def test_one_token_requests_need_a_declared_slo():
    """A request of one token has no TPOT, so a calibration run of them derives no SLO: refused before anything
    runs (it crashed the publish after every online run had been measured); a declared SLO serves them."""
    with pytest.raises(ValueError) as err:
        conf.validate(conf.compose("cpu-online", ["workload.output_len=1"]))
    assert "workload.output_len = 1 gives requests of one token, which have no TPOT" in str(err.value)
    assert "online.slo_ttft_s and online.slo_tpot_s" in str(err.value)
    spec = conf.validate(conf.compose("cpu-online", ["workload.output_len=1", "online.slo_ttft_s=0.5",
                                                     "online.slo_tpot_s=0.1"]))
    assert spec.online.slo_ttft_s == 0.5


def test_an_online_point_with_its_own_prompt_and_output_length_serves_that_points_requests():
    """A point that sets its own P and D is keyed B..C..P..D (as plan.json and `loopbench plan` key it): the online
    track takes that key (it was refused as not a point, and the default key of a D-only first point crashed the
    plan with StopIteration after the reference capture) and serves the point's own prompts and D tokens, those
    its frozen reference holds; the auditor expects the same requests."""
    points = "points=[{max_num_seqs:4,num_requests:16},{max_num_seqs:2,num_requests:8,prompt_len:20,output_len:8}]"
    spec = conf.validate(conf.compose("cpu-online", [points, "online.point=B2C8P20D8", "online.num_requests=8"]))
    devices = [{"name": "cpu0"}]
    on = online_plan(spec, devices)
    assert (on["point"], on["max_num_seqs"], on["max_tokens"]) == ("B2C8P20D8", 2, 8)
    pt = next(p for p in point_entries(spec) if p["key"] == "B2C8P20D8")
    assert [(r["prompt_index"], r["reference_request_id"]) for r in on["requests"]] == \
        [(r["prompt_index"], r["request_id"]) for r in pt["requests"]]
    assert on["requests"][0]["prompt_index"] == 16        # the point's block of the pool, after the workload's 16
    assert check_online.expected_requests(on, pt) == on["requests"]
    first_d = conf.validate(conf.compose("cpu-online", ["points=[{max_num_seqs:4,num_requests:16,output_len:8}]"]))
    assert online_plan(first_d, devices)["point"] == "B4C16D8" and online_plan(first_d, devices)["max_tokens"] == 8
    with pytest.raises(ValueError, match=r"points\[B4C16D1\].output_len = 1 gives requests of one token"):
        conf.validate(conf.compose("cpu-online", ["points=[{max_num_seqs:4,num_requests:16,output_len:1}]"]))


def test_the_online_defaults_fill_in_from_the_first_point_and_comparison():
    spec = conf.validate(conf.compose("cpu-online"))
    assert (spec.online.point, spec.online.baseline, spec.online.candidate) == ("B4C16", "native", "alias_prefix")
    assert "online" not in conf.validate(conf.compose("cpu-smoke")).to_plain()   # plans without the track unchanged


def test_an_online_run_whose_server_crashes_fails_with_the_servers_log_tail(tmp_path):
    from loopbench.harness.online import arms

    plan = {"checkpoint": {"path": str(tmp_path / "missing")}, "max_model_len": 64,
            "config": {"model": {"dtype": "float32"}, "arms": {"native": ARM},
                       "exit": {"policy": "ouro", "min_loops": 1, "max_loops": 4, "threshold": 0.55}},
            "online": {"max_num_seqs": 2, "health_timeout_s": 120, "requests": [], "max_tokens": 4,
                       "warmup_requests": 0, "max_duration_s": 10, "calibration": {"concurrency": 2}}}
    job = {"name": "cpu0", "device": {"kind": "cpu", "gpu_index": None, "cpu_threads": 1}}
    item = {"seq": 0, "kind": "calibration", "arm": "native", "rate_index": None, "rate_multiple": None,
            "pair": None, "position": None, "slot": None}
    with pytest.raises(ServerFailed, match="the server ended before it was healthy, exit code 1") as err:
        arms.run_item(plan, job, item, [], None, tmp_path / "online")
    assert (tmp_path / "online" / "00000-calibration-native.log").is_file() and "missing" in str(err.value)
    assert not (tmp_path / "online" / "00000-calibration-native.json").exists()   # no record of a failed run


def test_an_online_run_sends_every_warmup_request_it_records_even_past_the_traces_length(tmp_path):
    """``warmup_requests`` larger than the trace: the record says 5 warmup requests, and the server accepted 5 besides
    the trace's 2 (it sent only the trace's 2 again, so a run asking for more warmup than requests got less than its
    record claims)."""
    rec = _calibrate_two_requests(tmp_path, warmup_requests=5)
    assert rec["warmup_requests"] == 5 and [q["error"] for q in rec["requests"]] == [None, None]
    assert (rec["server"]["health"]["accepted"], rec["server"]["health"]["completed"]) == (7, 7)


def _calibrate_two_requests(tmp_path, warmup_requests: int) -> dict:
    """The record of a calibration run of two requests on a fresh tiny server, after ``warmup_requests``."""
    from loopbench.harness.online import arms

    ckpt = write_synthetic_checkpoint(tmp_path / "tiny", "tiny", seed=0, dtype=torch.float32)
    plan = {"checkpoint": {"path": str(ckpt)}, "max_model_len": 64,
            "config": {"model": {"dtype": "float32"}, "arms": {"native": ARM},
                       "exit": {"policy": "ouro", "min_loops": 1, "max_loops": 4, "threshold": 0.55}},
            "online": {"point": "B2C2", "max_num_seqs": 2, "health_timeout_s": 120, "max_tokens": 3,
                       "requests": [{"index": i, "prompt_index": i} for i in range(2)],
                       "warmup_requests": warmup_requests, "max_duration_s": 60, "calibration": {"concurrency": 2}}}
    job = {"name": "cpu0", "device": {"kind": "cpu", "gpu_index": None, "cpu_threads": 1}}
    item = {"seq": 0, "kind": "calibration", "arm": "native", "rate_index": None, "rate_multiple": None,
            "pair": None, "position": None, "slot": None}
    return arms.run_item(plan, job, item, [[1, 2, 3], [4, 5, 6, 7]], None, tmp_path / "online")


def test_a_failed_warmup_request_fails_the_online_run_naming_it(tmp_path, monkeypatch):
    """The second of three warmup requests fails (the server answered it, the client marks it failed): no timed run
    on a server whose warmup failed, and no record that would present one as measured after a warmup."""
    from loopbench.harness.online import arms, loadgen

    closed_loop = loadgen.closed_loop

    async def warmup_fails(url, jobs, concurrency, max_duration_s):
        start, results = await closed_loop(url, jobs, concurrency, max_duration_s)
        if jobs[0].index < 0:   # the warmup's requests (index -1 - i); the calibration run's are the trace's
            results[1].error = "HTTP 503: the server was overloaded"
        return start, results
    monkeypatch.setattr(loadgen, "closed_loop", warmup_fails)
    with pytest.raises(arms.WarmupFailed, match=r"online run 00000-calibration-native: 1 of 3 warmup requests failed"
                                                r".*warmup request 1 \(prompt 1\): HTTP 503: the server was overloaded"):
        _calibrate_two_requests(tmp_path, warmup_requests=3)
    assert not (tmp_path / "online" / "00000-calibration-native.json").exists()


def test_a_server_that_crashes_while_starting_leaves_no_temporary_files(tmp_path):
    server = ServerProcess(_spec(str(tmp_path / "no-such-checkpoint")), tmp_path / "server.log", health_timeout_s=120)
    tmp = server._tmp.name
    with pytest.raises(ServerFailed):
        server.start()
    assert server.exit_code == 1 and not os.path.exists(tmp)


def test_a_ctrl_c_while_the_server_starts_stops_it(tmp_path, monkeypatch):
    ckpt = write_synthetic_checkpoint(tmp_path / "tiny", "tiny", seed=0, dtype=torch.float32)
    server = ServerProcess(_spec(str(ckpt)), tmp_path / "server.log", health_timeout_s=120)
    tmp = server._tmp.name

    real_sleep, calls = process.time.sleep, []

    def interrupted(seconds):           # the first wait for health; later sleeps (the stop's wait) are real
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)
    monkeypatch.setattr(process.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert server.proc is not None and server.proc.poll() is not None    # reaped, not left to run on
    assert not os.path.exists(tmp)
