"""The runtime's public surface: what a caller hands an engine and what it gets back.

``EngineConfig`` (one arm's runtime settings, plain values), ``Request`` (token ids and loop bounds),
``RequestOutput`` (tokens and the exit depth of each), ``EngineStats`` (work counters), the
``Engine`` protocol every engine implementation satisfies (``LoopEngine`` here; the harness may load
another by import path), the choice enums of the config's string fields, and :func:`setting_value`, the
one form of a value of an engine's or model's ``settings()``. Nothing here knows about tokenizers, Hydra,
timing or files.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Set
from dataclasses import astuple, dataclass, field, replace
from enum import StrEnum
from typing import ClassVar, Protocol, runtime_checkable

from .schedule import Schedule


class KVLayout(StrEnum):
    """How a token's skipped planes are served: copied on exit (native) or routed by the exit map (alias)."""
    NATIVE = "native"
    ALIAS = "alias"


class ExitPolicyName(StrEnum):
    """When a token stops looping (formulas in exit_policy.py)."""
    FIXED = "fixed"
    OURO = "ouro"
    OURO_DELAYED = "ouro_delayed"
    REPLAY = "replay"


class AttentionBackendName(StrEnum):
    TORCH = "torch"
    TRITON = "triton"


class DescriptorMode(StrEnum):
    """How a step's host descriptor reaches the device: an async copy (h2d) or a mapped pinned read."""
    H2D = "h2d"
    MAPPED = "mapped"


def choice_values(enum: type[StrEnum]) -> tuple[str, ...]:
    """The accepted strings of a choice enum, in declaration order (as error messages list them)."""
    return tuple(m.value for m in enum)


# A value of a ``settings()`` dict (``LoopEngine.settings``, ``OuroModel.settings``): a JSON scalar.
Setting = str | int | float | bool | None


