"""Sessions against the runtime: a captured reference replays exactly, twice on one engine."""
import json
import re
import signal
from dataclasses import replace

import pytest
import torch

from loopbench.harness import engines, machine, session
from loopbench.harness.fixtures import write_synthetic_checkpoint
from loopbench.harness.records import ArmSpec

CPU = {"kind": "cpu", "torch": "cpu", "gpu_index": None, "label": "cpu", "name": "cpu", "uuid": None}
EXIT = {"policy": "ouro_delayed", "threshold": 0.5, "min_loops": 2, "max_loops": 4}
ARM = ArmSpec(kv_layout="native", prefix_tiles=False, attention_backend="torch", cuda_graphs=False,
              graph_cache_size=16, descriptor_mode="h2d", block_size=16, tile_size=32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, dtype=torch.float32)
    return session.load_model(str(path), "float32", CPU, max_model_len=64)


def test_reference_replays_exactly_in_warmup_and_measured_runs(model):
    from loopbench.runtime.engine import LoopEngine

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (5, 33), generator=g).tolist()
    reqs = session.build_requests(prompts, 5, 8, EXIT)
    assert [r.request_id for r in reqs] == ["r0000", "r0001", "r0002", "r0003", "r0004"]
    natural = session.build_engine(ARM, model, 3, 64, "ouro_delayed")
    assert isinstance(natural, LoopEngine)        # the default engine
    ref = session.run_phase(natural, reqs, CPU).to_dict()
    schedule = natural.capture_schedule()
    assert ref["elapsed_s"] > 0 and ref["memory"]["peak_allocated_bytes"] is None
    assert {len(o["token_ids"]) for o in ref["outputs"].values()} == {8}
    for arm in (ARM, replace(ARM, kv_layout="alias"), replace(ARM, kv_layout="alias", prefix_tiles=True)):
        eng = session.build_engine(arm, model, 3, 64, "replay", schedule)
        warm = session.run_phase(eng, reqs, CPU).to_dict()
        eng.reset_run()
        meas = session.run_phase(eng, reqs, CPU).to_dict()
        settings = engines.engine_settings(eng)      # what a record's engine_settings holds (format 9)
        assert settings["exit_policy"] == "replay" and settings["schedule_sha256"] == schedule.sha256
        assert (settings["kv_layout"], settings["prefix_tiles"]) == (arm.kv_layout, arm.prefix_tiles)
        for run in (warm, meas):
            assert run["outputs"] == ref["outputs"]
            assert run["work"] == ref["work"]           # per-run counters, not the engine's running totals
            assert run["trace_sha256"] == schedule.trace_sha256
            assert run["graphs"]["captures"] == run["graphs"]["replays"] == run["graphs"]["fallbacks"] == 0


class _Reports:
    """An object with a ``settings()`` returning ``value`` (enough for engines.engine_settings)."""

    def __init__(self, value):
        self.value = value

    def settings(self):
        return self.value


@pytest.mark.parametrize("value", [{"a": "x|y"}, {"a|b": 1}, {"a": "two\nlines"}, {"a\u2028b": None}])
def test_settings_that_would_break_the_reports_table_are_refused_before_a_record(value):
    with pytest.raises(ValueError, match=re.escape("which report.md's Runtime settings table cannot show")):
        engines.engine_settings(_Reports(value))


@pytest.mark.parametrize("value, named", [
    ([("a", 1)], "_Reports.settings() returned list, not a dict of JSON scalars"),
    ({"a": [1]}, "_Reports.settings()['a'] is [1], not a JSON scalar"),
    ({"a": float("inf")}, "_Reports.settings()['a'] is inf, not a JSON scalar"),
    ({1: True}, "_Reports.settings() has the key 1, not a string")])
