"""Typed benchmark configuration: one structured-config dataclass per node, registered in Hydra's ConfigStore.

The YAML files in ``configs/`` are presets only (``cpu-smoke``, ``ouro-1.4b``); every key they may set
is declared here with its type, so Hydra rejects a misspelt key or a wrong type at composition time,
naming the key, before anything is built or measured. Choices are Enums, so a misspelt value
(``model.dtype=bf61``) fails the same way. Cross-key rules that a type cannot express (a comparison
naming an unknown arm, ``min_loops > max_loops``, an arm's ``engine`` path naming no factory...) are
checked by :func:`validate` (harness/rules.py), which raises a ``ValueError`` naming key and value and
returns the frozen :class:`~spec.BenchSpec`; ``spec.check_fits_model`` checks exit depths and positions
against the model's config before anything is written.

Nothing downstream sees Hydra objects: stages take the ``BenchSpec``; its ``to_plain()`` is the frozen
plan's ``config``, from which the sessions rebuild what they need.

Names follow the seed's protocol (BRIEF section 2): a *point* is (B = ``max_num_seqs``, C = number of
requests); an *arm* is a named runtime configuration; a *comparison* is (baseline arm, candidate arm);
*pairs* is the number of paired measurements per point and comparison.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from . import rules
from .executors import stops_held
from .online.config import OnlineConf
from .records import DEFAULT_ENGINE
from .spec import BenchSpec


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float64 = "float64"


# The choices below mirror runtime/api.py's (KVLayout, ExitPolicyName, AttentionBackendName,
# DescriptorMode) with lower-case member names, because Hydra and OmegaConf parse an enum override by
# member *name* (`kv_layout=native`); `replay` is not a choice a user makes (every arm replays the frozen
# natural run). tests/harness/test_conf.py holds the two sets of values in step.
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


class Track(Enum):
    replay = "replay"    # every arm replays the frozen natural run of the reference arm (BRIEF section 2)
    natural = "natural"  # each arm runs its own natural schedule: the exit policy decides (harness/natural.py)


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

    Prompts are seeded random token ids (``prompt_seed``, by the contract's SHA-256 ``prompt_rule``), or read
    from ``prompts_file`` (parquet with a ``prompt_token_ids`` list column, or JSONL with one list of ids, or an
    object with that key, per line); a file's prompts are used as they are, its first C for a point of C
    requests, and ``prompt_len`` is then ignored (the plan records the lengths found).

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
    prompt_len: Optional[int] = None  # this point's own P: seeded prompts of P tokens (harness/workloads.py)
    output_len: Optional[int] = None  # this point's own D; None: workload.output_len


@dataclass
class ExitConf:
    """The natural policy of the reference capture; measured arms replay its exit depths."""

    policy: ExitPolicy = ExitPolicy.ouro_delayed
    threshold: float = 0.5
    min_loops: int = 2
    max_loops: int = 4


@dataclass
class ArmConf:
    """One runtime configuration (``records.ArmSpec.engine_config`` maps it onto the engine's ``EngineConfig``)."""

    kv_layout: KVLayout = KVLayout.native
    prefix_tiles: bool = False
    attention_backend: AttentionBackend = AttentionBackend.torch
    cuda_graphs: bool = False
    graph_cache_size: int = 16
    descriptor_mode: DescriptorMode = DescriptorMode.h2d
    block_size: int = 16
    tile_size: int = 32
    # the engine's factory, "package.module:factory" called as factory(model, EngineConfig) (harness/engines.py)
    engine: str = DEFAULT_ENGINE


@dataclass
class ComparisonConf:
    """Pair ratio = baseline seconds / candidate seconds, so > 1 means the candidate is faster.

    ``baseline == candidate`` is an A/A comparison: two separately built engines of one arm, whose
    ratios measure the noise floor of the set-up.
    """

    baseline: str = MISSING
    candidate: str = MISSING
    name: Optional[str] = None  # default "<baseline>_vs_<candidate>"
    track: Track = Track.replay  # natural: no replay, each arm's own exits (``NaturalConf``)


@dataclass
class VerdictConf:
    """The predeclared decision rule (see ``stats.verdict``) and the bootstrap's settings."""

    min_effect: float = 0.01   # |speedup - 1| must reach this for faster / slower
    confidence: float = 0.95
    min_pairs: int = 6         # fewer pairs: inconclusive (stats.verdict says why 6)
    n_resamples: int = 10_000
    bootstrap_seed: int = 0
    # no verdict when a pair's arms' eager fractions differ by more (harness/graph_coverage.py)
    eager_fraction_tolerance: float = 0.001


@dataclass
class EvidenceConf:
    """Evidence beyond one session (issue 12): the drift / order tests' level and the plan's minimum
    detectable effect (``stats.detectable_effect``), whose noise comes from ``noise_bundle`` (a previous
    bundle's A/A comparisons), else ``noise_sigma`` (SD of one pair's log ratio), else is unknown."""

    alpha: float = 0.05                # drift, order and allocator-creep tests flag p < alpha
    power: float = 0.8                 # of the minimum detectable effect, at level 1 - verdict.confidence
    noise_bundle: Optional[str] = None
    noise_sigma: Optional[float] = None


@dataclass
class TelemetryConf:
    """NVML sampling during each measured run (harness/sampler.py); nothing is sampled without NVML."""

    sample_hz: float = 20.0   # >= 10: a clock change or throttle shorter than 1 / sample_hz may be missed


@dataclass
class NaturalConf:
    """The natural-schedule track's declared equivalence rule (harness/natural.py), fixed in the plan before
    anything is measured. A divergence is a near-tie when its margin is below its epsilon: the gate margin
    ``|1 - S_r - threshold|`` at the loop where the exit decision differed, or the top-1 - top-2 logit
    margin at the first different token (the larger of the two arms' margins). A comparison is
    ``equivalent`` when its divergent requests are at most its floor's (the natural A/A comparison
    ``floor``; None: the A/A of its baseline arm, else of any arm, else 0) and none is above epsilon."""

    gate_epsilon: float = 0.01
    logit_epsilon: float = 0.05
    floor: Optional[str] = None


@dataclass
class SlurmConf:
    """Job parameters of ``executor.kind=slurm`` (README, "On a SLURM cluster"); one job per child, submitted
    through submitit. ``cluster``: None = SLURM (``sbatch``); ``local`` / ``debug`` are submitit's test executors.

    ``time_limit_min`` is the jobs' ``--time`` in minutes (None: each child's own timeout,
    ``executor.reference_timeout_s`` / ``session_timeout_s``, rounded up). ``mem_gb`` None asks for no
    ``--mem`` (the partition's default). ``additional_parameters`` are further sbatch flags, flag name
    without dashes to value (``{qos: high, constraint: h200}``; ``"true"`` gives a bare ``--flag``).
    """

    cluster: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit_min: Optional[int] = None
    cpus_per_task: int = 8
    gpus_per_task: int = 1      # used where the sessions run on CUDA (executor.device != cpu)
    mem_gb: Optional[int] = 64
    jobs: int = 1               # sessions (one device each) to submit
    additional_parameters: Dict[str, str] = field(default_factory=dict)


@dataclass
class ExecutorConf:
    kind: ExecutorKind = ExecutorKind.local
    device: DeviceKind = DeviceKind.auto
    gpus: Optional[List[int]] = None  # physical GPU indices for local sessions; None = every visible GPU
    cpu_threads: int = 1              # torch intra-op threads of a CPU session (see session.py)
    # Simulated devices of a CPU run (device=cpu, kind=local): n > 1 plans sessions cpu0..cpu<n-1, run in
    # parallel, each its own child pinned by LOOPBENCH_CPU_DEVICE as a GPU child is by CUDA_VISIBLE_DEVICES:
    # the multi-device path (one session per card) tested where there is no second card. 1: one session.
    cpu_devices: int = 1
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
    sessions: int = 1                    # independent restarts per device, each its own balanced pairs
    order_seed: int = 0
    warmup: bool = True
    verdict: VerdictConf = field(default_factory=VerdictConf)
    evidence: EvidenceConf = field(default_factory=EvidenceConf)
    telemetry: TelemetryConf = field(default_factory=TelemetryConf)
    natural: NaturalConf = field(default_factory=NaturalConf)
    executor: ExecutorConf = field(default_factory=ExecutorConf)
    results_dir: str = "results"
    cache_dir: Optional[str] = None      # None = $LOOPBENCH_CACHE or ~/.cache/loopbench
    reuse_references: bool = True
    fault: FaultConf = field(default_factory=FaultConf)
    # An incomplete bundle to finish measuring: every other key must equal its plan's (README, "Interrupted runs").
    resume: Optional[str] = None
    online: Optional[OnlineConf] = None  # the online serving track (harness/online/); null: none


def register() -> None:
    """Register the schema as ``bench_schema``; presets list it first in their defaults."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConf)


register()

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def cache_dir(spec: BenchSpec) -> Path:
    """Where synthetic checkpoints and frozen references are cached."""
    raw = spec.cache_dir or os.environ.get("LOOPBENCH_CACHE") or "~/.cache/loopbench"
    return Path(raw).expanduser()


def to_plain(cfg: DictConfig | BenchConf) -> dict:
    """Resolved, JSON-ready data (Enums as their names) of a composed config."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)


def presets() -> list[str]:
    """The preset names of ``configs/`` (``--config-name``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def compose(config_name: str, overrides: list[str] | None = None) -> DictConfig:
    """Compose a preset outside ``@hydra.main`` (tests, tools); the same checks as the command line.

    ValueError names an unknown preset with the ones there are, and a misspelt key, in an override or in a
    preset's YAML, by its dotted path with the closest key (``rules.unknown_key``), and an override into a node
    that is null there (``rules.null_node``). That translation is made here only, for every caller: Hydra's own
    message for a key shows the schema's class names and, for an override, advises appending the key with
    ``+``, which only moves the error on to :func:`validate`; for a null node OmegaConf's names nothing."""
    from hydra import compose as _compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException

    if config_name not in presets():
        raise ValueError(f"unknown preset {config_name!r}; configs/ has {presets()}")
    overrides = list(overrides or [])
    _check_defaults_cycle(config_name)   # Hydra recurses until RecursionError on a preset that extends itself
    _check_deletions(overrides)     # `~pairs` composes, and the config then lacks a key that every stage reads
    # a Ctrl-C inside OmegaConf was replaced by a secondary AttributeError and named as a bad configuration
    with stops_held(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            try:
                cfg = _compose(config_name=config_name, overrides=overrides)
            except yaml.YAMLError as exc:   # Hydra lets a preset's YAML syntax error out as PyYAML's traceback
                raise ValueError(_yaml_error(exc)) from None
            if _sets_an_empty_dict(overrides):
                _check_override_targets(_compose, config_name, overrides)   # `online={}` composes, to a null section
            _check_schema_keys(config_name, cfg)
            _check_switches(config_name, overrides)   # composition took `warmup=2` for true
            return cfg
        # OmegaConf fails with an AssertionError or AttributeError, not a key error, on an override into a null
        # node (`online.x=1`, `online={x: 1}` where the preset has `online: null`); Hydra's lexer refuses a list
        # index in brackets (`comparisons[0].candidate=alias`) without naming the key
        except (ConfigCompositionException, OverrideParseException, AssertionError, AttributeError) as exc:
            if overrides:   # an override into a preset without the schema fails as 'not in struct': say why
                try:
                    alone = _compose(config_name=config_name)
                except Exception:   # noqa: BLE001 - the preset alone does not compose: the checks below say why
                    alone = None
                if alone is not None:
                    _check_schema_keys(config_name, alone)
            _check_preset_keys(config_name, set())
            _check_override_keys(overrides)
            _check_override_targets(_compose, config_name, overrides)
            if isinstance(exc, HydraException):
                raise     # not a key: Hydra's message, whose cause names the bad value
            # an OmegaConf failure none of the checks above places: still one line (its cause's), no traceback
            raise ValueError(f"preset {config_name} does not compose with {' '.join(overrides)}") from exc


def _check_schema_keys(config_name: str, cfg: DictConfig) -> None:
    """ValueError naming preset ``config_name``'s file when the composed ``cfg`` lacks keys of the schema: a preset
    whose defaults list names neither ``bench_schema`` nor a preset composes without them (every later stage reads
    them, and the checks failed with a KeyError traceback)."""
    missing = [f.name for f in dataclasses.fields(BenchConf) if f.name not in cfg]
    if missing:
        raise ValueError(f"{CONFIG_DIR.name}/{config_name}.yaml does not extend the schema: its defaults list must "
                         "name bench_schema or a preset that does (e.g. defaults: [cpu-smoke, _self_]); it lacks "
                         + ", ".join(missing))


def _preset_data(preset: str) -> dict | None:
    """Preset ``preset``'s YAML as plain data; None for a file that does not read as YAML or holds no mapping (Hydra,
    composing it, says why)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        data = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / f"{preset}.yaml"))
    except (OSError, yaml.YAMLError, OmegaConfBaseException):
        return None
    return data if isinstance(data, dict) else None


def _own_settings(data: dict) -> dict:
    """A preset's own settings: its :func:`_preset_data` without Hydra's ``defaults`` and ``hydra`` nodes."""
    return {k: v for k, v in data.items() if k not in ("defaults", "hydra")}


def _extended(data: dict | None) -> list[str]:
    """The presets of ``configs/`` that a preset's defaults list names (its :func:`_preset_data`; none for None)."""
    entries = (data.get("defaults") or []) if data is not None else []
    return [e for e in entries if isinstance(e, str) and (CONFIG_DIR / f"{e}.yaml").is_file()]


def _extends(preset: str) -> list[str]:
    """The presets of ``configs/`` that preset ``preset``'s defaults list names (none for a file that does not read)."""
    return _extended(_preset_data(preset))


def _check_defaults_cycle(config_name: str) -> None:
    """ValueError naming the first preset, reached from ``config_name``, that its own defaults list extends again,
    with the chain (``configs/a.yaml extends itself: a -> b -> a``)."""
    def walk(preset: str, chain: list[str], done: set[str]) -> None:
        if preset in chain:
            cycle = chain[chain.index(preset):] + [preset]
            raise ValueError(f"{CONFIG_DIR.name}/{preset}.yaml extends itself: {' -> '.join(cycle)}")
        if preset in done:
            return
        for entry in _extends(preset):
            walk(entry, chain + [preset], done)
        done.add(preset)

    walk(config_name, [], set())


def _yaml_error(exc: Exception) -> str:
    """One line naming the preset file that does not parse as YAML, PyYAML's problem and where (1-based)."""
    mark = getattr(exc, "problem_mark", None)
    name = Path(mark.name).name if mark is not None and getattr(mark, "name", None) else "a preset"
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{CONFIG_DIR.name}/{name} is not valid YAML: {problem}{where}"


def sweeper_params(config_name: str) -> list[str]:
    """The sweep a preset declares under ``hydra.sweeper.params`` as ``KEY=VALUES`` overrides, in the order Hydra's
    basic sweeper puts them before the command line's (``-m`` runs them: one job per combination). [] for a preset
    that declares none, or that does not compose (the checks then name what is wrong with it)."""
    from hydra import compose as _compose, initialize_config_dir

    try:
        with stops_held(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = _compose(config_name=config_name, return_hydra_config=True)
    except Exception:   # noqa: BLE001 - composition errors are reported by the checks of each job
        return []
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()]


def preset_files(name: str) -> list[str]:
    """Preset ``name`` and every preset its ``defaults`` list extends, each once, a preset after the ones it extends
    (``cpu-context`` -> ``['cpu-smoke', 'cpu-context']``); a file that does not read as YAML extends nothing."""
    out: list[str] = []
    seen: set[str] = set()

    def walk(preset: str) -> None:
        seen.add(preset)
        for entry in _extends(preset):
            if entry not in seen:
                walk(entry)
        out.append(preset)

    walk(name)
    return out


def _check_preset_keys(name: str, seen: set[str]) -> None:
    """The keys of preset ``name``'s YAML and of the presets its defaults list extends, each file on its
    own (``rules.check_keys``, then ``rules.check_shapes``: ValueError naming the file); Hydra's ``defaults`` and
    ``hydra`` nodes aside."""
    seen.add(name)
    data = _preset_data(name)
    if data is None:
        return    # Hydra could not read it either, and says why
    for entry in _extended(data):
        if entry not in seen:
            _check_preset_keys(entry, seen)
    rules.check_keys(_own_settings(data), BenchConf, where=f" in {CONFIG_DIR.name}/{name}.yaml")
    rules.check_shapes(_own_settings(data), BenchConf, where=f" in {CONFIG_DIR.name}/{name}.yaml")


def _check_switches(config_name: str, overrides: list[str]) -> None:
    """ValueError (``rules.check_bools``) naming a switch (a bool key) set to anything but true or false, in a YAML of
    preset ``config_name``'s chain (``preset_files``, the file named) or in an override, as written: composition has
    already turned ``2``, ``0`` or ``yes`` into a bool by then. Hydra's own nodes and deletions aside; a sweep's
    values are checked job by job, each job composed with its own."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for preset in preset_files(config_name):
        data = _preset_data(preset)
        if data is not None:
            rules.check_bools(_own_settings(data), BenchConf, where=f" in {CONFIG_DIR.name}/{preset}.yaml")
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_delete() or override.is_sweep_override() or _hydras_own(override):
            continue
        hint = rules.schema_at(override.key_or_group, BenchConf)
        if hint is not None:
            rules.check_bools(override.value(), hint, override.key_or_group)


def _check_override_keys(overrides: list[str]) -> None:
    """Each override's key (``+``, ``++`` and ``~`` ones too) and the keys of its value, against the schema
    (``rules.check_key_path``); Hydra's own nodes (``hydra.*``, ``hydra/...`` groups, ``@package``) aside."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        check_override_syntax(overrides)
        return    # a syntax error in a value: Hydra's message names it
    for override in parsed:
        key = override.key_or_group
        if _hydras_own(override):
            continue
        rules.check_key_path(key, None if override.is_delete() or override.is_sweep_override() else override.value(),
                             BenchConf)


def _check_deletions(overrides: list[str]) -> None:
    """ValueError for an override without a key (``=3``, which Hydra takes for a config group and words as "Config
    group override must be a string or a list. Got int"), and for a ``~key`` override that the schema cannot lose
    (``rules.undeletable``): a key of a section (``~pairs``, ``~exit``, ``~resume``) or a list item
    (``~comparisons.2``); a misspelt key is named as such (``rules.check_key_path``). A dict entry (``~arms.alias``)
    may go. Overrides that do not parse are left to :func:`check_override_syntax`, after Hydra refuses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    for override in parsed:
        if not override.key_or_group:
            raise ValueError(f"{override.input_line}: an override needs a key before its value (KEY=VALUE, e.g. "
                             "pairs=6)")
        if not override.is_delete() or _hydras_own(override):
            continue
        path = override.key_or_group
        rules.check_key_path(path, None, BenchConf)
        parent = rules.schema_at(path.rpartition(".")[0], BenchConf) if "." in path else BenchConf
        if dataclasses.is_dataclass(parent):
            hint = typing.get_type_hints(parent)[path.rpartition(".")[2]]
            raise rules.undeletable(override.input_line, path, parent, hint)
        if typing.get_origin(parent) in (list, typing.List):
            raise rules.undeletable(override.input_line, path, parent, rules.schema_at(path, BenchConf))


def _hydras_own(override) -> bool:
    """Hydra's own nodes (``hydra.*``, ``hydra/...`` groups, ``@package``), which our schema does not describe."""
    key = override.key_or_group
    return override.package is not None or "/" in key or key == "hydra" or key.startswith("hydra.")


# a key our schema can have, as an override writes it: dotted names (``exit.threshold``, ``points.0.max_num_seqs``)
_KEY = re.compile(r"(\+\+|\+|~)?[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def check_override_syntax(overrides: list[str]) -> None:
    """ValueError naming the first override whose key Hydra's grammar cannot parse, in our words: a list item in
    brackets (:func:`_check_bracketed_keys`), no ``=`` at all, or a key that is not dotted names of ASCII letters,
    digits and ``_`` (``exit.=0.6``, ``.pairs=3``, a non-ASCII letter), where Hydra's lexer names only a column;
    then the first override whose value Hydra cannot parse, with Hydra's message (``exit.threshold=0.6=1``), which
    does not always name it. A key of Hydra's own grammar (a group ``hydra/launcher``, a ``@package``) passes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    _check_bracketed_keys(overrides)
    for line in overrides:
        key, eq, _ = line.partition("=")
        if not eq and not line.startswith("~"):
            raise ValueError(f"{line!r} is not an override: KEY=VALUE needs an '=' (e.g. pairs=6)")
        if any(c in key for c in "/@") or key.lstrip("+~").split(".")[0] == "hydra" or _KEY.fullmatch(key):
            continue
        raise ValueError(f"{line!r}: the key {key!r} is not dotted names of ASCII letters, digits and _ "
                         "(e.g. exit.threshold=0.6)")
    for line in overrides:    # a value Hydra cannot parse: its message, which does not always name the override
        try:
            OverridesParser.create().parse_overrides([line])
        except HydraException as exc:
            why = " ".join(str(exc).split())
            raise ValueError(f"cannot parse the value of {line!r}: {why}") from None


def _check_bracketed_keys(overrides: list[str]) -> None:
    """Hydra's lexer refuses a list index in brackets (``comparisons[0].candidate=alias``, the way our value
    messages name an item) without naming the key. ValueError names it the way an override can: a misspelt
    key exactly as its dotted form would be (``rules.unknown_key``: ``comparisons.0.candidat``), a valid one
    with the override rewritten (``comparisons.0.candidate=alias``)."""
    for line in overrides:
        key, eq, value = line.partition("=")
        path = key.lstrip("+~")
        if "[" not in path or not re.fullmatch(r"[\w.\[\]]+", path) or path.split("[")[0].split(".")[0] == "hydra":
            continue
        dotted = rules.dotted(path)
        if "[" in dotted or "]" in dotted:
            continue  # not an index: Hydra's message
        rules.check_key_path(dotted, None, BenchConf)
        raise ValueError(f"{line}: an override names a list item by a dot, not brackets: "
                         f"{key[:len(key) - len(path)]}{dotted}{eq}{value}")


def _sets_an_empty_dict(overrides: list[str]) -> bool:
    """Whether an override sets a key to ``{}`` (an override Hydra composes even where the node is a null section)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if not any("{}" in re.sub(r"\s", "", o) for o in overrides):      # Hydra reads tabs as blanks too
        return False
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return False
    return any(not (o.is_delete() or o.is_sweep_override()) and o.value() == {} for o in parsed)


def _check_override_targets(compose_, config_name: str, overrides: list[str]) -> None:
    """ValueError for the first override whose key does not reach a node it can write. Each override is looked at
    in the config composed (``compose_``, Hydra's) of the overrides before it, so a list an earlier one sets whole,
    or a node an earlier one nulls (``online=null``), counts; each such config is composed once.

    - ``rules.list_index``: the key indexes a list past its end (``comparisons.5.candidate=alias`` where the
      preset has three); OmegaConf fails there with a type error about an empty dict that names neither.
    - ``rules.null_node``: the key writes into a node that is null there: a key below it
      (``online.num_requests=3``, ``executor.gpus.0=1``) or, for a section, the section whole
      (``online={num_requests: 3}``, and ``online={}``, which composes but leaves the section null, so the run
      would have no online track)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    composes = (HydraException, AssertionError, AttributeError)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    for i, override in enumerate(parsed):
        if override.is_delete() or _hydras_own(override):
            continue
        try:
            cfg = compose_(config_name=config_name, overrides=overrides[:i])
        except composes:
            return    # an earlier override fails on its own account
        _check_list_index(cfg, override)
        _check_null_node(compose_, config_name, cfg, parsed, i)


def _check_list_index(cfg: DictConfig, override) -> None:
    """:func:`_check_override_targets`'s list-index check of one parsed ``override`` in the config ``cfg``."""
    parts = override.key_or_group.split(".")
    indices = [int(p) if re.fullmatch(r"\d+(?:_\d+)*", p) else None for p in parts]    # 1_0 is 10 to Hydra
    node = cfg
    for n, index in enumerate(indices):
        if isinstance(node, ListConfig) and index is not None and index >= len(node):
            raise rules.list_index(override.input_line, ".".join(parts[:n]), index, len(node))
        node = OmegaConf.select(cfg, ".".join(parts[:n + 1]), default=None)
        if not isinstance(node, (DictConfig, ListConfig)):
            return


def _check_null_node(compose_, config_name: str, cfg: DictConfig, parsed: list, i: int) -> None:
    """:func:`_check_override_targets`'s null-node check of override ``parsed[i]`` in the config ``cfg``."""
    from hydra.errors import HydraException

    composes = (HydraException, AssertionError, AttributeError)
    override = parsed[i]
    absent = object()
    value = None if override.is_sweep_override() else override.value()
    parts = override.key_or_group.split(".")
    for n in range(1, len(parts) + 1):
        node = ".".join(parts[:n])
        if OmegaConf.select(cfg, node, default=absent) is not None:
            continue
        hint = rules.schema_at(node, BenchConf)
        if n == len(parts) and not (isinstance(value, dict) and dataclasses.is_dataclass(hint)):
            break     # a null list or dict set whole takes the value; a null section takes none, not even {}
        setter = next((o.input_line for o in reversed(parsed[:i]) if f"{node}.".startswith(f"{o.key_or_group}.")),
                      None)
        in_preset = OmegaConf.select(compose_(config_name=config_name, overrides=[]), node, default=absent) is None
        where = f"in preset {config_name}" if in_preset or setter is None else f"after {setter}"
        setters = []
        if dataclasses.is_dataclass(hint):
            for name in presets():
                try:
                    if OmegaConf.select(compose_(config_name=name, overrides=[]), node, default=absent) is not None:
                        setters.append(name)
                except composes:
                    pass      # a preset that does not compose sets nothing
        raise rules.null_node(override.input_line, node, where, hint, setters)


def validate(cfg: DictConfig | dict) -> BenchSpec:
    """The checked, frozen configuration of a composed config (or of its plain data, which is not changed).

    ValueError names the key and the value of the first rule broken (harness/rules.py), before anything
    is built or measured; an arm's ``engine`` path is imported here, so a bad one fails here too.
    """
    plain = copy.deepcopy(cfg) if isinstance(cfg, dict) else to_plain(cfg)
    rules.check_keys(plain, BenchConf)
    rules.check(plain)
    return BenchSpec.from_plain(plain)


def plain_error(text: str) -> str:
    """OmegaConf's error text for people: a missing required value as "missing required key <path>"; elsewhere
    OmegaConf's ``full_key: <path>`` trailer as "(key <path>)" and its ``reference_type`` / ``object_type`` trailers
    dropped."""
    missing = re.search(r"Missing mandatory value: \S+\s+full_key: (\S+)", text)
    if missing:
        return f"missing required key {missing.group(1)}: give it a value"
    text = re.sub(r"\s+(?:reference_type|object_type)=\S+", "", text)
    return re.sub(r"\s+full_key: (\S+)", r" (key \1)", text).strip()
