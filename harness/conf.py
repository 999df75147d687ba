"""Typed benchmark configuration: one structured-config dataclass per node, registered in Hydra's ConfigStore.

The YAML files in ``configs/`` are presets only (``cpu-smoke``, ``ouro-1.4b``); every key they may set
is declared here with its type, so Hydra rejects a misspelt key or a wrong type at composition time,
naming the key, before anything is built or measured. Choices are Enums, so a misspelt value
(``model.dtype=bf61``) fails the same way. Cross-key rules that a type cannot express (a comparison
naming an unknown arm, ``min_loops > max_loops``...) are checked by :func:`validate`, which raises a
``ValueError`` naming the key and value; the controller calls it before it freezes the plan, and
:func:`check_fits_model` (exit depths and positions against the model's config) before it writes anything.

Nothing downstream sees Hydra objects: :func:`to_plain` turns a validated config into plain JSON data
(the frozen plan's ``config``), and the sessions rebuild runtime configs from that.

Names follow the seed's protocol (BRIEF section 2): a *point* is (B = ``max_num_seqs``, C = number of
requests); an *arm* is a named runtime configuration; a *comparison* is (baseline arm, candidate arm);
*pairs* is the number of paired measurements per point and comparison.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float64 = "float64"


class ExitPolicy(Enum):
    fixed = "fixed"
    ouro = "ouro"
    ouro_delayed = "ouro_delayed"


class KVLayout(Enum):
    native = "native"
    alias = "alias"


class AttentionBackend(Enum):
    torch = "torch"
    triton = "triton"


class DescriptorMode(Enum):
    h2d = "h2d"
    mapped = "mapped"


class DeviceKind(Enum):
    auto = "auto"    # CUDA when available, else one CPU session
    cpu = "cpu"
    cuda = "cuda"


class ExecutorKind(Enum):
    local = "local"  # one subprocess per device on this host
    slurm = "slurm"  # one submitit job per device


@dataclass
class ModelConf:
    """A synthetic checkpoint of ``preset`` (written once and cached), or a real one at ``checkpoint``."""

    preset: str = "tiny"
    checkpoint: Optional[str] = None  # an HF-format directory; when set, ``preset`` is ignored
    dtype: DType = DType.float32
    seed: int = 0                     # synthetic weights' seed


@dataclass
class WorkloadConf:
    """P-token prompts and exactly D output tokens per request (EOS ignored), greedy.

    Prompts are seeded random token ids (``prompt_seed``), or read from ``prompts_file`` (parquet with a
    ``prompt_token_ids`` list column, or JSONL with one list of ids, or an object with that key, per
    line); a file's prompts are used as they are, its first C for a point of C requests, and
    ``prompt_len`` is then ignored (the plan records the lengths found).

    ``prompt_lens`` mixes lengths instead of one ``prompt_len``: request i's seeded prompt has
    ``prompt_lens[i % len(prompt_lens)]`` tokens (``cpu-smoke`` uses it to put first-alias positions at
    and across key-tile boundaries). Set one of the two; the other must be null.
    """

    prompt_len: Optional[int] = 128
    output_len: int = 128
    prompt_seed: int = 0
    prompts_file: Optional[str] = None
    prompt_lens: Optional[List[int]] = None


@dataclass
class PointConf:
    max_num_seqs: int = MISSING  # B: batch capacity
    num_requests: int = MISSING  # C: requests submitted at once


@dataclass
class ExitConf:
    """The natural policy of the reference capture; measured arms replay its exit depths."""

    policy: ExitPolicy = ExitPolicy.ouro_delayed
    threshold: float = 0.5
    min_loops: int = 2
    max_loops: int = 4


@dataclass
class ArmConf:
    """One runtime configuration (maps one to one onto the engine's ``EngineConfig``)."""

    kv_layout: KVLayout = KVLayout.native
    prefix_tiles: bool = False
    attention_backend: AttentionBackend = AttentionBackend.torch
    cuda_graphs: bool = False
    graph_cache_size: int = 16
    descriptor_mode: DescriptorMode = DescriptorMode.h2d
    block_size: int = 16
    tile_size: int = 32


@dataclass
class ComparisonConf:
    """Pair ratio = baseline seconds / candidate seconds, so > 1 means the candidate is faster.

    ``baseline == candidate`` is an A/A comparison: two separately built engines of one arm, whose
    ratios measure the noise floor of the set-up.
    """

    baseline: str = MISSING
    candidate: str = MISSING
    name: Optional[str] = None  # default "<baseline>_vs_<candidate>"


@dataclass
class VerdictConf:
    """The predeclared decision rule (see ``stats.verdict``) and the bootstrap's settings."""

    min_effect: float = 0.01   # |speedup - 1| must reach this for faster / slower
    confidence: float = 0.95
    min_pairs: int = 6         # fewer pairs: inconclusive (stats.verdict says why 6)
    n_resamples: int = 10_000
    bootstrap_seed: int = 0


@dataclass
class SlurmConf:
    """submitit settings. ``cluster``: None = Slurm; ``local`` / ``debug`` are submitit's test executors."""

    cluster: Optional[str] = None
    partition: Optional[str] = None
    gpus_per_job: int = 1
    cpus_per_task: int = 8
    mem_gb: int = 64
    jobs: int = 1               # sessions (one device each) to submit
    additional_parameters: Dict[str, str] = field(default_factory=dict)


@dataclass
class ExecutorConf:
    kind: ExecutorKind = ExecutorKind.local
    device: DeviceKind = DeviceKind.auto
    gpus: Optional[List[int]] = None  # physical GPU indices for local sessions; None = every visible GPU
    cpu_threads: int = 1              # torch intra-op threads of a CPU session (see session.py)
    session_timeout_s: float = 3600.0
    reference_timeout_s: float = 1800.0
    poll_s: float = 0.5
    stop_grace_s: float = 10.0        # on SIGTERM / Ctrl-C: children get SIGTERM, then SIGKILL after this
    slurm: SlurmConf = field(default_factory=SlurmConf)


@dataclass
class FaultConf:
    """Testing aid: a session SIGKILLs itself after writing this many arm records (None = never)."""

    kill_after_arms: Optional[int] = None


@dataclass
class BenchConf:
    name: str = MISSING
    model: ModelConf = field(default_factory=ModelConf)
    workload: WorkloadConf = field(default_factory=WorkloadConf)
    points: List[PointConf] = MISSING
    exit: ExitConf = field(default_factory=ExitConf)
    arms: Dict[str, ArmConf] = MISSING
    comparisons: List[ComparisonConf] = MISSING
    reference_arm: Optional[str] = None  # natural-run arm of the frozen schedule; None = first baseline
    pairs: int = 7
    order_seed: int = 0
    warmup: bool = True
    verdict: VerdictConf = field(default_factory=VerdictConf)
    executor: ExecutorConf = field(default_factory=ExecutorConf)
    results_dir: str = "results"
    cache_dir: Optional[str] = None      # None = $LOOPBENCH_CACHE or ~/.cache/loopbench
    reuse_references: bool = True
    fault: FaultConf = field(default_factory=FaultConf)
    # An incomplete bundle to finish measuring: every other key must equal its plan's (README, "Interrupted runs").
    resume: Optional[str] = None


def register() -> None:
    """Register the schema as ``bench_schema``; presets list it first in their defaults."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConf)


register()

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def cache_dir(cfg: Any) -> Path:
    raw = _get(cfg, "cache_dir") or os.environ.get("LOOPBENCH_CACHE") or "~/.cache/loopbench"
    return Path(raw).expanduser()


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, (dict, DictConfig)) else getattr(cfg, key)


def to_plain(cfg: DictConfig | BenchConf) -> dict:
    """Resolved, JSON-ready data (Enums as their names) of a composed config."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose a preset outside ``@hydra.main`` (tests, tools); the same checks as the command line."""
    from hydra import compose as _compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return _compose(config_name=config_name, overrides=list(overrides or []))


def validate(cfg: DictConfig | dict) -> dict:
    """Check the rules a type cannot express; return the plain config. ValueError names key and value."""
    plain = cfg if isinstance(cfg, dict) else to_plain(cfg)
    _check_keys(plain, BenchConf, "")

    positive = _positive_int

    def seed(key: str, value: Any) -> None:
        # numpy's default_rng takes non-negative integers only; fail here, not in a child or the summary
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key} must be a non-negative integer seed, got {value!r}")

    if not plain["name"] or any(c in plain["name"] for c in "/\\ "):
        raise ValueError(f"name must be a non-empty token without '/', '\\' or spaces, got {plain['name']!r}")
    seed("model.seed", plain["model"]["seed"])
    seed("workload.prompt_seed", plain["workload"]["prompt_seed"])
    seed("order_seed", plain["order_seed"])
    seed("verdict.bootstrap_seed", plain["verdict"]["bootstrap_seed"])
    wl = plain["workload"]
    positive("workload.output_len", wl["output_len"])
    _check_prompt_lengths(wl)
    if not plain["points"]:
        raise ValueError("points must list at least one (max_num_seqs, num_requests) point")
    seen = set()
    for i, pt in enumerate(plain["points"]):
        positive(f"points[{i}].max_num_seqs", pt["max_num_seqs"])
        positive(f"points[{i}].num_requests", pt["num_requests"])
        key = (pt["max_num_seqs"], pt["num_requests"])
        if key in seen:
            raise ValueError(f"points[{i}] = B{key[0]}/C{key[1]} is listed twice")
        seen.add(key)
    ex = plain["exit"]
    positive("exit.min_loops", ex["min_loops"])
    positive("exit.max_loops", ex["max_loops"])
    if ex["min_loops"] > ex["max_loops"]:
        raise ValueError(f"exit.min_loops={ex['min_loops']} exceeds exit.max_loops={ex['max_loops']}")
    if not (0.0 < ex["threshold"] <= 1.0):
        raise ValueError(f"exit.threshold must be in (0, 1], got {ex['threshold']!r}")
    if not plain["arms"]:
        raise ValueError("arms must name at least one arm")
    for name, arm in plain["arms"].items():
        positive(f"arms.{name}.block_size", arm["block_size"])
        positive(f"arms.{name}.tile_size", arm["tile_size"])
        positive(f"arms.{name}.graph_cache_size", arm["graph_cache_size"])
        if arm["prefix_tiles"] and arm["kv_layout"] != "alias":
            raise ValueError(f"arms.{name}.prefix_tiles needs kv_layout=alias, got {arm['kv_layout']!r}")
    if not plain["comparisons"]:
        raise ValueError("comparisons must list at least one (baseline, candidate) comparison")
    names = set()
    for i, comp in enumerate(plain["comparisons"]):
        for role in ("baseline", "candidate"):
            if comp[role] not in plain["arms"]:
                raise ValueError(f"comparisons[{i}].{role} = {comp[role]!r} is not an arm; arms are "
                                 f"{sorted(plain['arms'])}")
        comp["name"] = comp["name"] or f"{comp['baseline']}_vs_{comp['candidate']}"
        if comp["name"] in names or any(c in comp["name"] for c in "/\\ "):
            raise ValueError(f"comparisons[{i}].name = {comp['name']!r} is repeated or not a plain token")
        names.add(comp["name"])
    ref = plain["reference_arm"]
    if ref is not None and ref not in plain["arms"]:
        raise ValueError(f"reference_arm = {ref!r} is not an arm; arms are {sorted(plain['arms'])}")
    positive("pairs", plain["pairs"])
    vd = plain["verdict"]
    if not (0.0 < vd["confidence"] < 1.0):
        raise ValueError(f"verdict.confidence must be in (0, 1), got {vd['confidence']!r}")
    if not (math.isfinite(vd["min_effect"]) and vd["min_effect"] >= 0):
        raise ValueError(f"verdict.min_effect must be >= 0, got {vd['min_effect']!r}")
    positive("verdict.n_resamples", vd["n_resamples"])
    positive("verdict.min_pairs", vd["min_pairs"])
    exe = plain["executor"]
    for key in ("session_timeout_s", "reference_timeout_s", "poll_s", "stop_grace_s"):
        if not exe[key] > 0:
            raise ValueError(f"executor.{key} must be > 0, got {exe[key]!r}")
    if exe["gpus"] is not None and len(set(exe["gpus"])) != len(exe["gpus"]):
        raise ValueError(f"executor.gpus lists a GPU twice: {exe['gpus']}")
    positive("executor.slurm.jobs", exe["slurm"]["jobs"])
    positive("executor.cpu_threads", exe["cpu_threads"])
    if plain["resume"] is not None and not Path(plain["resume"]).expanduser().is_dir():
        raise ValueError(f"resume = {plain['resume']!r} is not a bundle directory")
    kill = plain["fault"]["kill_after_arms"]
    if kill is not None and (isinstance(kill, bool) or kill < 0):
        raise ValueError(f"fault.kill_after_arms must be >= 0 or null, got {kill!r}")
    return plain


