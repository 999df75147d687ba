"""Programmatic dependent launch (kernels/pdl.py) and the GEMMs' L2 weight prefetch change no bit.

On CUDA one Ouro-shaped layer's chain of our kernels (norm, qkv projection, paged decode attention with its
split merge, o_proj partials into the residual norm, gate_up + SwiGLU, down, the fused qkv + RoPE + KV
write and attention over the key it wrote, lm_head) runs with PDL off, with PDL on, with PDL and the prefetch, and as a CUDA graph captured with
both; every output and the written KV cache must be bitwise the same. PDL and the prefetch only move when a
kernel starts and what sits in L2, so any difference is a race. On the CPU: the switch, the launch options,
the prefetch arithmetic, and the probe's options.
"""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from loopbench.kernels import gemm as gm
from loopbench.kernels import pdl

from .test_decode_attention import make_case


def test_pdl_is_never_active_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.active(torch.zeros(1))
    assert pdl.launch_options(False, num_warps=4) == {"num_warps": 4}
    assert pdl.launch_options(True, num_warps=4) == {"num_warps": 4, "launch_pdl": True}


def test_mode_follows_the_trigger(monkeypatch):
    assert pdl.mode(False) == 0
    monkeypatch.setattr(pdl, "TRIGGER", "late")
    assert pdl.mode(True) == pdl.LATE
    assert pdl.mode(True, early=True) == pdl.EARLY and pdl.mode(False, early=True) == 0   # one kernel's own choice
    monkeypatch.setattr(pdl, "TRIGGER", "early")
    assert pdl.mode(True) == pdl.EARLY != pdl.LATE
    monkeypatch.setattr(pdl, "TRIGGER", "soon")
    with pytest.raises(ValueError, match="soon"):
        pdl.mode(True)


@pytest.mark.parametrize("cfg,k,use_pdl,elem_bytes,want", [
    (gm.GemmConfig(block_k=256, prefetch_tiles=2), 2048, True, 2, 512),           # qkv: two tiles
    (gm.GemmConfig(block_k=128, split_k=4, prefetch_tiles=8), 2048, True, 2, 512),  # at most one split's range
    (gm.GemmConfig(block_k=128, split_k=4, prefetch_tiles=20), 5632, True, 2, 1024),  # 1408 -> a power of two
    (gm.GemmConfig(block_k=128, prefetch_tiles=2), 2048, False, 2, 0),           # nothing to overlap
    (gm.GemmConfig(block_k=128, prefetch_tiles=2), 2048, True, 4, 0),            # lines of 2-byte elements only
    (gm.GemmConfig(block_k=32, prefetch_tiles=1), 2048, True, 2, 0),             # less than one line
    (gm.GemmConfig(block_k=128), 2048, True, 2, 0),                              # not configured
    (gm.GemmConfig(block_k=128, split_k=5, prefetch_tiles=1), 2048, True, 2, 128),  # an empty last split
])
def test_prefetch_elements(cfg, k, use_pdl, elem_bytes, want):
    assert gm.prefetch_elements(cfg, k, use_pdl, elem_bytes) == want


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_prefetch_tiles_must_be_a_count(bad):
    with pytest.raises(ValueError, match="prefetch_tiles"):
        gm.GemmConfig(prefetch_tiles=bad)


def test_probe_options_set_the_switch_and_the_tables(monkeypatch):
    from loopbench.harness import throughput
    from loopbench.kernels import qkv_rope
    tables = (gm.CONFIGS, gm.SWIGLU_CONFIGS, qkv_rope.CONFIGS)
    saved = [dict(t) for t in tables]
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "TRIGGER", "late")
    restore = throughput.apply_kernel_options(argparse.Namespace(pdl="off", prefetch_tiles=3))
    try:
        assert pdl.ENABLED is False
        for table in tables:
            assert table and all(c.prefetch_tiles == 3 for c in table.values())
    finally:
        restore()
    assert pdl.ENABLED is True and [dict(t) for t in tables] == saved
    restore = throughput.apply_kernel_options(argparse.Namespace(pdl="early", prefetch_tiles=None))
    try:
        assert pdl.ENABLED is True and pdl.TRIGGER == "early"
    finally:
        restore()
    assert pdl.TRIGGER == "late"
    with pytest.raises(SystemExit):
        throughput.parse_args(["--prefetch-tiles", "-1"])


def _layer_case(seed=0):
    """Ouro-1.4B shapes on CUDA: weights, a paged alias cache long enough for two attention splits, 18 rows."""
    from loopbench.runtime.model import OuroConfig, rope_tables
    g = torch.Generator().manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    w = lambda *s: (0.02 * torch.randn(*s, generator=g)).to(dev, dt)        # noqa: E731
    ln = lambda: (1 + 0.1 * torch.randn(2048, generator=g)).to(dev, dt)     # noqa: E731
    case = make_case(seed, dev, dt, [100 + 37 * i for i in range(8)], "boundary", heads=16, kv_heads=16,
                     head_dim=128)
    n = case["q"].shape[0]
    weights = dict(qkv=w(6144, 2048), o=w(2048, 2048), gate_up=w(11264, 2048), down=w(2048, 5632),
                   lm_head=w(49152, 2048), ln=[ln() for _ in range(5)], rope=rope_tables(OuroConfig(), 512, dev))
    x = torch.randn(n, 2048, generator=g).to(dev, dt)
    return x, weights, case