def test_settings_that_are_no_flat_dict_of_json_scalars_are_refused_before_a_record(value, named):
    with pytest.raises(TypeError, match=re.escape(named)):
        engines.engine_settings(_Reports(value))
    assert engines.engine_settings(_Reports({"a": None, "b": 0.5})) == {"a": None, "b": 0.5}
    assert engines.engine_settings(object()) is None     # an engine without settings()


def test_cpu_device_and_thread_setting():
    threads = torch.get_num_threads()
    try:
        dev = machine.child_device("cpu0", {"kind": "cpu", "gpu_index": None, "cpu_threads": 1})
        assert dev["label"] == "cpu" and dev["gpu_index"] is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_too_few_prompts_is_refused():
    with pytest.raises(ValueError, match="pool has 1 prompts, the point needs 2"):
        session.build_requests([[1, 2]], 2, 4, EXIT)


def test_reference_cache_key_depends_on_device_and_inputs():
    a = session.reference_cache_key({"x": 1}, CPU)
    assert a == session.reference_cache_key({"x": 1}, dict(CPU))
    assert a != session.reference_cache_key({"x": 2}, CPU)
    assert a != session.reference_cache_key({"x": 1}, {**CPU, "name": "H200"})
    json.dumps(a)


# ----------------------------------------------------------------- what the measured time covers

class _FakeDevice:
    """A fake clock and an asynchronous fake device: every event is recorded in order.

    Engine construction costs 1000 s of host time; each engine step enqueues 1 s of device work that
    the clock sees only once the device is synchronised. So a timed region that included construction,
    or read its stop clock before synchronising, would measure something other than the steps' seconds.
    """

    CONSTRUCT_S = 1000.0
    STEP_S = 1.0

    def __init__(self):
        self.now, self.pending, self.events = 0.0, 0.0, []

    def perf_counter(self) -> float:
        self.events.append(("clock", self.now))
        return self.now

    def wall(self) -> float:
        self.events.append(("wall", self.now))
        return 1.7e9 + self.now

    def sync(self, *args) -> None:
        self.now += self.pending
        self.pending = 0.0
        self.events.append(("sync", self.now))


def _fake_engine(dev: _FakeDevice):
    """An ``Engine`` (runtime/api.py) whose every call is an event on ``dev``, built by a factory."""
    from types import SimpleNamespace

    from loopbench.runtime.api import EngineStats

    class FakeEngine:
        def __init__(self, model, config):
            dev.now += dev.CONSTRUCT_S
            dev.events.append(("construct", dev.now))
            self.queue = []
            self.stats, self.trace_sha256 = EngineStats(rows_per_depth=[0, 0]), "t"

        def add_request(self, req):
            dev.events.append(("submit", dev.now))
            self.queue.append(req)

        def abort(self, request_id):
            raise AssertionError("the session never aborts")

        def run(self):
            for _ in range(len(self.queue) + 1):       # prefill, then one decode step per request
                self.stats.steps += 1
                self.stats.rows_per_depth[0] += 1
                dev.pending += dev.STEP_S
                dev.events.append(("step", dev.now))
            dev.events.append(("drain", dev.now))
            out = {r.request_id: SimpleNamespace(token_ids=[1] * r.max_tokens, exit_depths=[3] * r.max_tokens,
                                                 finish_reason="length") for r in self.queue}
            self.queue = []
            return out

        def capture_schedule(self):
            raise NotImplementedError

        def reset_run(self):
            dev.events.append(("reset", dev.now))

    return FakeEngine


def _phases(events: list) -> list[list[str]]:
    """The event names between each pair of perf_counter reads (start clock, stop clock)."""
    clocks = [i for i, (name, _) in enumerate(events) if name == "clock"]
    assert len(clocks) % 2 == 0
    return [[name for name, _ in events[a + 1:b]] for a, b in zip(clocks[::2], clocks[1::2])]


