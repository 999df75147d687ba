"""The typed records the harness stages hand each other: an arm's spec, one plan entry, a phase's
result and the arm record a session writes.

Each is a frozen dataclass with a ``SCHEMA_VERSION``; what goes into a bundle file is its ``to_dict()``
(plain JSON data), whose keys and values are the bundle contract's (the auditor reads them, with its
own code). :meth:`ArmSpec.engine_config` is the one place an arm becomes the runtime's ``EngineConfig``.
The runtime's types are imported where they are used, so importing this module loads no framework.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from .fileio import bundle_format

if TYPE_CHECKING:
    from loopbench.runtime.api import EngineConfig, EngineStats, RequestOutput
    from loopbench.runtime.schedule import Schedule

DEFAULT_ENGINE = "loopbench.runtime.engine:LoopEngine"
# The raw record's schema, the format contract's record.latest_schema (the auditor refuses a later one; STYLE rule
# 10): 2: records carry ``coverage`` (harness/coverage.py); 3: its ``padding_rows`` pads every decode step to
# max_num_seqs rows (the batch-invariant runtime, runtime/api.py EngineConfig.batch_invariant).
RECORD_SCHEMA = bundle_format()["documents"]["record"]["latest_schema"]


@dataclass(frozen=True)
class ArmSpec:
    """One arm: the runtime settings of ``conf.ArmConf`` as plain values, and the engine that runs them.

    ``engine`` is an import path ``"package.module:factory"``; the factory is called as
    ``factory(model, config: EngineConfig)`` and returns an ``Engine`` (runtime/api.py).
    """

    SCHEMA_VERSION: ClassVar[int] = 1

    kv_layout: str = "native"
    prefix_tiles: bool = False
    attention_backend: str = "torch"
    cuda_graphs: bool = False
    graph_cache_size: int = 16
    descriptor_mode: str = "h2d"
    block_size: int = 16
    tile_size: int = 32
    engine: str = DEFAULT_ENGINE

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> ArmSpec:
        """From the plan's ``config.arms.<name>`` (a plan without ``engine`` ran the default engine)."""
        return cls(**data)

    def to_plain(self) -> dict:
        """The arm as the plan and every arm record hold it (``arm_config``)."""
        return dataclasses.asdict(self)

    def engine_config(self, max_num_seqs: int, max_model_len: int, exit_policy: str,
                      schedule: Schedule | None = None) -> EngineConfig:
        """This arm's ``EngineConfig`` at batch capacity ``max_num_seqs`` (B) and ``max_model_len`` positions;
        ``exit_policy`` is the natural policy of a reference capture, or ``replay`` with its ``schedule``."""
        from loopbench.runtime.api import EngineConfig

        return EngineConfig(
            max_num_seqs=max_num_seqs, block_size=self.block_size, max_model_len=max_model_len,
            kv_layout=self.kv_layout, prefix_tiles=self.prefix_tiles, tile_size=self.tile_size,
            attention_backend=self.attention_backend, exit_policy=exit_policy, schedule=schedule,
            cuda_graphs=self.cuda_graphs, graph_cache_size=self.graph_cache_size,
            descriptor_mode=self.descriptor_mode)


@dataclass(frozen=True)
class OrderItem:
    """One arm run of a session's planned measurement order (``plan.json`` ``order.<device>[]``)."""

    SCHEMA_VERSION: ClassVar[int] = 1

    seq: int
    point: str           # a point key, B<max_num_seqs>C<num_requests>
    comparison: str
    pair: int
    position: str        # baseline | candidate
    slot: int            # 0: the pair's first arm, 1: its second
    arm: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OrderItem:
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def file_name(self) -> str:
        """The raw record's file name (the bundle contract's ``record`` placeholder)."""
        return f"{self.seq:05d}-{self.point}-{self.comparison}-p{self.pair}-{self.position}.json"


