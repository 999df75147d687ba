"""Which card each session runs on, without a second card (issue 16): simulated CPU devices
(``executor.cpu_devices``) planned and pinned like GPUs, the visibility-mask mapping of a parent started
with a narrowed ``CUDA_VISIBLE_DEVICES`` (on a scripted fake NVML and a faked torch.cuda), and the card
claims that keep two runs off one card."""
import json
import os
import subprocess
import sys
import types

import pytest

from loopbench.harness import bench, cards, conf, machine, telemetry
from loopbench.harness.executors import child_env
from tests.harness.fake_nvml import FakeNVML


def _executor(*overrides: str):
    return conf.validate(conf.compose("cpu-smoke", list(overrides))).executor


# ------------------------------------------------------------------------------ simulated CPU devices

def test_cpu_devices_plan_one_pinned_session_each():
    devices = machine.planned_devices(_executor("executor.cpu_devices=3"))
    assert [(d["name"], d["cpu_index"], d["label"]) for d in devices] == [
        ("cpu0", 0, "cpu #0"), ("cpu1", 1, "cpu #1"), ("cpu2", 2, "cpu #2")]
    assert all(d["kind"] == "cpu" and d["gpu_index"] is None for d in devices)
    # one device: the plan's entry of every CPU bundle so far, unchanged
    assert machine.planned_devices(_executor()) == [
        {"name": "cpu0", "kind": "cpu", "gpu_index": None, "label": "cpu", "cpu_threads": 1}]


@pytest.mark.parametrize("overrides, message", [
    (["executor.cpu_devices=0"], "executor.cpu_devices must be a positive integer, got 0"),
    (["executor.cpu_devices=2", "executor.device=auto"], "needs executor.device=cpu and executor.kind=local, got device=auto"),
    (["executor.cpu_devices=2", "executor.kind=slurm"], "got device=cpu, kind=slurm"),
])
def test_cpu_devices_needs_a_local_cpu_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        _executor(*overrides)


def test_a_simulated_device_child_is_pinned_by_its_environment(monkeypatch):
    monkeypatch.setenv(machine.CPU_DEVICE_ENV, "5")     # inherited from a parent: never passed on
    assert machine.CPU_DEVICE_ENV not in child_env(None)
    env = child_env(None, 1)
    assert env[machine.CPU_DEVICE_ENV] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_child_reports_the_device_its_executor_pinned(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv(machine.CPU_DEVICE_ENV, "1")
        dev = machine.child_device("cpu1", {"kind": "cpu", "cpu_index": 1, "cpu_threads": 1})
        assert (dev["label"], dev["uuid"], dev["gpu_index"]) == ("cpu #1", "CPU-SIM-1", None)
        monkeypatch.setenv(machine.CPU_DEVICE_ENV, "0")
        with pytest.raises(RuntimeError, match="planned on simulated CPU device 1, but its LOOPBENCH_CPU_DEVICE is '0'"):
            machine.child_device("cpu1", {"kind": "cpu", "cpu_index": 1, "cpu_threads": 1})
        monkeypatch.delenv(machine.CPU_DEVICE_ENV)   # a plain CPU session: as before, no identity
        plain = machine.child_device("cpu0", {"kind": "cpu", "gpu_index": None, "cpu_threads": 1})
        assert (plain["label"], plain["uuid"]) == ("cpu", None)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------- visibility masks, fake NVML

@pytest.fixture
def cuda(monkeypatch):
    """A fake NVML of 4 H200s and a torch.cuda that sees as many devices as the mask lists; the card CUDA
    gives a child is the mask's first entry (what a real driver does), reported as its UUID."""
    import torch

    fake = FakeNVML(gpus=4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")

    def visible() -> list[int]:
        import os
        entries = [e for e in os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3").split(",") if e]
        return [int(e) if e.isdigit() else fake.nvmlDeviceGetHandleByUUID(e)[1] for e in entries]

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible()))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        uuid=fake.uuid_of(visible()[i]).removeprefix("GPU-")))   # torch spells it without the prefix
    return fake


