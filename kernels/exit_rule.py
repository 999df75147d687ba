"""The exit rule of one decode loop for N rows in one launch (Triton): survival, the exit test and the delayed
flag, where torch takes a dozen tiny kernels under a natural policy and four under replay.

The rule is BRIEF section 1's, as ``runtime/exit_policy.exit_step`` states it in torch (the definition; the tests
hold this kernel to it bitwise, since it is the same float operations in the same order): after loop r, with
hazard h_r, ``S_r = S_{r-1} * (1 - h_r)``; ``fixed`` exits at ``max_loops``; ``ouro`` also when threshold < 1,
r >= min_loops and ``1 - S_r >= threshold``; ``ouro_delayed`` consumes that test one loop late (a flag carried to
the token's next loop); ``replay`` takes the exits the schedule forces and still advances survival. The slot
bounds (min_loops, max_loops, threshold) are read per row from the runner's [S + 1] tables; each row's
max_loops is also returned, which the native fill needs after the step.

Bitwise needs one compile option: Triton contracts a multiply and an add into one fused multiply-add by default,
and ``1 - survival * (1 - hazard)`` compiled that way (seen in the sm_90 PTX: ``fma.rn.f32``) skips the
rounding of S_r that torch does before the subtraction, which flips an exit whose ``1 - S_r`` lies within an ulp
of the threshold. The launch sets ``enable_fp_fusion=False``.

One program per ``BLOCK`` rows; no host synchronisation, so it runs inside the decode step's CUDA graph. On
sm_90+ it launches with programmatic dependent launch like the step's other kernels (kernels/pdl.py): it waits
before its first load and releases the next kernel once it has the rows' own inputs (what it loads after that,
forced and the slot bounds, no kernel of the step writes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

POLICIES = ("fixed", "ouro", "ouro_delayed", "replay")


@triton.jit
def _exit_rule_kernel(hazard_ptr, depth_ptr, survival_ptr, triggered_ptr, forced_ptr, sl_ptr, min_loops_ptr,
                      max_loops_ptr, threshold_ptr, exit_ptr, s_ptr, trig_ptr, row_max_ptr, n,
                      POLICY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    pdl.wait(PDL)                 # the hazard and the carried state are the step's earlier kernels' outputs
    hazard = tl.load(hazard_ptr + offs, mask=mask, other=0.0)
    survival = tl.load(survival_ptr + offs, mask=mask, other=1.0)
    depth = tl.load(depth_ptr + offs, mask=mask, other=0)
    triggered = tl.load(triggered_ptr + offs, mask=mask, other=0) != 0
    sl = tl.load(sl_ptr + offs, mask=mask, other=0)
    max_loops = tl.load(max_loops_ptr + sl, mask=mask, other=0)
    pdl.release(PDL)
    s = survival * (1.0 - hazard)                              # S_r, as exit_step computes it
    if POLICY == 3:                                            # replay: the schedule's exits
        exit_now = tl.load(forced_ptr + offs, mask=mask, other=0) > 0
        trig = triggered
    else:
        at_max = depth >= max_loops
        if POLICY == 0:                                        # fixed
            exit_now = at_max
            trig = triggered
        else:
            min_loops = tl.load(min_loops_ptr + sl, mask=mask, other=0)
            threshold = tl.load(threshold_ptr + sl, mask=mask, other=1.0)
            test = (threshold < 1.0) & (depth >= min_loops) & ((1.0 - s) >= threshold)
            if POLICY == 1:                                    # ouro: this loop's test
                exit_now = at_max | test
            else:                                              # ouro_delayed: the test of an earlier loop
                exit_now = at_max | triggered
            trig = triggered | test
    tl.store(exit_ptr + offs, exit_now, mask=mask)
    tl.store(s_ptr + offs, s, mask=mask)
    tl.store(trig_ptr + offs, trig, mask=mask)
    tl.store(row_max_ptr + offs, max_loops, mask=mask)


def exit_rule(policy: str, hazard: torch.Tensor, depth: torch.Tensor, survival: torch.Tensor,
              triggered: torch.Tensor, forced: torch.Tensor, sl: torch.Tensor, min_loops: torch.Tensor,
              max_loops: torch.Tensor, threshold: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advance the exit rule by one loop for N rows (module docstring).

    Args:
        policy: one of :data:`POLICIES`. hazard: [N] float (h_r); depth: [N] int32 (r, the loop just run);
        survival: [N], hazard's dtype (S_{r-1}); triggered: [N] bool (the delayed flag carried in); forced: [N]
        int32 (replay: > 0 exits; read only under replay); sl: [N] int64 slots (padding rows: the scratch slot);
        min_loops, max_loops: [S + 1] int32; threshold: [S + 1], hazard's dtype. All on one device.

    Returns:
        (exit_now [N] bool, S_r [N], triggered after this loop [N] bool, max_loops of each row's slot [N] int32):
        under ``fixed`` / ``ouro`` / ``ouro_delayed`` bitwise ``exit_step`` with the bounds gathered by ``sl``;
        under ``replay`` (forced > 0, S_r, triggered).

    Raises:
        ValueError: an unknown policy, or tensors of other shapes, dtypes or devices.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    n = hazard.shape[0]
    rows = {"hazard": hazard, "depth": depth, "survival": survival, "triggered": triggered, "forced": forced, "sl": sl}
    dtypes = {"depth": torch.int32, "triggered": torch.bool, "forced": torch.int32, "sl": torch.int64,
              "survival": hazard.dtype}
    for name, t in rows.items():
        if t.shape != (n,) or not t.is_contiguous() or t.device != hazard.device or t.dtype != dtypes.get(name, t.dtype):
            raise ValueError(f"{name} must be a contiguous [{n}] {dtypes.get(name, t.dtype)} tensor on {hazard.device}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    for name, t, dtype in (("min_loops", min_loops, torch.int32), ("max_loops", max_loops, torch.int32),
                           ("threshold", threshold, hazard.dtype)):
        if t.dim() != 1 or t.shape != min_loops.shape or not t.is_contiguous() or t.dtype != dtype \
                or t.device != hazard.device:
            raise ValueError(f"{name} must be a contiguous [S + 1] {dtype} tensor on {hazard.device} like min_loops, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    exit_now = torch.empty(n, dtype=torch.bool, device=hazard.device)
    s, trig = torch.empty_like(survival), torch.empty_like(triggered)
    row_max = torch.empty(n, dtype=torch.int32, device=hazard.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        use_pdl = pdl.active(hazard)
        _exit_rule_kernel[(triton.cdiv(n, block),)](hazard, depth, survival, triggered, forced, sl, min_loops,
                                                    max_loops, threshold, exit_now, s, trig, row_max, n,
                                                    POLICY=POLICIES.index(policy), BLOCK=block, PDL=pdl.mode(use_pdl),
                                                    **pdl.launch_options(use_pdl, num_warps=1, enable_fp_fusion=False))
    return exit_now, s, trig, row_max
