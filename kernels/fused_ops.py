"""Fused elementwise kernels for the recurrent core: RMSNorm, residual-add + RMSNorm pairs (the loop's last
one with the exit gate), rotary embedding in place, and SwiGLU's silu(gate) * up.

Why: in plain PyTorch one Ouro layer launches ~50 small elementwise kernels (an fp32 RMSNorm alone is
seven), so at decode batch sizes the loop is launch-bound (BRIEF section 3: RMSNorm 19% and residual /
SwiGLU elementwise 11% of a loop's kernel time at B16). Each function here is one launch and rounds
exactly where the torch reference (``*_ref``, same signature) rounds: every intermediate the reference
stores in the model dtype is rounded to it here too, so results agree to the last bit up to the order
of the fp32 mean-of-squares reduction.

Formulas: RMSNorm ``y = w * x / sqrt(mean(x^2) + eps)`` in fp32 (Zhang & Sennrich 2019, as in the HF
Ouro/Qwen2 RMSNorm); rotary embedding, rotate-half form (RoFormer, arXiv 2104.09864); SwiGLU
``silu(g) * u`` (Shazeer 2020); exit gate ``sigmoid(w . h + b)`` (Ouro's ``early_exit_gate``, BRIEF section 1).

On sm_90+ NVIDIA GPUs the two norm kernels launch with programmatic dependent launch (kernels/pdl.py): they
load their weights, wait for the previous kernel, load their inputs and release the next kernel before
they compute and store. So their norm weights must not be the output of the kernel just before them (the
decode loop passes model parameters, which no kernel writes); x and y may be.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl

# Where add_rms_norm's programs release their dependents under PDL: "late" (kernels/pdl.py TRIGGER's choice) or
# "early", right after their wait, so the next projection's programs become resident during the norm and start
# what they do before their own wait (kernels/wgmma_gemm.py: their first weight tiles). Read at launch (the
# throughput probe's ``--norm-trigger``); changes no value.
NORM_TRIGGER = "late"


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, hidden, stride_x, stride_out, eps, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)     # a weight: no kernel writes it
    pdl.wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.release(PDL)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(out_ptr + row * stride_out + offs, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, y_ptr, w1_ptr, w2_ptr, x_out_ptr, h_out_ptr, gw_ptr, gb_ptr, hazard_ptr, hidden,
                         stride_x, stride_y, stride_ys, stride_xo, stride_ho, eps, BLOCK: tl.constexpr,
                         SPLIT: tl.constexpr, PDL: tl.constexpr = False, GATE: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w1 = tl.load(w1_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # weights: no kernel writes them
    w2 = tl.load(w2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gw, gb = load_gate(gw_ptr, gb_ptr, offs, mask, GATE)
    pdl.wait(PDL)
    y = sum_partials(y_ptr + row * stride_y, offs, mask, stride_ys, SPLIT, x_out_ptr.dtype.element_ty, "")
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.release(PDL)
    norm_pair_store(x, y, w1, w2, gw, gb, x_out_ptr + row * stride_xo, h_out_ptr + row * stride_ho, hazard_ptr + row,
                    offs, mask, hidden, eps, GATE)


@triton.jit
def load_gate(gw_ptr, gb_ptr, offs, mask, GATE: tl.constexpr):
    """The exit gate's weight row and bias in fp32 (zeros without ``GATE``; nothing is loaded then)."""
    if GATE:
        gw = tl.load(gw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gb = tl.load(gb_ptr).to(tl.float32)
    else:
        gw = tl.zeros(offs.shape, tl.float32)
        gb = 0.0
    return gw, gb


@triton.jit
def sum_partials(y_row, offs, mask, stride_ys, SPLIT: tl.constexpr, OUT: tl.constexpr, CACHE: tl.constexpr):
    """One row of a projection's output: with ``SPLIT > 1`` its fp32 split-K partials (``stride_ys`` apart) summed
    in split order and rounded once to ``OUT`` (as ``gemm.reduce_partials``), else the row as stored. ``CACHE``:
    the loads' cache modifier ("" or ".cg", which reads past L1: rows another SM wrote in the same launch)."""
    y = tl.load(y_row + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    if SPLIT > 1:
        for s in tl.static_range(1, SPLIT):
            y += tl.load(y_row + s * stride_ys + offs, mask=mask, other=0.0, cache_modifier=CACHE)
        y = y.to(OUT)
    return y


@triton.jit
def norm_pair_store(x, y, w1, w2, gw, gb, x_out_row, h_out_row, hazard_at, offs, mask, hidden, eps,
                    GATE: tl.constexpr):
    """The sandwich-norm step of one row from its loaded residual ``x`` (fp32) and projection ``y``, rounding where
    ``add_rms_norm_ref`` does: stores x_new = x + RMSNorm(y; w1) and h = RMSNorm(x_new; w2), and with ``GATE``
    the exit gate's hazard on the stored h (the logit rounded to h's dtype, as ``F.linear``'s output is)."""
    y = y.to(tl.float32)
    inv_y = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / hidden + eps)
    normed = (w1 * (y * inv_y)).to(x_out_row.dtype.element_ty).to(tl.float32)   # rounded like the ref
    x_new = (x + normed).to(x_out_row.dtype.element_ty)
    tl.store(x_out_row + offs, x_new, mask=mask)
    xf = x_new.to(tl.float32)
    inv_x = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    h = (w2 * (xf * inv_x)).to(h_out_row.dtype.element_ty)
    tl.store(h_out_row + offs, h, mask=mask)
    if GATE:
        logit = (tl.sum(h.to(tl.float32) * gw, axis=0) + gb).to(h_out_row.dtype.element_ty).to(tl.float32)
        tl.store(hazard_at, 1.0 / (1.0 + tl.exp(-logit)))


@triton.jit
def rotate_head_(base, cos_row, sin_row, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate-half RoPE of one head in place: ``base`` points at its HALF * 2 elements, ``cos_row`` and
    ``sin_row`` at its position's table rows. Returns the rotated halves (in the head's dtype), so a
    caller can also store them elsewhere (kernels/kv_write.py writes them into the KV cache)."""
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    c = tl.load(cos_row + offs, mask=mask, other=0.0)
    s = tl.load(sin_row + offs, mask=mask, other=0.0)
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(c.dtype)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(c.dtype)
    r1 = (x1 * c - x2 * s).to(base.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(base.dtype.element_ty)
    tl.store(base + offs, r1, mask=mask)
    tl.store(base + HALF + offs, r2, mask=mask)
    return r1, r2


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, stride_row, stride_cos, HALF: tl.constexpr,
                 HALF_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    rotate_head_(qkv_ptr + row * stride_row + head * (2 * HALF), cos_ptr + pos * stride_cos,
                 sin_ptr + pos * stride_cos, HALF, HALF_PAD)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)     # rounded like the ref
    tl.store(out_ptr + row * stride_out + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, hidden: int) -> None:
    if t.dim() != 2 or t.shape[1] != hidden or t.stride(1) != 1:
        raise ValueError(f"{name} must be [N, {hidden}] with unit last stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row. x: [N, hidden] (bf16/fp16/fp32); weight: [hidden], read before the PDL wait (see
    the module docstring: a parameter, not the previous kernel's output). Returns [N, hidden] x.dtype."""
    hidden = weight.shape[0]
    _check_rows("x", x, hidden)
    out = torch.empty_like(x)
    if x.shape[0]:
        use_pdl = pdl.active(x)
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, hidden, x.stride(0), out.stride(0), eps,
                                        BLOCK=triton.next_power_of_2(hidden), PDL=pdl.mode(use_pdl),
                                        **pdl.launch_options(use_pdl, num_warps=4))
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sandwich-norm residual step and the next pre-norm in one pass.

    x_new = x + RMSNorm(y; w1); h = RMSNorm(x_new; w2). x: [N, hidden]; w1, w2: [hidden] (read before the PDL
    wait, as rms_norm's weight); y: [N, hidden],
    or fp32 split-K partials [S, N, hidden] of the projection that made it (kernels/gemm.py), which are
    summed in order s = 0, 1, ... and rounded to x.dtype first, as ``gemm.reduce_partials`` does.
    Returns (x_new, h), both [N, hidden] in x.dtype. Raises ValueError for a y of another shape.
    """
    return _add_rms_norm(x, y, w1, w2, eps, None, None)[:2]


def add_rms_norm_gate(x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float,
                      gate_w: torch.Tensor, gate_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` for a loop's last layer, with the exit gate on h in the same pass (one launch where
    ``F.linear`` + the slice's cast + ``torch.sigmoid`` took three): hazard = sigmoid(gate_w . h + gate_b), the
    logit rounded to x.dtype first, as ``F.linear``'s output is (BRIEF section 1: the early-exit gate is
    ``Linear(hidden, 1, bias=True)`` on the loop's normed output). gate_w: [1, hidden] or [hidden]; gate_b: [1];
    both read before the PDL wait. Returns (x_new, h, hazard [N] fp32). The logit's fp32 sum runs in another
    order than cuBLAS's, so hazard agrees with the unfused gate to rounding, not bitwise.
    """
    return _add_rms_norm(x, y, w1, w2, eps, *check_gate(gate_w, gate_b, w1.shape[0], x.device))


def check_vectors(device, hidden: int, **vectors: torch.Tensor) -> None:
    """ValueError naming a norm weight that is not ``[hidden]`` with unit stride on ``device`` (the kernels read
    it at ``ptr + offs``: a strided view would read other elements)."""
    for name, v in vectors.items():
        if v.shape != (hidden,) or v.stride(0) != 1 or v.device != device:
            raise ValueError(f"{name} must be [{hidden}] with unit stride on {device}, got {tuple(v.shape)} strides "
                             f"{v.stride()} on {v.device}")


def check_gate(gate_w: torch.Tensor, gate_b: torch.Tensor, hidden: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The exit gate's (weight as ``[hidden]``, bias) for a kernel; ValueError naming a weight that is not ``[1,
    hidden]`` or ``[hidden]`` with unit last stride, or a bias that is not one value, on ``device``."""
    if gate_w.shape not in ((1, hidden), (hidden,)) or gate_w.stride(-1) != 1 or gate_b.numel() != 1 \
            or gate_w.device != device or gate_b.device != device:
        raise ValueError(f"the gate must be a [1, {hidden}] or [{hidden}] weight with unit last stride and a one-value "
                         f"bias on {device}, got {tuple(gate_w.shape)} strides {gate_w.stride()} on {gate_w.device} "
                         f"and {tuple(gate_b.shape)} on {gate_b.device}")
    return gate_w.reshape(-1), gate_b


def _add_rms_norm(x, y, w1, w2, eps, gate_w, gate_b):
    """Both entry points: (x_new, h, hazard or None); the gate runs where ``gate_w`` is given."""
    hidden = w1.shape[0]
    _check_rows("x", x, hidden)
    check_vectors(x.device, hidden, w1=w1, w2=w2)
    split = 1
    if y.dim() == 3:
        if y.dtype != torch.float32 or not y.is_contiguous() or y.shape[1:] != x.shape:
            raise ValueError(f"partials y must be contiguous fp32 [S, {x.shape[0]}, {hidden}], got {y.dtype} "
                             f"{tuple(y.shape)}")
        split = y.shape[0]
        stride_ys = y.stride(0)
        y2 = y[0]
    else:
        stride_ys, y2 = 0, y
    _check_rows("y", y2, hidden)
    x_new, h = torch.empty_like(x), torch.empty_like(x)
    gate = gate_w is not None
    hazard = torch.empty(x.shape[0], device=x.device, dtype=torch.float32) if gate else None
    if x.shape[0]:
        use_pdl = pdl.active(x)
        _add_rms_norm_kernel[(x.shape[0],)](x, y2, w1, w2, x_new, h, gate_w if gate else w1, gate_b if gate else w1,
                                            hazard if gate else x_new, hidden, x.stride(0), y2.stride(0), stride_ys,
                                            x_new.stride(0), h.stride(0), eps,
                                            BLOCK=triton.next_power_of_2(hidden), SPLIT=split,
                                            PDL=pdl.mode(use_pdl, NORM_TRIGGER == "early"),
                                            GATE=gate, **pdl.launch_options(use_pdl, num_warps=8))
    return x_new, h, hazard


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          num_rotated_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate, in place, the first ``num_rotated_heads`` heads (q then k) of each fused qkv row.

    qkv: [N, (H + 2 Hkv) * head_dim], unit last stride; cos, sin: [max_len, head_dim // 2] fp32/fp64;
    positions: [N] int. Returns qkv.
    """
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < num_rotated_heads * head_dim:
        raise ValueError(f"qkv must be [N, >= {num_rotated_heads * head_dim}] with unit last stride, "
                         f"got {tuple(qkv.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != head_dim // 2 or not cos.is_contiguous():
        raise ValueError(f"cos/sin must be contiguous [max_len, {head_dim // 2}], got {tuple(cos.shape)}")
    if qkv.shape[0]:
        half = head_dim // 2
        _rope_kernel[(qkv.shape[0], num_rotated_heads)](qkv, cos, sin, positions, qkv.stride(0), cos.stride(0),
                                                        HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                                        num_warps=1)
    return qkv


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation. gate_up: [N, 2 I] (gate then up) -> [N, I] = silu(gate) * up, same dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [N, 2*I] with unit last stride, got {tuple(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), device=gate_up.device, dtype=gate_up.dtype)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=4)
    return out


# ------------------------------------------------------------------------------ torch references
def rms_norm_ref(x, weight, eps):
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    return (weight.to(acc) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def add_rms_norm_ref(x, y, w1, w2, eps):
    if y.dim() == 3:                    # split-K partials: summed in split order, rounded once
        total = y[0]
        for part in y[1:]:
            total = total + part
        y = total.to(x.dtype)
    x_new = x + rms_norm_ref(y, w1, eps)
    return x_new, rms_norm_ref(x_new, w2, eps)


def add_rms_norm_gate_ref(x, y, w1, w2, eps, gate_w, gate_b):
    x_new, h = add_rms_norm_ref(x, y, w1, w2, eps)
    logit = F.linear(h, gate_w.reshape(1, -1), gate_b.reshape(1))[:, 0]
    return x_new, h, torch.sigmoid(logit.to(torch.promote_types(h.dtype, torch.float32)))


def rope_ref(qkv, cos, sin, positions, num_rotated_heads, head_dim):
    out = qkv.clone()
    n, half = qkv.shape[0], head_dim // 2
    heads = out[:, :num_rotated_heads * head_dim].view(n, num_rotated_heads, head_dim).to(cos.dtype)
    c, s = cos[positions.long()][:, None, :], sin[positions.long()][:, None, :]
    x1, x2 = heads[..., :half], heads[..., half:]
    out[:, :num_rotated_heads * head_dim] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).reshape(n, -1).to(qkv.dtype)
    return out


def silu_mul_ref(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u