def _run_child(monkeypatch, dev: dict) -> dict:
    """``machine.child_device`` in the environment the local executor gives ``dev``'s child."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", child_env(dev["gpu_index"])["CUDA_VISIBLE_DEVICES"])
    return machine.child_device(dev["name"], {"kind": "cuda", "gpu_index": dev["gpu_index"]})


@pytest.mark.parametrize("mask, physical", [("1", [1]), ("1,0", [1, 0]), ("0,1", [0, 1]), ("3,1", [3, 1]),
                                            (None, [0, 1, 2, 3])])
def test_a_narrowed_parent_plans_and_pins_the_physical_cards(cuda, monkeypatch, mask, physical):
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    devices = machine.planned_devices(_executor("executor.device=cuda"))
    assert [(d["name"], d["gpu_index"], d["label"]) for d in devices] == [(f"gpu{g}", g, f"H200 #{g}") for g in physical]
    children = [_run_child(monkeypatch, d) for d in devices]
    assert [(c["gpu_index"], c["uuid"], c["torch"]) for c in children] == [(g, cuda.uuid_of(g), "cuda:0") for g in physical]
    assert len({c["uuid"] for c in children}) == len(physical)


def test_executor_gpus_pick_among_the_masks_cards(cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ValueError, match=r"executor.gpus lists GPU 0, visible GPUs are \[1\]"):
        machine.planned_devices(_executor("executor.device=cuda", "executor.gpus=[0]"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,1")
    assert [d["gpu_index"] for d in machine.planned_devices(_executor("executor.device=cuda", "executor.gpus=[0,2]"))] == [0, 2]


def test_executor_gpus_without_a_visible_gpu_are_refused_not_run_on_the_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"executor.gpus = \[0, 1\] names GPUs, but no CUDA device is visible"):
        machine.planned_devices(_executor("executor.device=auto", "executor.gpus=[0,1]"))
    assert [d["name"] for d in machine.planned_devices(_executor("executor.device=auto"))] == ["cpu0"]


def test_a_mask_of_full_uuids_is_resolved_through_nvml(cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{cuda.uuid_of(2)},{cuda.uuid_of(0)}")
    devices = machine.planned_devices(_executor("executor.device=cuda"))
    assert [d["gpu_index"] for d in devices] == [2, 0]
    assert [_run_child(monkeypatch, d)["uuid"] for d in devices] == [cuda.uuid_of(2), cuda.uuid_of(0)]


@pytest.mark.parametrize("entry", ["MIG-4b5c1a6e-0000-5000-9000-000000000000", "GPU-00000001"])
def test_a_mask_entry_that_names_no_physical_index_is_refused(cuda, monkeypatch, entry):
    """A MIG instance or a UUID prefix: CUDA's own numbering would pin the child to another card."""
    monkeypatch.setattr(machine.telemetry, "index_of_uuid", lambda u: None if u == entry else 0)
    monkeypatch.setattr(sys.modules["torch"].cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)
    with pytest.raises(ValueError, match=f"CUDA_VISIBLE_DEVICES entry '{entry}' names no GPU"):
        machine.planned_devices(_executor("executor.device=cuda"))


def test_a_uuid_mask_without_nvml_is_refused(cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda.uuid_of(1))
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml raises ImportError
    with pytest.raises(ValueError, match="names no GPU by its full UUID"):
        machine.physical_gpus(1)


def test_cuda_stops_at_the_first_index_it_cannot_use():
    assert machine.physical_gpus(1, {"CUDA_VISIBLE_DEVICES": "0,7,1"}) == [0]
    assert machine.physical_gpus(2, {"CUDA_VISIBLE_DEVICES": ""}) == [0, 1]


def test_a_child_whose_card_is_not_nvmls_planned_one_fails(cuda, monkeypatch):
    """CUDA and NVML numbering the cards differently (a CUDA_DEVICE_ORDER other than PCI_BUS_ID): the child
    stops before measuring rather than report another card's UUID."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="runs on card GPU-00000001.*but NVML's GPU 0 is GPU-00000000"):
        machine.child_device("gpu0", {"kind": "cuda", "gpu_index": 0})


# ------------------------------------------------------------------------------------------ card claims

def _gpu(index: int) -> dict:
    return {"name": f"gpu{index}", "kind": "cuda", "gpu_index": index, "label": f"H200 #{index}"}


def test_a_card_another_run_holds_is_refused_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv(cards.LOCK_DIR_ENV, str(tmp_path))
    with cards.claimed([_gpu(1)]):     # the other run (a second flock on its own descriptor conflicts)
        with pytest.raises(cards.CardInUse, match=r"GPU 1 \(H200 #1\) is in use by another loopbench run \(pid \d+\)"):
            cards.claim([_gpu(0), _gpu(1)])
        again = cards.claim([_gpu(0)])   # the refused claim let go of GPU 0 again
        assert len(again) == 1
        cards.release(again)
    fds = cards.claim([_gpu(0), _gpu(1)])      # both free once the other run ended
    assert len(fds) == 2
    cards.release(fds)


def test_cpu_sessions_and_slurm_jobs_claim_no_card(monkeypatch, tmp_path):
    monkeypatch.setenv(cards.LOCK_DIR_ENV, str(tmp_path))
    cpu = machine.cpu_devices(2, 1)
    slurm = {"name": "slurm0", "kind": "cuda", "gpu_index": None, "label": "slurm job 0"}
    assert cards.claim([*cpu, slurm]) == [] and not list(tmp_path.iterdir())


def test_bench_prints_one_line_for_a_card_in_use(monkeypatch, capsys):
    from loopbench.harness import controller

    def busy(spec):
        raise cards.CardInUse("GPU 1 (H200 #1) is in use by another loopbench run (pid 7)")
    monkeypatch.setattr(controller, "run", busy)
    assert bench.task(conf.compose("cpu-smoke")) == 1
    assert capsys.readouterr().err == "loopbench: GPU 1 (H200 #1) is in use by another loopbench run (pid 7)\n"


# ------------------------------------------------------------------------------ on two real GPUs (x2)

_PLAN = ("import json; from loopbench.harness import conf, machine; "
         "print(json.dumps(machine.planned_devices(conf.validate(conf.compose('cpu-smoke', "
         "['executor.device=cuda'])).executor)))")
_CHILD = ("import json, sys; from loopbench.harness import machine; "
          "print(json.dumps(machine.child_device('g', {'kind': 'cuda', 'gpu_index': int(sys.argv[1])})))")


def _python(code: str, env: dict, *args: str):
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [None, "1", "1,0"])
def test_each_gpu_child_reports_its_own_physical_card(mask):
    """The x2 machine: a parent with no mask, or narrowed to ``1`` / ``1,0``, plans the physical cards its
    mask names; each child, pinned the executor's way, reports the UUID NVML gives that card, none twice."""
    import torch

    if torch.cuda.device_count() < 2 or telemetry.device_info(1) is None:
        pytest.skip("needs two GPUs and NVML")
    parent = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    devices = _python(_PLAN, {**parent, **({"CUDA_VISIBLE_DEVICES": mask} if mask else {})})
    want = [int(g) for g in mask.split(",")] if mask else list(range(torch.cuda.device_count()))
    assert [d["gpu_index"] for d in devices] == want
    children = [_python(_CHILD, child_env(d["gpu_index"]), str(d["gpu_index"])) for d in devices]
    assert [c["uuid"] for c in children] == [telemetry.device_info(g)["uuid"] for g in want]
    assert len({c["uuid"] for c in children}) == len(want)


