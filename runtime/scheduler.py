"""The scheduler: which work each engine step runs, decided on the host.

It owns the FIFO queue, the ``max_num_seqs`` resident slots (a :class:`Running` per request), KV
growth and admission through the KV cache's allocator, and the row trace. :meth:`Scheduler.schedule`
returns a frozen :class:`StepPlan`: who was admitted, which prefill loops run, and the decode rows with
their descriptor (slot, depth, position, first-alias, forced exit). Under ``replay`` the plan also holds
every exit of the step, known before it runs (DESIGN.md "Replay scheduling"). The scheduler never
touches device values; it knows nothing of models, graphs or outputs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .api import EngineConfig, Request
from .exit_policy import NaturalPolicy, ReplayPolicy
from .kv_cache import DepthKVCache, OutOfBlocksError
from .schedule import ScheduledRequest


@dataclass(eq=False)
class Running:
    """Host-side state of a resident request."""

    req: Request
    slot: int
    entry: ScheduledRequest | None    # replay: the request's frozen exits
    phase: str = "prefill"            # prefill | decode
    depth: int = 1                    # the loop this request runs next
    pos: int = 0                      # decode: position of the token being computed
    n_out: int = 0
    exit_depths: list[int] = field(default_factory=list)
    host_tokens: list[int] = field(default_factory=list)   # only filled when EOS must be detected
    first_alias: dict[int, int] = field(default_factory=dict)  # depth -> first position with e_p < depth


@dataclass(frozen=True)
class PrefillLoop:
    """One full-prompt loop of a prefilling request."""

    slot: int
    depth: int                        # the loop to run
    final: bool                       # depth == max_loops: this loop samples the first output token


@dataclass(frozen=True)
class StepPlan:
    """The host's decision for one engine step."""

    admitted: tuple[Running, ...]     # admitted this step (KV opened); their prompts still to be staged
    prefill: tuple[PrefillLoop, ...]  # one loop per prefilling request, in slot order (run as one pack)
    decode: tuple[Running, ...]       # requests decoding since before this step, in slot order
    rows: np.ndarray | None           # [len(decode), DESC_ROWS] int32: slot, depth, pos, first-alias, forced
    forced: list[bool]                # per decode row: the exit the host knows in advance (replay), else False