def _check_prompt_lengths(wl: dict) -> None:
    """Exactly one source of prompt lengths: ``prompts_file``, ``prompt_lens`` or ``prompt_len``."""
    if wl["prompts_file"] is not None:
        if wl["prompt_lens"] is not None:
            raise ValueError(f"workload.prompts_file={wl['prompts_file']!r} and workload.prompt_lens="
                             f"{wl['prompt_lens']} are both set; a file's prompts keep their own lengths, so set "
                             "workload.prompt_lens=null")
        if not Path(wl["prompts_file"]).expanduser().is_file():
            raise ValueError(f"workload.prompts_file {wl['prompts_file']!r} does not exist")
        return
    if wl["prompt_lens"] is None:
        if wl["prompt_len"] is None:
            raise ValueError("workload.prompt_len is null: set workload.prompt_len, workload.prompt_lens or "
                             "workload.prompts_file")
        _positive_int("workload.prompt_len", wl["prompt_len"])
        return
    if wl["prompt_len"] is not None:
        raise ValueError(f"workload.prompt_len={wl['prompt_len']} and workload.prompt_lens={wl['prompt_lens']} "
                         "are both set; set one and the other to null (e.g. workload.prompt_lens=null "
                         "for prompts of one length)")
    if not wl["prompt_lens"]:
        raise ValueError("workload.prompt_lens must list at least one length, got []")
    for i, n in enumerate(wl["prompt_lens"]):
        _positive_int(f"workload.prompt_lens[{i}]", n)