def test_a_run_on_cpu_devices_warns_where_other_work_leaves_fewer_idle_cores_than_its_threads(monkeypatch):
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 0.8)
    one, two = machine.cpu_devices(1, 1), machine.cpu_devices(2, 1)
    gpu = [{"name": "gpu0", "kind": "cuda", "gpu_index": 0, "cpu_threads": 1}]
    assert machine.busy_warning(two) == (      # two sessions of a round run at once: 2 threads, 1.2 cores idle
        "warning: other work keeps 0.8 of the 2 usable cores busy, leaving fewer idle than the run's 2 threads: "
        "CPU timings are for smoke checks, not performance evidence")
    assert machine.busy_warning(machine.cpu_devices(1, 2)) == machine.busy_warning(two)
    assert machine.busy_warning(one) is None and machine.busy_warning(gpu) is None
    # half a core's allowance; a run of more threads than cores is told so, busy machine or not
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 0.4)
    assert machine.busy_warning(two) is None
    for busy in (0.0, 0.4, 1.6):
        monkeypatch.setattr(machine, "busy_cores_now", lambda: busy)
        assert machine.busy_warning(machine.cpu_devices(100, 1)) == machine.busy_warning(machine.cpu_devices(1, 100)) == (
            "warning: the run's 100 threads exceed the 2 usable cores, so they take turns on them and time each "
            "other: CPU timings are for smoke checks, not performance evidence")
    monkeypatch.setattr(machine, "busy_cores_now", lambda: 1.6)
    assert machine.busy_warning(one).startswith("warning: other work keeps 1.6 of the 2 usable cores busy")
    # where no per-core ticks are readable, the 1-minute load average against the usable cores
    monkeypatch.setattr(machine, "busy_cores_now", lambda: None)
    monkeypatch.setattr(machine, "load_average_1m", lambda: 6.5)
    assert machine.busy_warning(one).startswith("warning: the 1-minute load average 6.50 exceeds the 2 usable cores")
    monkeypatch.setattr(machine, "load_average_1m", lambda: 1.5)
    assert machine.busy_warning(one) is None
    monkeypatch.setattr(machine, "load_average_1m", lambda: None)    # an OS without a load average
    assert machine.busy_warning(one) is None


def test_busy_cores_are_the_busy_share_of_the_usable_cores_ticks_over_the_window(tmp_path, monkeypatch):
    """/proc/stat per core: user nice system idle iowait irq softirq steal guest guest_nice (proc(5)); iowait counts
    as idle, guest is already in user, and a core outside the affinity mask (cpu2) does not count."""
    stat = tmp_path / "stat"
    before = "cpu 1 1 1 1 1 1 1 1 1 1\ncpu0 100 5 10 900 3 1 2 0 50 0\ncpu1 50 0 0 900 0 0 1 4 0 0\ncpu2 7 0 0 0 0 0 0 0 0 0\n"
    after = "cpu 9 9 9 9 9 9 9 9 9 9\ncpu0 130 5 20 960 13 1 2 0 70 0\ncpu1 60 0 0 950 39 0 2 13 0 0\ncpu2 99 0 0 0 0 0 0 0 0 0\n"
    stat.write_text(before + "intr 5\n")
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(machine.time, "sleep", lambda s: stat.write_text(after))
    # cpu0: busy +30 user +10 system of 110 ticks (+60 idle, +10 iowait); cpu1: +10 user +1 softirq +9 steal of 109
    assert machine.busy_cores_now(0.2, stat) == pytest.approx(2 * (40 + 20) / (110 + 109))
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 3})    # a core the file lacks
    stat.write_text(before)
    assert machine.busy_cores_now(0.2, stat) is None
    assert machine.busy_cores_now(0.2, tmp_path / "none") is None