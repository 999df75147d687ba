"""kernels/wgmma_gemm.py: its configurations, its sm_90 code (compiled on the CPU: Gluon has no interpreter) and,
on a GPU, its bits against kernels/gemm.py and torch."""
import re

import pytest
import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels import pdl
from loopbench.kernels import wgmma_gemm as wg
from tests.kernels.test_gemm import graph_replay

SM90_SHARED_LIMIT = 227 * 1024          # the most shared memory one program may take on an H100 / H200
# the sm_90 compiles run after interpreted kernels in one pytest process (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("unpatched_triton_language")


@pytest.mark.parametrize("field,value,words", [
    ("block_n", 32, "block_n must be a power of two in 64..256, got 32"),
    ("block_k", 96, "block_k must be a power of two in 64..256, got 96"),
    ("split_k", 0, "split_k must be an int >= 1, got 0"),
    ("stages", 9, "stages must be an int in 1..8, got 9"),
    ("pre", 5, "pre must be an int in 0..stages (4), got 5"),
    ("num_warps", 2, "num_warps must be 4 or 8, got 2"),
    ("stages", True, "stages must be an int, got True"),
    ("num_warps", 4.0, "num_warps must be an int, got 4.0"),
    ("early_trigger", "no", "early_trigger must be a bool, got 'no'"),
])
def test_config_refuses_a_bad_value_by_name(field, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        wg.WgmmaConfig(**{field: value})


def test_parse_overrides_reads_fields_by_type_and_names_a_bad_part():
    assert wg.parse_overrides("") == {}
    assert wg.parse_overrides("stages=3,pre=2,early_trigger=true,pdl=0") == dict(stages=3, pre=2, early_trigger=True,
                                                                                  pdl=False)
    for text, words in (("bogus=1", "'bogus=1' is not FIELD=VALUE over block_n, "), ("stages", "'stages' is not"),
                        ("stages=x", "stages must be an integer, got 'x'"),
                        ("pdl=maybe", "pdl must be true or false, got 'maybe'"),
                        ("pre=5", "pre must be an int in 0..stages (4), got 5")):
        with pytest.raises(ValueError, match=re.escape(words)):
            wg.parse_overrides(text)


@pytest.mark.parametrize("m,want", [(1, 16), (16, 16), (17, 32), (33, 64), (64, 64)])
def test_block_m_is_the_mma_narrow_side(m, want):
    assert wg.block_m_for(m) == want


@pytest.mark.parametrize("m", [0, 65])
def test_rows_outside_the_mma_are_refused(m):
    with pytest.raises(ValueError, match=f"1..64 rows, got {m}"):
        wg.block_m_for(m)


def test_a_pipeline_larger_than_an_sm_allows_is_refused_by_name():
    wg.WgmmaConfig(stages=4).check_fits(64)
    with pytest.raises(ValueError, match=r"needs 344,176 bytes of shared memory a program at 64 rows with SwiGLU"):
        wg.WgmmaConfig(stages=7).check_fits(64, glu=True)
    for shape, c in wg.CONFIGS.items():
        c.check_fits(wg.MAX_M)
    for shape, c in wg.SWIGLU_CONFIGS.items():
        c.check_fits(wg.MAX_M, glu=True)


def test_configured_shapes_keep_gemm_splits():
    # The model feeds o_proj's and down's partials to add_rms_norm, which sums them in split order: the same
    # split as kernels/gemm.py keeps the partials, and with them every bit, as they were.
    for shape, c in wg.CONFIGS.items():
        assert c.split_k == gm.CONFIGS[shape].split_k, shape
        assert gm.config_for(*shape, 16) is not None, f"{shape} would not run on our GEMM at all"


def test_refusals_name_the_argument():
    x = torch.zeros((4, 64), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="WgmmaConfig"):
        wg.gemm(x, torch.zeros((64, 64), dtype=torch.bfloat16), gm.GemmConfig())
    with pytest.raises(TypeError, match="float32"):
        wg.gemm(x, torch.zeros((64, 64)), wg.WgmmaConfig())
    with pytest.raises(ValueError, match=r"share K, got \(4, 64\) and \(64, 32\)"):
        wg.gemm(x, torch.zeros((64, 32), dtype=torch.bfloat16), wg.WgmmaConfig())
    with pytest.raises(ValueError, match="one CUDA device"):
        wg.gemm(x, torch.zeros((64, 64), dtype=torch.bfloat16), wg.WgmmaConfig())
    with pytest.raises(ValueError, match=r"K must be >= 1, got x \(4, 0\)"):
        wg.gemm(torch.zeros((4, 0), dtype=torch.bfloat16), torch.zeros((64, 0), dtype=torch.bfloat16),
                wg.WgmmaConfig())


def _ptx_order(ptx: str) -> list[str]:
    """The kernel's TMA copies, PDL instructions and MMAs in program order, one word each."""
    out = []
    for line in ptx.splitlines():
        if "cp.async.bulk.tensor" in line:
            out.append("copy")
        elif "griddepcontrol.wait" in line:
            out.append("wait")
        elif "griddepcontrol.launch_dependents" in line:
            out.append("release")
        elif "wgmma.mma_async" in line:
            out.append("mma")
    return out


CASES = [(f"CONFIGS{shape}", c, False) for shape, c in wg.CONFIGS.items()] + [
    ("swiglu stages 3", wg.WgmmaConfig(stages=3, pre=3, early_trigger=True), True),
    ("late, pre 1", wg.WgmmaConfig(block_k=256, stages=2, pre=1), False),
]


@pytest.mark.parametrize("name,config,glu", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("block_m", [16, 64])
def test_sm90_code_copies_weight_tiles_before_the_wait(name, config, glu, block_m):
    """Compiled for sm_90 on the CPU: the program issues ``pre`` weight-tile copies (two a stage with SwiGLU)
    before griddepcontrol.wait, releases its dependents right after the wait (early) or after the last MMA
    (late), uses the warpgroup MMA, and fits an SM's shared memory as :meth:`WgmmaConfig.smem_bytes` says."""
    pytest.importorskip("triton.experimental.gluon")
    kernel = wg.compile_sm90(config, block_m, glu)
    order = _ptx_order(kernel.asm["ptx"])
    per_tile = 2 if glu else 1
    assert order.index("wait") == config.pre * per_tile, order[:12]
    assert order.count("wait") == 1 and order.count("release") == 1
    if config.early_trigger:
        assert order[order.index("wait") + 1] == "release"
    else:
        assert order.index("release") > max(i for i, w in enumerate(order) if w == "mma")
    assert "mma" in order
    assert config.smem_bytes(block_m, glu) <= kernel.metadata.shared <= SM90_SHARED_LIMIT


def test_no_pdl_means_no_griddepcontrol():
    pytest.importorskip("triton.experimental.gluon")
    order = _ptx_order(wg.compile_sm90(wg.WgmmaConfig(pdl=False), 16).asm["ptx"])
    assert "wait" not in order and "release" not in order and order.count("copy") >= 2


needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 GPU")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("shape", sorted(wg.CONFIGS))
@pytest.mark.parametrize("m", [1, 16, 32, 33, 64])
def test_configured_projection_is_bitwise_gemm(shape, m):
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = shape
    w = 0.02 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    ours = wg.gemm(x, w, wg.CONFIGS[shape])
    want = gm.gemm(x, w, gm.CONFIGS[shape])
    assert ours.shape == want.shape and ours.dtype == want.dtype
    diff = (ours.float() - want.float()).abs()
    assert torch.equal(ours, want), f"max {diff.max().item():.3g} mean {diff.mean().item():.3g}"
    ref = x.double() @ w.double().T
    got = ours.double().sum(0) if ours.dim() == 3 else ours.double()
    err = (got - ref).abs()
    assert err.max().item() < 2e-3 * ref.abs().max().item(), f"max {err.max().item():.3g}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("m", [1, 16, 32, 33, 64])
@pytest.mark.parametrize("config", [wg.WgmmaConfig(stages=3, pre=3, early_trigger=True),
                                    wg.WgmmaConfig(stages=2, pre=0, pdl=False)], ids=["early", "no-pdl"])
def test_swiglu_is_bitwise_gemm_swiglu(m, config):
    g = torch.Generator(device="cuda").manual_seed(100 + m)
    w = 0.02 * torch.randn((11264, 2048), generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn((m, 2048), generator=g, device="cuda", dtype=torch.bfloat16)
    ours = wg.gemm_swiglu(x, w, config)
    want = gm.gemm_swiglu(x, w, gm.SWIGLU_CONFIGS[(11264, 2048)])
    diff = (ours.float() - want.float()).abs()
    assert torch.equal(ours, want), f"max {diff.max().item():.3g} mean {diff.mean().item():.3g}"


UNEVEN = [  # (n, k, m, config, glu): N and K off the tiles, fewer K tiles than stages, a split with no K tile
    (200, 200, 5, wg.WgmmaConfig(block_k=64, stages=6, pre=6, early_trigger=True), False),
    (192, 320, 17, wg.WgmmaConfig(block_k=128, split_k=4, stages=2, pre=1), False),    # 3 tiles over 4 splits
    (96, 1000, 40, wg.WgmmaConfig(block_k=64, split_k=3, stages=4, pre=2), False),     # 16 tiles: 6, 6, 4
    (2 * 100, 136, 9, wg.WgmmaConfig(block_k=64, stages=3, pre=3), True),             # I = 100 off block_n
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("n,k,m,config,glu", UNEVEN)
def test_uneven_shapes_match_gemm_and_a_float64_reference(n, k, m, config, glu):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = 0.05 * torch.randn((n, k), generator=g, device="cuda", dtype=torch.bfloat16)
    x = torch.randn((m, k), generator=g, device="cuda", dtype=torch.bfloat16)
    # gemm.py at the same K tiles and splits (gate_up + SwiGLU as configured there: TMA)
    twin = gm.GemmConfig(block_n=64, block_k=config.block_k, split_k=config.split_k, pdl=True, tma=glu)
    if glu:
        ours, want = wg.gemm_swiglu(x, w, config), gm.gemm_swiglu(x, w, twin)
        prod = x.double() @ w.double().T
        ref = torch.nn.functional.silu(prod[:, : n // 2]) * prod[:, n // 2:]
        got = ours.double()
    else:
        ours, want = wg.gemm(x, w, config), gm.gemm(x, w, twin)
        assert ours.shape == ((config.split_k, m, n) if config.split_k > 1 else (m, n))
        ref = x.double() @ w.double().T
        got = ours.double().sum(0) if config.split_k > 1 else ours.double()
    diff = (ours.float() - want.float()).abs()
    assert torch.equal(ours, want), f"max {diff.max().item():.3g} mean {diff.mean().item():.3g}"
    err = (got - ref).abs()
    assert err.max().item() < 2e-2 * ref.abs().max().item() + 1e-3, f"max {err.max().item():.3g}"


@pytest.mark.gpu
@needs_sm90
def test_gpu_refusals_and_a_graph_replay():
    w = torch.randn((256, 128), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1..64 rows, got 65"):
        wg.gemm(torch.zeros((65, 128), device="cuda", dtype=torch.bfloat16), w, wg.WgmmaConfig())
    with pytest.raises(ValueError, match="gate rows then as many up rows, got 255"):
        wg.gemm_swiglu(torch.zeros((4, 128), device="cuda", dtype=torch.bfloat16), w[:255], wg.WgmmaConfig())
    with pytest.raises(ValueError, match="split_k must be 1, got 2"):
        wg.gemm_swiglu(torch.zeros((4, 128), device="cuda", dtype=torch.bfloat16), w, wg.WgmmaConfig(split_k=2))
    x = torch.randn((8, 128), device="cuda", dtype=torch.bfloat16)
    cfg = wg.WgmmaConfig(block_k=64, split_k=2, stages=2, pre=2, early_trigger=True)
    eager = wg.gemm(x, w, cfg)
    assert pdl.active(x)
    assert torch.equal(graph_replay(lambda: wg.gemm(x, w, cfg)), eager)