def test_measured_time_covers_submission_to_synchronised_drain_only(tmp_path, monkeypatch):
    """A slow engine constructor and an asynchronous device (fake, with a recorded call order): each
    phase's elapsed_s is exactly its steps' device seconds, construction lies outside every timed region,
    the device is synchronised before the stop clock, and the record's wall-clock span encloses it."""
    dev = _FakeDevice()
    from loopbench.runtime.schedule import Schedule

    fake = _fake_engine(dev)
    monkeypatch.setattr(session.engines, "load_factory", lambda path: fake if path == "test:fake" else None)
    monkeypatch.setattr(session, "load_model", lambda *a: None)
    monkeypatch.setattr(session, "arm_coverage", lambda *a: lambda point, arm: {})   # a fake schedule has no rows
    monkeypatch.setattr(session.machine, "child_device", lambda name, device: {
        **CPU, "kind": "cuda", "torch": "cuda:0", "gpu_index": 0, "label": "GPU #0"})
    monkeypatch.setattr(session.telemetry, "sample", lambda index: None)
    monkeypatch.setattr(session, "write_ceiling", lambda job, device: None)   # a real copy on the fake CUDA device
    monkeypatch.setattr(session.time, "perf_counter", dev.perf_counter)
    monkeypatch.setattr(session.time, "time", dev.wall)
    monkeypatch.setattr(torch.cuda, "synchronize", dev.sync)
    for name in ("reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3]] * 3))
    (tmp_path / "ref.json").write_text(Schedule(version=Schedule.FORMAT_VERSION, max_num_seqs=2, admission_order=(),
                                                requests=(), num_steps=0, trace_sha256="t").to_json())
    item = {"seq": 0, "point": "B2C3", "comparison": "c", "pair": 0, "position": "baseline", "slot": 0,
            "arm": "native"}
    plan = {"config": {"model": {"dtype": "float32"}, "workload": {"output_len": 4}, "exit": EXIT,
                       "arms": {"native": replace(ARM, engine="test:fake").to_plain()}, "warmup": True, "fault": {"kill_after_arms": None}},
            "prompts": {"file": "prompts.json"}, "max_model_len": 8, "checkpoint": {"path": "unused"},
            "points": [{"key": "B2C3", "max_num_seqs": 2, "num_requests": 3, "reference": {"file": "ref.json"}}],
            "order": {"gpu0": [item, {**item, "seq": 1, "position": "candidate", "slot": 1}]}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    # a session that recorded all it was asked ignores SIGTERM from then on (session._job_recorded): put this
    # process back, or every later test's children would inherit SIG_IGN and end by SIGKILL when stopped
    monkeypatch.setitem(session._STOPS, "recorded", False)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        session.measure({"name": "gpu0", "bundle": str(tmp_path), "device": {"kind": "cuda", "gpu_index": 0}})
    finally:
        signal.signal(signal.SIGTERM, sigterm)

    names = [name for name, _ in dev.events]
    assert names.count("construct") == 2
    phases = _phases(dev.events)
    assert len(phases) == 4                       # warmup and measured run of two arms
    steps_s = (3 + 1) * dev.STEP_S               # 3 requests: prefill + 3 decode steps per phase
    for inside in phases:
        assert "construct" not in inside
        assert inside[:3] == ["submit"] * 3 and set(inside[3:-2]) == {"step"}
        assert inside[-2:] == ["drain", "sync"]   # drained, then synchronised, then the stop clock
    clocks = [i for i, name in enumerate(names) if name == "clock"]
    for start in clocks[::2]:                      # no earlier device work leaks into a timed region
        assert names[start - 1] == "sync"
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "raw" / "gpu0").glob("*.json"))]
    assert len(records) == 2
    for rec in records:
        for phase in ("warmup", "measured"):
            assert rec[phase]["elapsed_s"] == steps_s
        span = rec["wall_clock"]["measured_end_unix_s"] - rec["wall_clock"]["measured_start_unix_s"]
        assert span >= rec["measured"]["elapsed_s"]
        assert rec["engine_settings"] is None          # an Engine without the optional settings()
    walls = [i for i, name in enumerate(names) if name == "wall"]
    assert walls[0] < clocks[2] < clocks[3] < walls[1]   # the first arm's measured run inside its span


