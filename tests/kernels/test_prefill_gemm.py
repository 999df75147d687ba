"""Batch-invariant prefill GEMM (kernels/prefill_gemm.py) == its torch reference, and a row's bits independent of M.

Interpreter on CPU with fp32 inputs (its bf16 tl.dot is wrong, BRIEF section 4); on CUDA bf16 on the Ouro shapes.
Shapes cross tile boundaries: M, N and K off the tiles, M smaller than one tile and spanning several groups.
"""
import pytest
import torch

from loopbench.kernels import prefill_gemm as pg

SMALL = pg.PrefillGemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, stages=2, num_warps=4)
CPU_CASES = [  # (M, N, K)
    (1, 32, 16),
    (5, 40, 50),          # N, K off the tiles
    (37, 70, 33),         # several row tiles, a short last group, masks on every side
    (80, 96, 64),         # whole tiles, more row tiles than a group
]


def _inputs(m, n, k, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 11 * m + 5 * n + k)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (0.1 * torch.randn(n, k, generator=g)).to(device, dtype)
    return x, w


def _assert_close(got, ref, what):
    # fp32 accumulation in tile order against torch's: a few ulps of the result's dtype, scaled by
    # sum |x||w| where terms cancel (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2)
    ulp = 2 ** -22 if got.dtype == torch.float32 else 2 ** -7
    diff = (got.float() - ref.float()).abs()
    tol = 4 * ulp * ref.float().abs().clamp(min=1.0)
    assert bool((diff <= tol).all()), f"{what}: max diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


@pytest.mark.parametrize("m,n,k", CPU_CASES)
def test_prefill_gemm_matches_reference_cpu(m, n, k):
    x, w = _inputs(m, n, k, "cpu", torch.float32)
    got = pg.prefill_gemm(x, w, SMALL)
    assert got.shape == (m, n) and got.dtype == torch.float32
    _assert_close(got, pg.prefill_gemm_ref(x, w), f"M{m} N{n} K{k}")


def test_a_row_does_not_depend_on_the_other_rows_cpu():
    x, w = _inputs(53, 40, 48, "cpu", torch.float32)
    full = pg.prefill_gemm(x, w, SMALL)
    other = x.clone()
    other[::2] = torch.randn_like(other[::2])                 # every other row replaced
    for rows, xs in ((slice(0, 1), x[:1]), (slice(17, 40), x[17:40]), (slice(1, 53, 2), other[1::2])):
        part = pg.prefill_gemm(xs.contiguous(), w, SMALL)
        assert torch.equal(part, full[rows]), f"rows {rows} differ from the same rows in a call of 53"
    assert torch.equal(pg.prefill_gemm(other, w, SMALL)[1::2], full[1::2])


def test_out_and_empty_rows_cpu():
    x, w = _inputs(9, 20, 24, "cpu", torch.float32)
    out = torch.full((9, 20), float("nan"))
    assert pg.prefill_gemm(x, w, SMALL, out=out) is out
    _assert_close(out, pg.prefill_gemm_ref(x, w), "out=")
    assert pg.prefill_gemm(x[:0], w, SMALL).shape == (0, 20)


@pytest.mark.parametrize("bad,err,match", [
    (lambda x, w: (x.double(), w), TypeError, "one dtype"),
    (lambda x, w: (x, w[:, :-1]), ValueError, "share K"),
    (lambda x, w: (x.t(), w), ValueError, "share K|unit stride"),
    (lambda x, w: (x[:, ::2], w[:, ::2]), ValueError, "unit stride"),
])
def test_bad_inputs_are_named(bad, err, match):
    x, w = _inputs(4, 8, 8, "cpu", torch.float32)
    with pytest.raises(err, match=match):
        pg.prefill_gemm(*bad(x, w), SMALL)


@pytest.mark.parametrize("field,value", [("block_m", 48), ("block_k", 8), ("stages", 0), ("num_warps", True)])
def test_bad_configs_are_named(field, value):
    with pytest.raises(ValueError, match=f"PrefillGemmConfig.{field}"):
        pg.PrefillGemmConfig(**{field: value})


def test_out_of_another_shape_is_refused():
    x, w = _inputs(4, 8, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"out must be \[4, 8\]"):
        pg.prefill_gemm(x, w, SMALL, out=torch.empty(4, 9))


OURO = {"qkv": (6144, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OURO))
def test_prefill_gemm_ouro_shapes_bf16_and_batch_invariant(name):
    n, k = OURO[name]
    x, w = _inputs(2048 + 77, n, k, "cuda", torch.bfloat16)
    full = pg.prefill_gemm(x, w)
    _assert_close(full, pg.prefill_gemm_ref(x, w), name)
    for lo, hi in ((0, 1), (0, 128), (5, 261), (1900, 2125)):
        part = pg.prefill_gemm(x[lo:hi].contiguous(), w)
        assert torch.equal(part, full[lo:hi]), f"{name}: rows {lo}:{hi} alone differ from the same rows of M {len(x)}"


def test_fp32_inputs_multiply_in_ieee_fp32_not_tf32_cpu(monkeypatch):
    """tl.dot's default input precision for fp32 is TF32 on NVIDIA GPUs (10-bit mantissa products), which neither the
    fp32 reference nor the cuBLAS path it replaces uses; the interpreter computes in fp32 whatever it is asked, so the
    precision the kernel asks for is read from the interpreter's dot."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter
    asked = []
    dot = interpreter.InterpreterBuilder.create_dot

    def spy(self, a, b, d, precision, *rest):
        asked.append(precision)
        return dot(self, a, b, d, precision, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", spy)
    x, w = _inputs(5, 40, 50, "cpu", torch.float32)
    pg.prefill_gemm(x, w, SMALL)
    assert asked and set(asked) == {ir.INPUT_PRECISION.IEEE}, f"fp32 dot asked for {sorted(set(map(str, asked)))}"
