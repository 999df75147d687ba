"""Exit policies: when a token stops looping.

Formulas (BRIEF section 1; Ouro, arXiv 2510.25741): after loop r the gate gives the hazard
``h_r = sigmoid(gate(norm_r))``; survival ``S_r = prod_{i<=r} (1 - h_i)``; cumulative exit probability
``1 - S_r``. Every loop's hazard counts, also those before ``min_loops``.

- ``fixed``: exit after loop ``max_loops`` (threshold 1.0).
- ``ouro``: exit after loop r when ``r >= max_loops``, or when ``threshold < 1``, ``r >= min_loops`` and
  ``1 - S_r >= threshold``.
- ``ouro_delayed``: the same test, consumed one loop late: if it first holds at r the token exits after
  ``min(r + 1, max_loops)``, so an asynchronous runtime may launch loop r+1 before reading loop r's gate.
- ``replay``: the exit depth is forced from a frozen schedule; the gate is still computed.

A policy is one object with the same methods for both kinds (:class:`NaturalPolicy`,
:class:`ReplayPolicy`, made by :func:`make_policy`): the scheduler asks it for the host-known exits of
a step's rows, the runner for the device exit rule, the engine for the exits after a step and whether a
request stops early. The device methods are vectorised over rows and never synchronise with the host; only
``NaturalPolicy.exits_after_step`` reads the device (the gate decides there, so the host must learn it;
under ``ouro_delayed`` one step late, without stalling the GPU).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .api import ExitPolicyName, choice_values

if TYPE_CHECKING:
    from .api import Request
    from .schedule import Schedule, ScheduledRequest
    from .scheduler import Running, StepPlan

POLICIES = choice_values(ExitPolicyName)


def exit_step(policy: str, hazard: torch.Tensor, depth: torch.Tensor, survival: torch.Tensor,
              triggered: torch.Tensor, min_loops: torch.Tensor, max_loops: torch.Tensor,
              threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advance the exit rule by one loop for N rows (natural policies only).

    hazard: [N] float (h_r); depth: [N] int (r, 1-based, the loop just run); survival: [N] float
    (S_{r-1}, 1 at r = 1); triggered: [N] bool (the delayed test held at an earlier loop);
    min_loops, max_loops: [N] int; threshold: [N] float.
    Returns (exit_now [N] bool, S_r [N], triggered after this loop [N] bool).
    Raises ValueError for ``replay`` (its exits come from the schedule, not the gate).
    """
    s = survival * (1.0 - hazard)
    at_max = depth >= max_loops
    if policy == ExitPolicyName.FIXED:
        return at_max, s, triggered
    test = (threshold < 1.0) & (depth >= min_loops) & ((1.0 - s) >= threshold)
    if policy == ExitPolicyName.OURO:
        return at_max | test, s, triggered | test
    if policy == ExitPolicyName.OURO_DELAYED:
        return at_max | triggered, s, triggered | test
    raise ValueError(f"exit_step does not apply to policy {policy!r}")


class SlotBounds(Protocol):
    """The per-slot exit-rule inputs resident on the device: [S + 1] min_loops, max_loops int32 and
    threshold float (row S is the padding scratch slot)."""

    min_loops: torch.Tensor
    max_loops: torch.Tensor
    threshold: torch.Tensor