def _positive_int(key: str, value: Any) -> None:
    """ValueError naming ``key`` unless ``value`` is an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")


def check_fits_model(plain: dict, model_config: dict, max_prompt_len: int) -> None:
    """The rules that need the model's config (``config.json`` keys): ValueError names key and limit.

    Exit depths run 1..``exit.max_loops`` loops of the model's ``total_ut_steps``; a request of a
    P-token prompt and D output tokens occupies positions 0..P+D-2, so P + D - 1 must fit in
    ``max_position_embeddings``. The controller calls this before anything is written or measured.
    """
    loops = model_config["total_ut_steps"]
    if plain["exit"]["max_loops"] > loops:
        raise ValueError(f"exit.max_loops={plain['exit']['max_loops']} exceeds the model's total_ut_steps={loops}")
    positions = model_config["max_position_embeddings"]
    need = max_prompt_len + plain["workload"]["output_len"] - 1
    if need > positions:
        wl = plain["workload"]
        prompt_key = ("the longest prompt of workload.prompts_file" if wl["prompts_file"]
                      else "the longest of workload.prompt_lens" if wl["prompt_lens"] else "workload.prompt_len")
        raise ValueError(f"{prompt_key} ({max_prompt_len}) + workload.output_len ({plain['workload']['output_len']}) "
                         f"- 1 = {need} positions exceed the model's max_position_embeddings={positions}")


def _check_keys(data: Any, schema: type, prefix: str) -> None:
    """Unknown keys fail even where Hydra's ``+key=`` append lifted the struct flag."""
    import dataclasses
    import typing

    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(schema)
    for key, value in data.items():
        if key not in hints:
            raise ValueError(f"unknown config key {prefix + key!r}; {schema.__name__} has "
                             f"{sorted(hints)}")
        hint = hints[key]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            _check_keys(value, hint, f"{prefix}{key}.")
        elif typing.get_origin(hint) in (dict, typing.Dict) and dataclasses.is_dataclass(args[1]):
            for name, item in (value or {}).items():
                _check_keys(item, args[1], f"{prefix}{key}.{name}.")
        elif typing.get_origin(hint) in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
            for i, item in enumerate(value or []):
                _check_keys(item, args[0], f"{prefix}{key}[{i}].")


def reference_arm(plain: dict) -> str:
    """The arm whose natural run is frozen: ``reference_arm`` or the first comparison's baseline."""
    return plain["reference_arm"] or plain["comparisons"][0]["baseline"]