def setting_value(name: str, value) -> Setting:
    """``value`` as a plain JSON scalar of a ``settings()`` dict: a str (a choice enum as its value), a bool,
    an int (any integral number but a bool), a finite float, or None. TypeError / ValueError naming the
    setting ``name`` for anything else (a list, a dict, a tensor, NaN)."""
    if value is None or type(value) in (str, bool, int):
        return value
    if isinstance(value, str):
        return str(value)                  # a StrEnum's str() is its value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"setting {name!r} must be finite, got {value!r}")
        return float(value)
    raise TypeError(f"setting {name!r} must be a str, int, float, bool or None, got {type(value).__name__}")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime configuration of one arm (the runtime sees plain values, never Hydra objects)."""

    max_num_seqs: int = 8
    block_size: int = 16
    max_model_len: int = 512           # prompt + output positions per request
    num_blocks: int | None = None      # None: enough for every slot at max_model_len in every plane
    kv_layout: str = "native"          # a KVLayout value: native | alias
    prefix_tiles: bool = False         # alias only: direct reader for tiles before the first alias
    tile_size: int = 32
    attention_backend: str = "torch"   # an AttentionBackendName value: torch | triton
    exit_policy: str = "ouro_delayed"  # an ExitPolicyName value: fixed | ouro | ouro_delayed | replay
    schedule: Schedule | None = None   # required by replay
    cuda_graphs: bool = False
    graph_cache_size: int = 16
    # Batch invariance (DESIGN.md "Batch invariance"): every decode step runs on max_num_seqs rows (padding
    # rows do nothing) and prefill projections in calls of exactly prefill_call_rows rows, so every matmul
    # has one shape per engine and a request's tokens do not depend on what it is batched with.
    # False: decode on padded buckets (graphs.BUCKETS) and prefill in one call of its padded row count.
    batch_invariant: bool = True
    # Rows per prefill projection call (``prefill_call_rows`` resolves it); None: 256 when max_model_len
    # <= 1024, else 1024 (one value per engine, so batch invariance holds). Every call reads the whole
    # weight, so long prompts want larger calls, while a short admission pads up to one call. Measured on an H200, Ouro-1.4B B16 replay
    # (results/README.md, profiles/2026-12-02-9146d16): P2048/D64 654 tok/s at 256 rows, 707 at 512,
    # 727 at 1024, 734 at 2048; P128/D128 2,755 at 256 and 2,645 at 1024. A small model (the tiny preset,
    # tests) needs far fewer.
    prefill_gemm_rows: int | None = None
    descriptor_mode: str = "h2d"       # a DescriptorMode value: h2d | mapped
    # CUDA only (no effect elsewhere): a step's packed prefill loop runs on a second stream, concurrently with
    # the same step's decode loop, which never reads what it writes (other slots, other KV blocks); the
    # streams join at the end of the step. Prefill's compute-bound matmuls then fill some of the memory-bound
    # decode loop's gaps. The same kernels on the same inputs: tokens and exits do not change. Measured on an
    # H100, Ouro-1.4B replay (kernels/results/prefill_stream_probe_*_h100_d3cef7c.log): 1.010x at B16/C32,
    # 1.012x at B32/C64; queueing the decode loop first instead gave the same (1.009x, 1.008x).
    prefill_stream: bool = True
    eos_token_id: int | None = None
    keep_logits: bool = False          # tests: keep every sampled row's logits (costs memory)
    poison_kv: bool = False            # tests/debugging: KV cells without a live value hold NaN
    # diagnostics (the harness's natural-schedule trace): keep each decode row's survival S_r and each
    # sampled token's top-2 logits in ``LoopEngine.loop_trace``; reads the device every step, so a
    # traced run is never a timed one
    trace_loops: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_model_len", "tile_size", "graph_cache_size"):
            _set_int(self, name, f"EngineConfig.{name}", 1)
        if self.prefill_gemm_rows is not None:
            _set_int(self, "prefill_gemm_rows", "EngineConfig.prefill_gemm_rows", 1)
        if self.num_blocks is not None:
            _set_int(self, "num_blocks", "EngineConfig.num_blocks", 2)   # block 0 is reserved
        for name in ("prefix_tiles", "cuda_graphs", "batch_invariant", "prefill_stream", "keep_logits", "poison_kv",
                     "trace_loops"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.eos_token_id is not None:
            _set_int(self, "eos_token_id", "EngineConfig.eos_token_id", 0)
        if self.kv_layout not in choice_values(KVLayout):
            raise ValueError(f"unknown kv_layout {self.kv_layout!r}; expected one of {choice_values(KVLayout)}")
        if self.prefix_tiles and self.kv_layout != KVLayout.ALIAS:
            raise ValueError("prefix_tiles applies to kv_layout='alias' only")
        if self.attention_backend not in choice_values(AttentionBackendName):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; expected one of "
                             f"{choice_values(AttentionBackendName)}")
        if self.descriptor_mode not in choice_values(DescriptorMode):
            raise ValueError(f"unknown descriptor_mode {self.descriptor_mode!r}; expected 'h2d' or 'mapped'")
        if self.exit_policy not in choice_values(ExitPolicyName):
            raise ValueError(f"unknown exit policy {self.exit_policy!r}; expected one of "
                             f"{choice_values(ExitPolicyName)}")
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise TypeError(f"EngineConfig.schedule must be a Schedule or None, got {type(self.schedule).__name__}")
        if (self.exit_policy == ExitPolicyName.REPLAY) != (self.schedule is not None):
            raise ValueError("exit_policy='replay' needs a schedule, and a schedule needs exit_policy='replay'")
        if self.schedule is not None and self.schedule.max_num_seqs != self.max_num_seqs:
            raise ValueError(f"schedule was captured at max_num_seqs={self.schedule.max_num_seqs}, "
                             f"engine has max_num_seqs={self.max_num_seqs}: batch composition would differ")

    @property
    def prefill_call_rows(self) -> int:
        """Rows of each batch-invariant prefill projection call: ``prefill_gemm_rows``, or by default 256
        when ``max_model_len <= 1024`` and 1024 above it (the measurements beside the field)."""
        if self.prefill_gemm_rows is not None:
            return self.prefill_gemm_rows
        return 256 if self.max_model_len <= 1024 else 1024


@dataclass(frozen=True)
class Request:
    """One generation request: prompt token ids and its loop bounds."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    min_loops: int = 1
    max_loops: int = 4
    exit_threshold: float = 1.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TypeError(f"Request.request_id must be a non-empty string, got {self.request_id!r}")
        where = f"request {self.request_id!r}"
        # a set or a dict iterates in an order of its own: the prompt's order would be lost without a word
        if (isinstance(self.prompt_token_ids, (str, bytes, Set, Mapping))
                or not hasattr(self.prompt_token_ids, "__iter__")):
            raise TypeError(f"{where}: prompt_token_ids must be a sequence of ints, got {self.prompt_token_ids!r}")
        ids = tuple(self.prompt_token_ids)
        for t in ids:
            _check_int(f"{where}: prompt token id", t, 0)
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in ids))
        for name in ("max_tokens", "min_loops", "max_loops"):
            _set_int(self, name, f"{where}: {name}", 1)
        thr = self.exit_threshold
        if isinstance(thr, bool) or not isinstance(thr, numbers.Real) or not 0.0 < float(thr) <= 1.0:
            raise ValueError(f"{where}: exit_threshold must be a number in (0, 1], got {thr!r}")
        # a numpy float (np.float32 is no float) kept as given would not serialise into a schedule
        object.__setattr__(self, "exit_threshold", int(thr) if isinstance(thr, numbers.Integral) else float(thr))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"{where}: ignore_eos must be true or false, got {self.ignore_eos!r}")