class Scheduler:
    """FIFO admission into slots, KV growth and the per-step plan, for one engine."""

    def __init__(self, config: EngineConfig, kv: DepthKVCache, policy: NaturalPolicy | ReplayPolicy, *,
                 vocab_size: int, num_planes: int):
        self.config, self.kv, self.policy = config, kv, policy
        self.vocab_size, self.num_planes = vocab_size, num_planes
        self.queue: list[Request] = []
        self.slots: list[Running | None] = [None] * config.max_num_seqs
        self.admission_order: list[str] = []
        self._ids: set[str] = set()
        self._trace = hashlib.sha256()

    # ----------------------------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        """Queue a request (FIFO). ValueError names the offending field."""
        if not isinstance(req, Request):
            raise TypeError(f"add_request needs a Request, got {type(req).__name__} {req!r}")
        if req.request_id in self._ids:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r}: empty prompt")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {req.request_id!r}: token id {bad[0]} outside [0, {self.vocab_size})")
        if not 1 <= req.min_loops <= req.max_loops <= self.num_planes:
            raise ValueError(f"request {req.request_id!r}: need 1 <= min_loops ({req.min_loops}) <= max_loops "
                             f"({req.max_loops}) <= total_ut_steps ({self.num_planes})")
        need = len(req.prompt_token_ids) + req.max_tokens - 1
        if need > self.config.max_model_len:
            raise ValueError(f"request {req.request_id!r}: prompt + max_tokens - 1 = {need} positions exceed "
                             f"max_model_len={self.config.max_model_len}")
        self.policy.check_request(req)
        self._ids.add(req.request_id)
        self.queue.append(req)

    def take_queued(self, request_id: str) -> Request | None:
        """Remove and return a queued request, or None if it is not queued."""
        for i, r in enumerate(self.queue):
            if r.request_id == request_id:
                return self.queue.pop(i)
        return None

    def running(self, request_id: str) -> Running | None:
        return next((r for r in self.slots if r is not None and r.req.request_id == request_id), None)

    def free(self, run: Running) -> None:
        """A finished or aborted request leaves its slot; its blocks return to the pool (stream order)."""
        self.kv.close_slot(run.slot)
        self.slots[run.slot] = None

    def has_unfinished(self) -> bool:
        return bool(self.queue) or any(r is not None for r in self.slots)

    def reset_run(self) -> None:
        """Forget the request ids and admissions of the run just drained; restart the row trace."""
        self._ids.clear()
        self.admission_order.clear()
        self._trace = hashlib.sha256()

    @property
    def trace_sha256(self) -> str:
        """Hash of the admission and row trace so far (DESIGN.md "Replay scheduling")."""
        return self._trace.copy().hexdigest()

    # --------------------------------------------------------------------------------------- plan
    def schedule(self) -> StepPlan:
        """Plan one step: grow KV for decode rows at depth 1, admit, one prefill loop per prefilling
        request, one decode loop for the rows decoding when the step began. Raises OutOfBlocksError
        before changing anything when the pool cannot hold the running requests' next positions."""
        decode = [r for r in self.slots if r is not None and r.phase == "decode"]
        self._grow(decode)
        admitted = self._admit()
        prefill = tuple(PrefillLoop(r.slot, r.depth, r.depth >= r.req.max_loops)
                        for r in self.slots if r is not None and r.phase == "prefill")
        for p in prefill:
            self._trace.update(f"P{p.slot}:{p.depth};".encode())
        if not decode:
            return StepPlan(admitted, prefill, (), None, [])
        forced = self.policy.forced_exits(decode)
        rows = np.array([(r.slot, r.depth, r.pos, min(r.first_alias.get(r.depth, r.pos + 1), r.pos + 1), f)
                         for r, f in zip(decode, forced)], dtype=np.int32)
        self._trace.update(("D" + ",".join(f"{r.slot}:{r.depth}:{r.pos}" for r in decode) + ";").encode())
        return StepPlan(admitted, prefill, tuple(decode), rows, forced)

    def _grow(self, decode: list[Running]) -> None:
        growing = [r for r in decode if r.depth == 1]
        need = sum(self.kv.new_blocks_needed(r.slot, r.pos + 1) for r in growing)
        if need > self.kv.allocator.num_free:
            raise OutOfBlocksError(
                f"the running requests {[r.req.request_id for r in growing]} need {need} more KV blocks, "
                f"{self.kv.allocator.num_free} of {self.kv.allocator.num_blocks} are free: raise "
                f"EngineConfig.num_blocks or lower max_num_seqs")
        for r in growing:
            self.kv.ensure_capacity(r.slot, r.pos + 1)

    def _admit(self) -> tuple[Running, ...]:
        admitted = []
        for slot in range(self.config.max_num_seqs):
            if not self.queue:
                break
            if self.slots[slot] is None:
                req = self.queue[0]
                T = len(req.prompt_token_ids)
                need = self.kv.blocks_for(T) * req.max_loops
                if need > self.kv.allocator.num_free:
                    if any(r is not None for r in self.slots):
                        break               # FIFO: wait until a running request frees blocks
                    raise OutOfBlocksError(
                        f"request {req.request_id!r} needs {need} KV blocks for its {T}-token prompt, the pool "
                        f"has {self.kv.allocator.num_free} free of {self.kv.allocator.num_blocks}: raise "
                        f"EngineConfig.num_blocks")
                self.queue.pop(0)
                run = Running(req=req, slot=slot, entry=self.policy.entry_for(req))
                self.kv.open_slot(slot, req.max_loops, T, prompt_exit_depth=req.max_loops)
                self.slots[slot] = run
                self.admission_order.append(req.request_id)
                self._trace.update(f"A{slot}:{req.request_id!r};".encode())
                admitted.append(run)
        return tuple(admitted)