class NaturalPolicy:
    """``fixed``, ``ouro`` or ``ouro_delayed``: the gate decides on the device, and the host learns each
    step's exits as late as the rule allows, so that it never waits for the step it has just launched.

    - ``fixed``: a row exits at ``max_loops``; the host knows that without reading anything.
    - ``ouro_delayed``: a row exits after loop r when r = max_loops or the test held at an earlier loop of
      its token; the loop-(r-1) flags come from the *previous* step, read back asynchronously (a pinned
      copy and an event recorded after that step). The host waits for the previous step only, while the
      GPU runs the one just launched. It also reads that step's device exit flags and checks them
      against what it predicted one step before (a mismatch is a RuntimeError: host and device state
      would have diverged).
    - ``ouro``: loop r's own gate decides, so the host reads the step's exit flags at once (one sync).

    Requests that stop at EOS additionally have the sampled tokens of exiting rows read (a sync).
    """

    def __init__(self, name: str, eos_token_id: int | None, max_num_seqs: int = 0):
        if name not in POLICIES or name == ExitPolicyName.REPLAY:
            raise ValueError(f"{name!r} is not a natural exit policy")
        self.name, self.eos_token_id = name, eos_token_id
        self._triggered = np.zeros(max_num_seqs, dtype=bool)   # per slot, after its latest loop read back
        self._reads: list[tuple[torch.Tensor, object]] = []     # two pinned [2, S] bool buffers + events
        self._pending: tuple[int, np.ndarray, np.ndarray] | None = None   # (buffer, slots, predicted exits)
        self._turn = 0

    def check_request(self, req: Request) -> None:
        """ValueError if the request cannot run under this policy."""
        if not req.ignore_eos and self.eos_token_id is None:
            raise ValueError(f"request {req.request_id!r}: ignore_eos=False needs EngineConfig.eos_token_id")

    def entry_for(self, req: Request) -> ScheduledRequest | None:
        return None

    def forced_exits(self, rows: list[Running]) -> list[bool]:
        """The descriptor's forced-exit column for decode rows (none: the gate decides)."""
        return [False] * len(rows)

    def device_step(self, hazard, depth, survival, triggered, forced, bounds: SlotBounds, sl):
        """The exit rule on the device for N rows of slots ``sl`` [N] int64 (see :func:`exit_step`);
        ``forced`` is ignored. Returns (exit_now [N] bool, S_r [N], triggered [N] bool)."""
        return exit_step(self.name, hazard, depth, survival, triggered, bounds.min_loops[sl],
                         bounds.max_loops[sl], bounds.threshold[sl])

    def exits_after_step(self, plan: StepPlan, exit_flags: torch.Tensor, triggered: torch.Tensor) -> list[bool]:
        """Which of the step's rows exit after this loop (see the class docstring for when the host learns
        it). exit_flags, triggered: [n] bool device outputs of the step just launched."""
        if self.name == ExitPolicyName.OURO:
            return exit_flags.tolist()                       # this loop's own gate decides: one sync
        self.drain()
        slots, depth = plan.rows[:, 0], plan.rows[:, 1]
        exits = depth >= np.array([r.req.max_loops for r in plan.decode])
        if self.name == ExitPolicyName.OURO_DELAYED:
            exits |= (depth > 1) & self._triggered[slots]
            self._read_later(slots, exits, exit_flags, triggered)
        return exits.tolist()

    def _read_later(self, slots: np.ndarray, exits: np.ndarray, exit_flags: torch.Tensor,
                    triggered: torch.Tensor) -> None:
        """Start copying a step's flags to the host without waiting for them (``drain`` collects them)."""
        n = slots.shape[0]
        if not exit_flags.is_cuda:
            self._triggered[slots] = triggered.numpy()
            self._check(exits, exit_flags.numpy())
            return
        if not self._reads:
            S = self._triggered.shape[0]
            self._reads = [(torch.empty((2, S), dtype=torch.bool, pin_memory=True), torch.cuda.Event())
                           for _ in range(2)]
        buf, event = self._reads[self._turn]
        buf[0, :n].copy_(exit_flags, non_blocking=True)
        buf[1, :n].copy_(triggered, non_blocking=True)
        event.record()
        self._pending = (self._turn, slots.copy(), exits)
        self._turn ^= 1

    def drain(self) -> None:
        """Collect the flags of the step read back last (waits for that step's GPU work, not later ones)."""
        if self._pending is None:
            return
        turn, slots, exits = self._pending
        self._pending = None
        buf, event = self._reads[turn]
        event.synchronize()
        flags = buf[:, :slots.shape[0]].numpy()
        self._triggered[slots] = flags[1]
        self._check(exits, flags[0])

    @staticmethod
    def _check(predicted: np.ndarray, device: np.ndarray) -> None:
        if not np.array_equal(predicted, device):
            raise RuntimeError(f"the host predicted exits {predicted.tolist()} for a step, the device took "
                               f"{device.tolist()}: host and device exit state diverged")

    def needs_host_tokens(self, req: Request) -> bool:
        """Whether the host must see this request's tokens (to stop at EOS)."""
        return not req.ignore_eos

    def stops(self, run: Running) -> bool:
        """Whether a request stops before ``max_tokens`` after its latest token: it was EOS."""
        return not run.req.ignore_eos and run.host_tokens[-1] == self.eos_token_id


class ReplayPolicy:
    """``replay``: every exit depth comes from the frozen schedule, so the host knows each step's exits
    before it runs and never reads the device inside a step; the gate is still computed."""

    name = ExitPolicyName.REPLAY.value

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def check_request(self, req: Request) -> None:
        """ValueError unless the request is the schedule's (same prompt and bounds)."""
        self.schedule.check_fits(req)

    def entry_for(self, req: Request) -> ScheduledRequest:
        return self.schedule.check_fits(req)

    def forced_exits(self, rows: list[Running]) -> list[bool]:
        """Per decode row: does the loop it runs now reach its token's scheduled exit depth."""
        return [r.depth == r.entry.exit_depths[r.n_out] for r in rows]

    def device_step(self, hazard, depth, survival, triggered, forced, bounds: SlotBounds, sl):
        """Forced exits ``forced > 0`` ([N] int32); survival advances as the gate says."""
        return forced > 0, survival * (1.0 - hazard), triggered

    def exits_after_step(self, plan: StepPlan, exit_flags: torch.Tensor, triggered: torch.Tensor) -> list[bool]:
        return plan.forced

    def drain(self) -> None:
        """Nothing is read back under replay."""

    def needs_host_tokens(self, req: Request) -> bool:
        return False

    def stops(self, run: Running) -> bool:
        """Whether a request stops before ``max_tokens`` after its latest token: its schedule entry holds
        no more tokens (the natural run stopped there at EOS, and the replay follows it)."""
        return run.n_out >= len(run.entry.exit_depths)


def make_policy(name: str, schedule: Schedule | None, eos_token_id: int | None,
                max_num_seqs: int) -> NaturalPolicy | ReplayPolicy:
    """The policy object for ``EngineConfig.exit_policy`` (validated there)."""
    if name == ExitPolicyName.REPLAY:
        return ReplayPolicy(schedule)
    return NaturalPolicy(name, eos_token_id, max_num_seqs)
