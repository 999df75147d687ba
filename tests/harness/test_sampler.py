"""The NVML sampler and the per-arm telemetry figures, on a scripted fake pynvml (no GPU here): its rate,
energy per token, the throttle and clock-change flags, no NVML at all, and the physical GPU index of a
session whose CUDA_VISIBLE_DEVICES is narrowed to one GPU."""
import sys
import time

import pytest

from loopbench.audit import check_telemetry
from loopbench.harness import machine, telemetry
from loopbench.harness.sampler import Sampler
from tests.harness.fake_nvml import FakeNVML


@pytest.fixture
def nvml(monkeypatch):
    def install(**script) -> FakeNVML:
        fake = FakeNVML(**script)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake
    return install


def _record(samples, start, end, C=4, D=8) -> dict:
    """The parts of a raw arm record the telemetry figures read."""
    return {"num_requests": C, "output_len": D,
            "telemetry": {"start": start, "end": end, "samples": samples, "sampler": {"cpu_s": 0.002}}}


def _sample_for(seconds: float, index: int = 0, hz: float = 50.0) -> tuple[Sampler, list[dict]]:
    s = Sampler(index, hz).start()
    time.sleep(seconds)
    return s, s.stop()


def test_sampler_reaches_its_rate_and_both_derivations_agree(nvml):
    nvml()
    sampler, samples = _sample_for(0.4, hz=50.0)
    assert sampler.active and len(samples) >= 8     # 50 Hz for 0.4 s is ~21 readings; a busy box gives fewer
    summary = telemetry.arm_summary(_record(samples, None, None))
    assert summary["sample_rate_hz"] >= 10 and summary["telemetry_samples"] == len(samples)
    assert summary["mean_power_w"] == 450.0 and summary["throttled"] is False and summary["clock_changed"] is False
    assert sampler.record()["samples"] == len(samples) and sampler.record()["cpu_s"] >= 0
    assert check_telemetry.arm_columns(_record(samples, None, None)) == summary


def test_energy_per_token_is_the_counter_delta_over_c_times_d(nvml):
    nvml(energy_mj=lambda k: [2_000_000, 2_003_200][k])
    start, end = telemetry.sample(0), telemetry.sample(0)
    assert (start["energy_mj"], end["energy_mj"]) == (2_000_000, 2_003_200)
    summary = telemetry.arm_summary(_record([], start, end, C=4, D=8))
    assert summary["energy_j"] == pytest.approx(3.2) and summary["joules_per_token"] == pytest.approx(3.2 / 32)
    assert summary["telemetry_samples"] is None and summary["throttled"] is None   # no samples: no flags


def test_a_throttle_reason_other_than_idle_is_flagged(nvml):
    nvml(reasons=lambda k: 0x1)                       # idle only: not a throttle
    _, idle = _sample_for(0.15)
    assert telemetry.arm_summary(_record(idle, None, None))["throttled"] is False
    nvml(reasons=lambda k: 0x1 | (0x4 if k == 2 else 0))   # SW power cap in one reading
    _, capped = _sample_for(0.15)
    s = telemetry.arm_summary(_record(capped, None, None))
    assert s["throttled"] is True and s["throttle_reasons_seen"] == 0x4


def test_an_sm_or_memory_clock_change_inside_the_run_is_flagged(nvml):
    nvml(sm=lambda k: 1980 if k < 3 else 1755)
    _, samples = _sample_for(0.2)
    s = telemetry.arm_summary(_record(samples, None, None))
    assert s["clock_changed"] is True and (s["min_sm_clock_mhz"], s["max_sm_clock_mhz"]) == (1755, 1980)
    nvml(mem=lambda k: 3201 if k < 2 else 2619)
    _, samples = _sample_for(0.2)
    assert telemetry.arm_summary(_record(samples, None, None))["clock_changed"] is True


def test_without_nvml_nothing_is_sampled_and_every_figure_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml raises ImportError
    sampler, samples = _sample_for(0.05)
    assert not sampler.active and samples == [] and telemetry.sample(0) is None
    assert set(telemetry.arm_summary(_record(samples, None, None)).values()) == {None}
    assert Sampler(None, 20.0).start().stop() == []   # a CPU session: no GPU index at all
    with pytest.raises(ValueError, match="sample_hz"):
        Sampler(0, 0.0)


def test_narrowed_cuda_visible_devices_samples_the_physical_gpu(nvml, monkeypatch):
    """A SLURM job pinned to physical GPU 3: CUDA sees it as cuda:0, NVML is asked for index 3."""
    fake = nvml()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    dev = machine.child_device("cuda3", {"kind": "cuda", "gpu_index": None})
    assert dev["gpu_index"] == 3 and dev["torch"] == "cuda:0"
    fake.handles.clear()
    _sample_for(0.05, index=dev["gpu_index"])
    assert fake.handles and set(fake.handles) == {3}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")   # a local session: the plan names the physical index
    assert machine.child_device("cuda5", {"kind": "cuda", "gpu_index": 5})["gpu_index"] == 5


def test_throughput_probe_measures_the_samplers_cost(nvml, monkeypatch, tmp_path, capsys):
    """`--telemetry ab`: each repeat times the replay with the sampler off and on, order alternating; the
    probe prints the on / off ratio and CPU per sample (the command the lead runs on the H200)."""
    from loopbench.harness import throughput

    nvml()
    monkeypatch.setattr(throughput, "gpu_index", lambda: 0)
    rc = throughput.main(["--preset", "tiny", "--max-num-seqs", "2", "--num-requests", "2", "--prompt-len", "4",
                          "--output-len", "3", "--repeats", "2", "--cache", str(tmp_path / "c"), "--telemetry", "ab"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.index("run 1 telemetry off") < out.index("run 1 telemetry on") < out.index("run 2 telemetry on") \
        < out.index("run 2 telemetry off")
    assert "telemetry on/off throughput ratio" in out and "us CPU per sample" in out and " samples, " in out


@pytest.mark.gpu
def test_real_nvml_sampler_on_the_first_gpu():
    """On a GPU host with nvidia-ml-py: the sampler reaches 10 Hz and the energy counter advances."""
    pytest.importorskip("pynvml")
    start = telemetry.sample(0)
    sampler, samples = _sample_for(1.0, index=0, hz=20.0)
    end = telemetry.sample(0)
    s = telemetry.arm_summary(_record(samples, start, end))
    assert sampler.active and s["sample_rate_hz"] >= 10 and s["min_sm_clock_mhz"] > 0
    assert s["energy_j"] is not None and s["energy_j"] >= 0 and sampler.cpu_s / len(samples) < 0.005