def _layer(x, wt, case, kv_out, configs, attention_kw=None):
    """The decode loop's kernel chain on one layer (kernels as the fused model calls them)."""
    from loopbench.kernels import fused_ops as fo
    from loopbench.kernels.decode_attention import decode_attention
    from loopbench.kernels.qkv_rope import qkv_rope_write_kv
    n, eps = x.shape[0], 1e-6
    # the next position of each row (a cell no earlier kernel of the chain reads); padding rows at 0, since every
    # row's position indexes the rotary tables. Made first: qkv_rope and attention read positions before their
    # PDL wait, so the kernel that makes them must not be right before either (kernels/pdl.py)
    meta = case["meta"]
    pos = torch.where(meta["row_slot"] >= 0, meta["row_pos"] + 1, 0)
    h = fo.rms_norm(x, wt["ln"][0], eps)
    qkv = gm.gemm(h, wt["qkv"], configs["qkv"])
    a = decode_attention(qkv[:, :2048].reshape(n, 16, 128), *case["alias"], **case["meta"], layout="alias",
                         prefix_tiles=True)
    x1, h1 = fo.add_rms_norm(x, gm.gemm(a.reshape(n, 2048), wt["o"], configs["o"]), wt["ln"][1], wt["ln"][2], eps)
    act = gm.gemm_swiglu(h1, wt["gate_up"], configs["glu"])
    x2, h2 = fo.add_rms_norm(x1, gm.gemm(act, wt["down"], configs["down"]), wt["ln"][3], wt["ln"][4], eps)
    cos, sin = wt["rope"]
    qkv2 = qkv_rope_write_kv(h2, wt["qkv"], configs["qkv_rope"], cos, sin, *kv_out, meta["block_tables"],
                             meta["row_slot"], meta["row_depth"], pos, 16)
    # attention at that position right after the kernel that wrote its key, as in the decode loop: under PDL its
    # programs load the earlier keys before they wait and the key at pos after (the row of context 286 has a
    # second split of one tile, which holds that key)
    a2 = decode_attention(qkv2[:, :2048].reshape(n, 16, 128), *kv_out, **{**meta, "row_pos": pos}, layout="alias",
                          prefix_tiles=True, **(attention_kw or {}))
    return [h, qkv, a, x1, h1, act, x2, h2, qkv2, a2, gm.gemm(h2, wt["lm_head"], configs["lm_head"])]


def _configs(prefetch_tiles, early_trigger=False):
    from loopbench.kernels import qkv_rope
    c = {"qkv": gm.CONFIGS[(6144, 2048)], "o": gm.CONFIGS[(2048, 2048)], "down": gm.CONFIGS[(2048, 5632)],
         "lm_head": gm.CONFIGS[(49152, 2048)], "glu": gm.SWIGLU_CONFIGS[(11264, 2048)],
         "qkv_rope": qkv_rope.CONFIGS[(6144, 2048)]}
    return {k: dataclasses.replace(v, prefetch_tiles=prefetch_tiles, early_trigger=early_trigger and k == "qkv_rope")
            for k, v in c.items()}


@pytest.mark.gpu
def test_pdl_and_prefetch_change_no_bit_eager_and_in_a_graph(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90")
    x, wt, case = _layer_case()
    kv0 = [t.clone() for t in case["alias"]]
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.active(x), "PDL must be on for this test to compare anything"

    def run(enabled, prefetch, trigger="late", early_trigger=False, attention_kw=None):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        monkeypatch.setattr(pdl, "TRIGGER", trigger)
        kv = [t.clone() for t in kv0]
        return _layer(x, wt, case, kv, _configs(prefetch, early_trigger), attention_kw) + kv

    want = run(False, 0)
    torch.cuda.synchronize()
    variants = {"pdl": run(True, 0), "pdl+prefetch": run(True, 2), "pdl early": run(True, 0, "early"),
                "pdl early+prefetch": run(True, 4, "early"),
                "pdl late, qkv_rope early": run(True, 0, "late", early_trigger=True),
                "qkv_rope early, attention prefetching its K/V": run(True, 0, "late", early_trigger=True,
                                                                     attention_kw=dict(prefetch_kv=8))}
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "TRIGGER", "early")     # the graph: the schedule with the most overlap
    kv = [t.clone() for t in kv0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _layer(x, wt, case, kv, _configs(2))                    # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer(x, wt, case, kv, _configs(2))
    for replay in range(3):
        for t, t0 in zip(kv, kv0):
            t.copy_(t0)
        graph.replay()
        torch.cuda.synchronize()
        variants[f"graph replay {replay}"] = [o.clone() for o in outs] + [t.clone() for t in kv]
    names = ["h", "qkv", "attention", "x1", "h1", "act", "x2", "h2", "qkv_rope", "attention after the KV write",
             "lm_head", "k cache", "v cache"]
    for label, got in variants.items():
        for name, a, b in zip(names, got, want):
            a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)   # bits: the caches hold NaN
            assert torch.equal(a, b), f"{label}: {name} differs from PDL off in {int((a != b).sum())} bytes"