@dataclass(frozen=True)
class PhaseResult:
    """One untimed warmup or one timed run of an arm: what ``session.run_phase`` returns.

    ``stats`` are the counters of this run alone (``EngineStats.minus``); ``elapsed_s`` runs from the
    first submission to the synchronised drain; peak memory is None on the CPU; ``trace_sha256`` is None
    for an engine that keeps no row trace.
    """

    SCHEMA_VERSION: ClassVar[int] = 1

    elapsed_s: float
    outputs: Mapping[str, RequestOutput]
    stats: EngineStats
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    trace_sha256: str | None

    def work(self) -> dict:
        return self.stats.work()

    def graphs(self) -> dict:
        """Decode-core graphs as captures/replays/fallbacks, prefill graphs under the ``prefill_`` prefix:
        every ``*captures`` counter of a measured run must be zero."""
        return {**dataclasses.asdict(self.stats.decode_graphs),
                **{f"prefill_{k}": v for k, v in dataclasses.asdict(self.stats.prefill_graphs).items()}}

    def to_dict(self) -> dict:
        return {
            "elapsed_s": self.elapsed_s,
            "outputs": {rid: {"token_ids": [int(t) for t in o.token_ids], "exit_depths": [int(d) for d in o.exit_depths],
                              "finish_reason": o.finish_reason} for rid, o in sorted(self.outputs.items())},
            "work": self.work(), "graphs": self.graphs(),
            "memory": {"peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes},
            "kv_blocks_used": self.stats.peak_kv_blocks, "trace_sha256": self.trace_sha256,
        }


@dataclass(frozen=True)
class ArmRecord:
    """One completed arm of a session: ``raw/<device>/<OrderItem.file_name>`` holds its ``to_dict()``."""

    SCHEMA_VERSION: ClassVar[int] = RECORD_SCHEMA

    job: str                    # the device's name (the plan's order key)
    session: str                # the session id (``<name>.r<k>`` in the k-th resume)
    device: dict                # machine.child_device
    item: OrderItem
    max_num_seqs: int
    num_requests: int
    output_len: int
    arm_config: ArmSpec
    tokens_per_s: float
    warmup: PhaseResult | None  # None when the plan runs no warmup
    measured: PhaseResult
    coverage: dict              # coverage.derive of the point's frozen schedule for this arm
    telemetry_start: dict | None
    telemetry_end: dict | None
    measured_start_unix_s: float
    measured_end_unix_s: float
    telemetry_samples: list[dict] | None = None   # harness/sampler.py during the measured run; None without NVML
    sampler: dict | None = None                   # Sampler.record(): its rate, sample count and CPU seconds
    decode_timing: dict | None = None             # loop_timing.DecodeLoopTimer.record() of the measured run
    # engines.engine_settings of the measured run's engine (format 9): a flat dict of JSON scalars, what it
    # resolved and ran with (LoopEngine.settings); None for an engine without settings()
    engine_settings: dict | None = None

    def to_dict(self) -> dict:
        it = self.item
        return {"schema": self.SCHEMA_VERSION, "job": self.job, "session": self.session, "device": self.device,
                "seq": it.seq, "point": it.point, "max_num_seqs": self.max_num_seqs, "num_requests": self.num_requests,
                "output_len": self.output_len, "comparison": it.comparison, "pair": it.pair,
                "position": it.position, "slot": it.slot, "arm": it.arm, "arm_config": self.arm_config.to_plain(),
                "tokens_per_s": self.tokens_per_s, "warmup": None if self.warmup is None else self.warmup.to_dict(),
                "measured": self.measured.to_dict(), "coverage": self.coverage,
                "telemetry": {"start": self.telemetry_start, "end": self.telemetry_end,
                              "samples": self.telemetry_samples, "sampler": self.sampler},
                "wall_clock": {"measured_start_unix_s": self.measured_start_unix_s,
                               "measured_end_unix_s": self.measured_end_unix_s},
                "decode_timing": self.decode_timing, "engine_settings": self.engine_settings}