def _check_int(name: str, value, minimum: int) -> None:
    """TypeError unless ``value`` is an integer (not a bool); ValueError if it is below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _set_int(obj, attr: str, name: str, minimum: int) -> None:
    """:func:`_check_int` on the frozen dataclass field ``obj.attr``, then store it as a plain int: a numpy
    integer passes the check but would not serialise into a schedule or a settings record."""
    value = getattr(obj, attr)
    _check_int(name, value, minimum)
    object.__setattr__(obj, attr, int(value))


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    token_ids: tuple[int, ...]
    exit_depths: tuple[int, ...]      # depth (number of loops) that produced each output token
    finish_reason: str                # length | stop | abort


@dataclass
class GraphCounters:
    """CUDA-graph counters of one graph kind (the decode core, or the full-prompt prefill loop)."""

    captures: int = 0                 # graphs recorded (all in the untimed warmup of a measured arm)
    replays: int = 0
    fallbacks: int = 0                # eager runs because the cache was full

    def minus(self, before: GraphCounters) -> GraphCounters:
        return GraphCounters(*(a - b for a, b in zip(astuple(self), astuple(before))))


@dataclass
class EngineStats:
    """Work counters of one engine (equal work across arms is part of the checker's contract)."""

    rows_per_depth: list[int]         # decode rows executed at depth 1..num_planes
    prefill_tokens: int = 0           # prompt tokens admitted
    prefill_rows: int = 0             # prompt tokens x loops run
    decode_tokens: int = 0            # output tokens sampled after a decode loop
    steps: int = 0
    decode_steps: int = 0
    peak_kv_blocks: int = 0           # a high-water mark: ``minus`` keeps it as it is
    decode_graphs: GraphCounters = field(default_factory=GraphCounters)    # recurrent-core graphs, by bucket
    prefill_graphs: GraphCounters = field(default_factory=GraphCounters)   # packed prefill-loop graphs, by rows

    WORK_FIELDS: ClassVar[tuple[str, ...]] = ("rows_per_depth", "prefill_tokens", "prefill_rows", "decode_tokens", "steps", "decode_steps")

    def copy(self) -> EngineStats:
        """A snapshot: later steps do not change it."""
        return replace(self, rows_per_depth=list(self.rows_per_depth), decode_graphs=replace(self.decode_graphs),
                       prefill_graphs=replace(self.prefill_graphs))

    def minus(self, before: EngineStats) -> EngineStats:
        """The counters of the runs between snapshot ``before`` and this one (peaks taken as they are)."""
        return EngineStats(
            rows_per_depth=[a - b for a, b in zip(self.rows_per_depth, before.rows_per_depth)],
            prefill_tokens=self.prefill_tokens - before.prefill_tokens,
            prefill_rows=self.prefill_rows - before.prefill_rows,
            decode_tokens=self.decode_tokens - before.decode_tokens,
            steps=self.steps - before.steps, decode_steps=self.decode_steps - before.decode_steps,
            peak_kv_blocks=self.peak_kv_blocks, decode_graphs=self.decode_graphs.minus(before.decode_graphs),
            prefill_graphs=self.prefill_graphs.minus(before.prefill_graphs))

    def work(self) -> dict:
        """The work counters the checker holds equal across arms, by name (a fresh dict)."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in
                ((k, getattr(self, k)) for k in self.WORK_FIELDS)}


@runtime_checkable
class Engine(Protocol):
    """What the benchmark session needs of an engine: submit requests, drain them, read counters.

    ``run`` returns one ``RequestOutput`` per submitted request id once every request has finished;
    ``stats`` counts the work done so far, cumulatively (the checker requires equal work across arms);
    ``capture_schedule`` freezes the exits of the natural run just drained (engines that cannot
    replay a schedule raise ``NotImplementedError``).

    Optional, and so not a member of this protocol (an engine without it satisfies it; callers read it with
    ``getattr``): ``settings() -> dict[str, Setting]``, what the engine resolved and runs with, as a flat
    dict of JSON scalars (:func:`setting_value`) keyed in snake_case (``LoopEngine.settings``). The harness
    records it beside each measured run (a raw record's ``engine_settings``; None for an engine without it).
    """

    stats: EngineStats

    def add_request(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def run(self) -> dict[str, RequestOutput]: ...

    def capture_schedule(self) -> Schedule: ...

    def reset_run(self) -> None:
        """Forget finished requests so the same ids can run again (the measured run after the warmup);
        graphs, buffers and the cumulative ``stats`` stay."""

    @property
    def trace_sha256(self) -> str | None:
        """sha256 of the host decisions of the current run (admissions, rows; DESIGN.md "Replay
        scheduling"), or None for an engine that keeps no row trace."""
