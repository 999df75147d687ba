"""The validated benchmark configuration: frozen, typed, what every stage after ``conf.validate`` sees.

``conf`` composes Hydra's structured configs (mutable, for composition and overrides) and checks them;
:class:`BenchSpec` is the result, built once by :meth:`BenchSpec.from_plain` from the checked plain data
and never changed afterwards. ``BenchSpec.to_plain()`` is the plan's ``config`` (JSON data, Enums as
their names, each comparison's default name filled in); a session rebuilds the parts it needs (an
:class:`~records.ArmSpec`) from that JSON. The rules that need the model's own config
(:func:`check_fits_model`) and the positions rule (:func:`max_model_len`) live here too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from .online.config import OnlineSpec
from .records import ArmSpec


def max_model_len(longest_prompt: int, output_len: int) -> int:
    """Positions a request of a P-token prompt and D output tokens occupies: 0..P+D-2, i.e. P + D - 1
    (the D-th output token is sampled, never fed back; the engine's admission rule)."""
    return longest_prompt + output_len - 1


@dataclass(frozen=True)
class ModelSpec:
    preset: str
    checkpoint: str | None
    dtype: str
    seed: int


@dataclass(frozen=True)
class WorkloadSpec:
    prompt_len: int | None
    output_len: int
    prompt_seed: int
    prompts_file: str | None
    prompt_lens: tuple[int, ...] | None


@dataclass(frozen=True)
class PointSpec:
    max_num_seqs: int   # B
    num_requests: int   # C
    prompt_len: int | None = None   # the point's own P (harness/workloads.py); None: the workload's prompts
    output_len: int | None = None   # the point's own D; None: workload.output_len

    @property
    def key(self) -> str:
        """B<B>C<C>, with P<P> / D<D> for a prompt_len / output_len the point sets itself."""
        own = (f"P{self.prompt_len}" if self.prompt_len is not None else "") + \
            (f"D{self.output_len}" if self.output_len is not None else "")
        return f"B{self.max_num_seqs}C{self.num_requests}{own}"


@dataclass(frozen=True)
class ExitSpec:
    policy: str
    threshold: float
    min_loops: int
    max_loops: int


@dataclass(frozen=True)
class ComparisonSpec:
    baseline: str
    candidate: str
    name: str
    track: str = "replay"   # replay | natural (conf.Track)


@dataclass(frozen=True)
class VerdictSpec:
    min_effect: float
    confidence: float
    min_pairs: int
    n_resamples: int
    bootstrap_seed: int
    eager_fraction_tolerance: float = 0.001


@dataclass(frozen=True)
class EvidenceSpec:
    alpha: float
    power: float
    noise_bundle: str | None
    noise_sigma: float | None


@dataclass(frozen=True)
class TelemetrySpec:
    sample_hz: float = 20.0


@dataclass(frozen=True)
class NaturalSpec:
    gate_epsilon: float = 0.01
    logit_epsilon: float = 0.05
    floor: str | None = None


@dataclass(frozen=True)
class SlurmSpec:
    cluster: str | None
    partition: str | None
    account: str | None
    time_limit_min: int | None
    cpus_per_task: int
    gpus_per_task: int
    mem_gb: int | None
    jobs: int
    additional_parameters: Mapping[str, str]


@dataclass(frozen=True)
class ExecutorSpec:
    kind: str
    device: str
    gpus: tuple[int, ...] | None
    cpu_threads: int
    cpu_devices: int
    session_timeout_s: float
    reference_timeout_s: float
    poll_s: float
    stop_grace_s: float
    slurm: SlurmSpec


@dataclass(frozen=True)
class FaultSpec:
    kill_after_arms: int | None


@dataclass(frozen=True)
class BenchSpec:
    """A checked benchmark configuration (field meanings: ``conf.BenchConf``)."""

    SCHEMA_VERSION: ClassVar[int] = 1

    name: str
    model: ModelSpec
    workload: WorkloadSpec
    points: tuple[PointSpec, ...]
    exit: ExitSpec
    arms: Mapping[str, ArmSpec]
    comparisons: tuple[ComparisonSpec, ...]
    reference_arm: str | None
    pairs: int
    order_seed: int
    warmup: bool
    verdict: VerdictSpec
    executor: ExecutorSpec
    results_dir: str
    cache_dir: str | None
    reuse_references: bool
    fault: FaultSpec
    resume: str | None
    sessions: int = 1
    evidence: EvidenceSpec = EvidenceSpec(0.05, 0.8, None, None)
    telemetry: TelemetrySpec = TelemetrySpec()
    online: OnlineSpec | None = None
    natural: NaturalSpec = NaturalSpec()

    @classmethod
    def from_plain(cls, p: Mapping[str, Any]) -> BenchSpec:
        """From checked plain data (``conf.validate`` checks it first; this only builds)."""
        wl, exe = p["workload"], p["executor"]
        return cls(
            name=p["name"], model=ModelSpec(**p["model"]),
            workload=WorkloadSpec(**{**wl, "prompt_lens": None if wl["prompt_lens"] is None else tuple(wl["prompt_lens"])}),
            points=tuple(PointSpec(**pt) for pt in p["points"]), exit=ExitSpec(**p["exit"]),
            arms={name: ArmSpec.from_plain(arm) for name, arm in p["arms"].items()},
            comparisons=tuple(ComparisonSpec(**c) for c in p["comparisons"]), reference_arm=p["reference_arm"],
            pairs=p["pairs"], order_seed=p["order_seed"], warmup=p["warmup"], verdict=VerdictSpec(**p["verdict"]),
            executor=ExecutorSpec(**{**exe, "gpus": None if exe["gpus"] is None else tuple(exe["gpus"]),
                                     "slurm": SlurmSpec(**{**exe["slurm"], "additional_parameters":
                                                           dict(exe["slurm"]["additional_parameters"])})}),
            results_dir=p["results_dir"], cache_dir=p["cache_dir"], reuse_references=p["reuse_references"],
            fault=FaultSpec(**p["fault"]), resume=p["resume"], sessions=p["sessions"],
            evidence=EvidenceSpec(**p["evidence"]), telemetry=TelemetrySpec(**p["telemetry"]),
            online=OnlineSpec.from_plain(p.get("online")), natural=NaturalSpec(**p.get("natural", {})))

    def to_plain(self) -> dict:
        """JSON data: the plan's ``config`` (tuples as lists); without ``online`` when it is null, so the
        plans of runs without the online track read as they did before it existed."""
        plain = _lists(dataclasses.asdict(self))
        if plain["online"] is None:
            del plain["online"]
        return plain

    @property
    def reference(self) -> str:
        """The arm whose natural run is frozen: ``reference_arm`` or the first comparison's baseline."""
        return self.reference_arm or self.comparisons[0].baseline

    @property
    def max_num_requests(self) -> int:
        return max(pt.num_requests for pt in self.points)


def _lists(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _lists(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_lists(v) for v in data]
    return data


def check_fits_model(spec: BenchSpec, model_config: dict, max_prompt_len: int) -> None:
    """The rules that need the model's config (``config.json`` keys): ValueError names key and limit.

    Exit depths run 1..``exit.max_loops`` loops of the model's ``total_ut_steps``; a request of a
    P-token prompt and D output tokens needs :func:`max_model_len` positions, which must fit in
    ``max_position_embeddings``. The controller calls this before anything is written or measured.
    """
    loops = model_config["total_ut_steps"]
    if spec.exit.max_loops > loops:
        raise ValueError(f"exit.max_loops={spec.exit.max_loops} exceeds the model's total_ut_steps={loops}")
    positions = model_config["max_position_embeddings"]
    wl = spec.workload
    need = max_model_len(max_prompt_len, wl.output_len)
    if need > positions:
        prompt_key = ("the longest prompt of workload.prompts_file" if wl.prompts_file
                      else "the longest of workload.prompt_lens" if wl.prompt_lens else "workload.prompt_len")
        raise ValueError(f"{prompt_key} ({max_prompt_len}) + workload.output_len ({wl.output_len}) "
                         f"- 1 = {need} positions exceed the model's max_position_embeddings={positions}")
