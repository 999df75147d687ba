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

The step function is vectorised over rows and has no host synchronisation; it works on any device.
"""
from __future__ import annotations

import torch

POLICIES = ("fixed", "ouro", "ouro_delayed", "replay")


def validate_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown exit policy {name!r}; expected one of {POLICIES}")
    return name


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
    if policy == "fixed":
        return at_max, s, triggered
    test = (threshold < 1.0) & (depth >= min_loops) & ((1.0 - s) >= threshold)
    if policy == "ouro":
        return at_max | test, s, triggered | test
    if policy == "ouro_delayed":
        return at_max | triggered, s, triggered | test
    raise ValueError(f"exit_step does not apply to policy {policy!r}")
