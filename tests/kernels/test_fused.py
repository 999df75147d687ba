"""Fused elementwise kernels == their torch references (interpreter on CPU, bf16 on CUDA)."""
import pytest
import torch

from loopbench.kernels import fused_ops as fo

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _close(a, b, what):
    diff = (a.double() - b.double()).abs()
    msg = f"{what}: max diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"
    # a few units in the last place: the fp32 reduction order differs from torch's, and one ulp of an
    # intermediate rounded to bf16 (as the reference rounds it) can move the output by one ulp.
    # The Triton interpreter's fp32 -> bf16 conversion differs from round-to-nearest in about half
    # the elements (seen with Triton 3.9), and the add-norm pair propagates that, so the CPU allows 8.
    ulps = 2 if (a.dtype == torch.bfloat16 and a.is_cuda) else 8
    tol = ulps * torch.finfo(a.dtype).eps * b.double().abs().clamp(min=1.0)
    assert bool((diff <= tol).all()), msg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (17, 2048)])
def test_norms(device, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x, y = (torch.randn(rows, hidden, generator=g).to(device, dtype) for _ in range(2))
    w1, w2 = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype), torch.randn(hidden, generator=g).to(device, dtype)
    _close(fo.rms_norm(x, w1, 1e-6), fo.rms_norm_ref(x, w1, 1e-6), "rms_norm")
    xn, h = fo.add_rms_norm(x, y, w1, w2, 1e-6)
    xr, hr = fo.add_rms_norm_ref(x, y, w1, w2, 1e-6)
    _close(xn, xr, "add_rms_norm x")
    _close(h, hr, "add_rms_norm h")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,split", [(1, 64, 1), (5, 96, 3), (17, 2048, 4)])
def test_add_rms_norm_gate(device, dtype, rows, hidden, split):
    """The last layer's norm with the exit gate: x_new and h bitwise those of add_rms_norm (same kernel, same
    code path), the hazard that of F.linear + sigmoid on that h up to the logit's last bit (another fp32 sum order,
    then rounded to the model dtype: at most one ulp of the logit, times sigmoid's slope <= 1/4)."""
    g = torch.Generator().manual_seed(rows * hidden + split)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    y = (torch.randn(split, rows, hidden, generator=g).to(device) if split > 1
         else torch.randn(rows, hidden, generator=g).to(device, dtype))
    w1, w2 = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype), torch.randn(hidden, generator=g).to(device, dtype)
    gate_w = (torch.randn(1, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    gate_b = torch.randn(1, generator=g).to(device, dtype)
    xn, h, hazard = fo.add_rms_norm_gate(x, y, w1, w2, 1e-6, gate_w, gate_b)
    xa, ha = fo.add_rms_norm(x, y, w1, w2, 1e-6)
    assert torch.equal(xn, xa) and torch.equal(h, ha), "the gate changed x_new or h"
    assert hazard.dtype == torch.float32 and hazard.shape == (rows,)
    assert_hazard(hazard, torch.sigmoid(torch.nn.functional.linear(h, gate_w, gate_b)[:, 0].float()), dtype)
    xr, hr, href = fo.add_rms_norm_gate_ref(x, y, w1, w2, 1e-6, gate_w, gate_b)
    _close(xn, xr, "add_rms_norm_gate x")
    _close(h, hr, "add_rms_norm_gate h")
    assert href.dtype == torch.float32 and href.shape == (rows,)
    assert_hazard(hazard, href, dtype, ulps=2)           # the reference's h differs from the kernel's by an ulp


def assert_hazard(hazard, ref, dtype, ulps=1):
    """hazard = sigmoid(logit) with the logit rounded to ``dtype``: within ``ulps`` of the logit (times sigmoid's
    slope, at most 1/4) of ``ref``, and, for a 2-byte dtype, its logit on that dtype's grid (to fp32 error, where
    sigmoid is not flat), which a logit left unrounded would miss by up to half a spacing."""
    logit = torch.logit(ref.double())
    diff = (hazard.double() - ref.double()).abs()
    tol = ulps * 0.25 * torch.finfo(dtype).eps * logit.abs().clamp(min=1.0) + 1e-6
    assert bool((diff <= tol).all()), f"hazard: max diff {diff.max().item():.3e}"
    if dtype in (torch.bfloat16, torch.float16):
        h = hazard.double()
        inner = (h > 0.01) & (h < 0.99)
        got = torch.log(h[inner] / (1 - h[inner]))
        off = (got - got.to(dtype).double()).abs()
        assert bool((off <= 1e-4 * got.abs().clamp(min=1.0)).all()), f"logit off the {dtype} grid by {off.max().item():.2e}"


def test_add_rms_norm_gate_names_a_bad_gate_or_norm_weight():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"the gate must be a \[1, 8\] or \[8\] weight .* got \(1, 4\)"):
        fo.add_rms_norm_gate(x, x, torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 4), torch.zeros(1))
    with pytest.raises(ValueError, match=r"got \(2, 4\)"):          # as many elements as hidden, another shape
        fo.add_rms_norm_gate(x, x, torch.ones(8), torch.ones(8), 1e-6, torch.ones(2, 4), torch.zeros(1))
    with pytest.raises(ValueError, match="one-value bias"):
        fo.add_rms_norm_gate(x, x, torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 8), torch.zeros(2))
    with pytest.raises(ValueError, match=r"w2 must be \[8\] with unit stride"):   # a strided view reads other elements
        fo.add_rms_norm(x, x, torch.ones(8), torch.ones(16)[::2], 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (4, 2, 24), (16, 16, 128)])
def test_rope_in_place(device, dtype, heads, kv_heads, head_dim):
    from loopbench.runtime.model import OuroConfig, rope_tables
    g = torch.Generator().manual_seed(head_dim)
    n = 9
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    cfg = OuroConfig(head_dim=head_dim, rope_theta=10_000.0)
    cos, sin = rope_tables(cfg, 300, device)
    pos = torch.randint(0, 300, (n,), generator=g).to(device, torch.int32)
    ref = fo.rope_ref(qkv, cos, sin, pos, heads + kv_heads, head_dim)
    out = fo.rope_(qkv.clone(), cos, sin, pos, heads + kv_heads, head_dim)
    _close(out, ref, "rope")
    assert torch.equal(out[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:]), "v changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 128), (7, 1500), (16, 5632)])
def test_silu_mul(device, dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gu = (2 * torch.randn(rows, 2 * inter, generator=g)).to(device, dtype)
    _close(fo.silu_mul(gu), fo.silu_mul_ref(gu), "silu_mul")


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="gate_up must be"):
        fo.silu_mul(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"x must be \[N, 8\]"):
        fo.rms_norm(torch.zeros(2, 4), torch.ones(8), 1e-6)