def test_a_session_stopped_by_sigterm_ends_by_the_signal(tmp_path):
    """The child unwinds (no half-written record), then ends by SIGTERM itself: its parent sees returncode
    -15, recorded and worded as "killed by SIGTERM (15)", never the shell's 143."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = ("import os, signal, sys, time\n"
            "from loopbench.harness import session\n"
            "def job(path):\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(30)\n"
            "    finally:\n"
            "        print('unwound', flush=True)\n"
            "session.run_job = job\n"
            "sys.exit(session.main(['job.json']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == -15, proc.stdout + proc.stderr
    assert "unwound" in proc.stdout and "SIGTERM: stopping" in proc.stdout + proc.stderr


_SESSION_STOPPED_AT = (
    "import json, os, signal, sys\n"
    "from pathlib import Path\n"
    "from types import SimpleNamespace\n"
    "from loopbench.harness import session\n"
    "from loopbench.harness.online import arms as online_arms\n"
    "AT = sys.argv[1]   # where the SIGTERM lands: 'after_last_record' or 'in_last_arm'\n"
    "order = [SimpleNamespace(seq=i, file_name=f'{i:03d}.json') for i in range(3)]\n"
    "def measure_arm(s, item, covered):\n"
    "    if AT == 'in_last_arm' and item is order[-1]:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return SimpleNamespace(to_dict=lambda: {'seq': item.seq})\n"
    "write = session.atomic_write_json\n"
    "def atomic_write_json(path, data):\n"
    "    write(path, data)\n"
    "    if AT == 'after_last_record' and data == {'seq': order[-1].seq}:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)   # the controller's stop, as the last record lands\n"
    "session.load_session = lambda job: SimpleNamespace(order=order, device={}, frozen={}, model=None, plan={},\n"
    "                                                   config={'arms': {}, 'fault': {'kill_after_arms': None}})\n"
    "session.write_ceiling = lambda job, device: None\n"
    "session.arm_coverage = lambda frozen, arms, model: None\n"
    "session.measure_arm = measure_arm\n"
    "session.atomic_write_json = atomic_write_json\n"
    "session.arm_log_line = lambda item, rec: f'arm {item.seq}'\n"
    "online_arms.measure_online = lambda job, log, plan: None\n"
    "sys.exit(session.main(['job.json']))\n")


@pytest.mark.parametrize("at", ["after_last_record", "in_last_arm"])
def test_a_stop_after_the_last_record_lets_the_session_complete_and_one_before_it_does_not(tmp_path, at):
    """A SIGTERM that reached a session after it had written its last arm record but before it exited ended it by
    the signal (-15): the controller recorded it interrupted, and a bundle of every planned arm was published
    incomplete. With everything recorded the session now ends normally (0, which the controller keeps completed);
    a stop during its last arm still ends it by the signal, that arm unrecorded."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "jobs").mkdir()
    (tmp_path / "job.json").write_text(json.dumps({"kind": "session", "name": "cpu0", "bundle": str(tmp_path)}))
    proc = subprocess.run([sys.executable, "-c", _SESSION_STOPPED_AT, at], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    out = proc.stdout + proc.stderr
    recorded = sorted(p.name for p in (tmp_path / "raw" / "cpu0").iterdir())
    logged = re.findall(r"\] (arm \d+)$", proc.stdout, re.M)
    if at == "after_last_record":
        assert proc.returncode == 0, out
        assert recorded == ["000.json", "001.json", "002.json"] and logged == ["arm 0", "arm 1", "arm 2"], out
    else:
        assert proc.returncode == -15, out
        assert recorded == ["000.json", "001.json"] and logged == ["arm 0", "arm 1"], out
        assert "SIGTERM: stopping" in out
