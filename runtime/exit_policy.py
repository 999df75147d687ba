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
``NaturalPolicy.exits_after_step`` reads the device (the gate decides there, so the host must learn it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from .api import ExitPolicyName, choice_values

if TYPE_CHECKING:
    from .api import Request
    from .schedule import Schedule, ScheduledRequest
    from .scheduler import Running

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
    """``fixed``, ``ouro`` or ``ouro_delayed``: the gate decides on the device; the host reads the exit
    flags once per step and, for requests that stop at EOS, the sampled tokens of exiting rows."""

    def __init__(self, name: str, eos_token_id: int | None):
        if name not in POLICIES or name == ExitPolicyName.REPLAY:
            raise ValueError(f"{name!r} is not a natural exit policy")
        self.name, self.eos_token_id = name, eos_token_id

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

    def exits_after_step(self, forced: list[bool], exit_flags: torch.Tensor) -> list[bool]:
        """Which of a step's rows exited: read from the device flags ([n] bool; one host sync)."""
        return exit_flags.tolist()

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

    def exits_after_step(self, forced: list[bool], exit_flags: torch.Tensor) -> list[bool]:
        return forced

    def needs_host_tokens(self, req: Request) -> bool:
        return False

    def stops(self, run: Running) -> bool:
        """Whether a request stops before ``max_tokens`` after its latest token: its schedule entry holds
        no more tokens (the natural run stopped there at EOS, and the replay follows it)."""
        return run.n_out >= len(run.entry.exit_depths)


def make_policy(name: str, schedule: Schedule | None, eos_token_id: int | None) -> NaturalPolicy | ReplayPolicy:
    """The policy object for ``EngineConfig.exit_policy`` (validated there)."""
    return ReplayPolicy(schedule) if name == ExitPolicyName.REPLAY else NaturalPolicy(name, eos_token_id)
