"""What decode attention and qkv_rope load before their PDL wait (kernels/pdl.py), checked in the interpreter.

Under PDL a kernel's programs run the part before ``griddepcontrol.wait`` while the kernel before it (the step's
KV write) still runs, so that part must load nothing that kernel writes: q and, for each row, its key at its
position. The interpreter has no PDL, so these tests record every address a program loads and note when it
passes ``pdl.wait``: every load before it is checked against those ranges, and a race is simulated by holding
q and each row's key at its position at NaN until a program's wait (the result must still be the reference's).
The recorder hooks the interpreter's masked load and grid index (Triton 3.9's ``InterpreterBuilder``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from triton.runtime import interpreter

from loopbench.kernels import gemm as gm
from loopbench.kernels import pdl
from loopbench.kernels.decode_attention import decode_attention, decode_attention_ref
from loopbench.kernels.qkv_rope import qkv_rope_write_kv

from .test_decode_attention import PAGE, VARIANTS, assert_close, make_case
from .test_qkv_rope import _case as qkv_case

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="records the Triton interpreter's loads (CPU)")


class Recorder:
    """Every masked load's addresses, with whether the program had passed ``pdl.wait``; ``on_start`` /
    ``on_wait`` run when a program starts and when it waits."""

    def __init__(self):
        self.loads: list[tuple[bool, np.ndarray]] = []
        self.waited = False
        self.on_start = self.on_wait = None

    def before_wait(self) -> np.ndarray:
        parts = [a for waited, a in self.loads if not waited]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


@pytest.fixture
def recorder(monkeypatch):
    builder = interpreter.InterpreterBuilder
    if not (hasattr(builder, "create_masked_load") and hasattr(builder, "set_grid_idx")):
        pytest.skip("this Triton's interpreter has no create_masked_load / set_grid_idx to record")
    rec, load, set_grid_idx = Recorder(), builder.create_masked_load, builder.set_grid_idx

    def recording_set_grid_idx(self, *idx):
        rec.waited = False
        if rec.on_start:
            rec.on_start()
        return set_grid_idx(self, *idx)

    def recording_load(self, ptrs, mask, *args):
        live = np.broadcast_to(np.asarray(mask.data).astype(bool), ptrs.data.shape)
        rec.loads.append((rec.waited, np.asarray(ptrs.data)[live].astype(np.uint64)))
        return load(self, ptrs, mask, *args)

    def recording_wait(PDL):
        if not rec.waited and rec.on_wait:
            rec.on_wait()
        rec.waited = True

    monkeypatch.setattr(builder, "create_masked_load", recording_load)
    monkeypatch.setattr(builder, "set_grid_idx", recording_set_grid_idx)
    monkeypatch.setattr(pdl, "wait", recording_wait)
    return rec


def written_by_the_kv_write(q, k, v, meta) -> list[tuple[int, int]]:
    """Byte ranges the step's KV write writes: all of q, and per row its key at its position (k and v rows)."""
    ranges = [(q.data_ptr(), q.data_ptr() + q.numel() * q.element_size())]
    bt = meta["block_tables"]
    for s, d, p in zip(meta["row_slot"].tolist(), meta["row_depth"].tolist(), meta["row_pos"].tolist()):
        if 0 <= s < bt.shape[0] and 1 <= d <= bt.shape[1] and 0 <= p < bt.shape[2] * PAGE:
            block = int(bt[s, d - 1, p // PAGE])
            for t in (k, v):
                start = t.data_ptr() + (block * t.stride(0) + (p % PAGE) * t.stride(1)) * t.element_size()
                ranges.append((start, start + t.stride(1) * t.element_size()))
    return ranges


def assert_none_before_the_wait(rec: Recorder, ranges, what: str) -> None:
    early = rec.before_wait()
    assert len(early), f"{what}: nothing loaded before the wait (the recorder saw no early load)"
    for lo, hi in ranges:
        hits = int(((early >= lo) & (early < hi)).sum())
        assert not hits, f"{what}: {hits} loads before the wait hit bytes the KV write writes"


CASES = [
    ([1, 17, 32, 33, 264], {}),                                     # first tiles holding pos; a one-tile split
    ([1, 17, 32, 33, 264], dict(min_split_tokens=128)),
    ([1, 33, 63, 64, 65], dict(min_split_tokens=32)),                # empty splits past short rows
    ([1, 33, 63, 64, 65], dict(min_split_tokens=16, max_splits=2, block_n=16)),
    ([97, 130, 161], dict(exit_ahead=False, min_split_tokens=64)),
    ([40, 130, 200], dict(tile_size=48)),
]


@pytest.mark.parametrize("contexts,kw", CASES)
def test_attention_loads_nothing_the_kv_write_writes_before_its_wait(recorder, contexts, kw):
    case = make_case(21, "cpu", torch.float32, contexts, "boundary")
    for layout, prefix in VARIANTS:
        k, v = case[layout]
        recorder.loads.clear()
        decode_attention(case["q"], k, v, **case["meta"], layout=layout, prefix_tiles=prefix, **kw)
        assert_none_before_the_wait(recorder, written_by_the_kv_write(case["q"], k, v, case["meta"]),
                                    f"{layout}, prefix {prefix}, {kw}")


@pytest.mark.parametrize("contexts,kw", CASES)
def test_attention_sees_the_kv_write_even_if_it_lands_at_the_wait(recorder, contexts, kw):
    # A race simulated: q and every row's key at its position hold NaN until each program's wait, the right values
    # after it (poisoned again when the next program starts). No NaN may reach the output.
    case = make_case(22, "cpu", torch.float32, contexts, "boundary")
    meta, q = case["meta"], case["q"]
    bt = meta["block_tables"]
    cells = [(int(bt[s, d - 1, p // PAGE]), p % PAGE) for s, d, p in
             zip(meta["row_slot"].tolist(), meta["row_depth"].tolist(), meta["row_pos"].tolist()) if s >= 0]
    q_good = q.clone()
    for layout, prefix in VARIANTS:
        k, v = case[layout]
        k_good, v_good = k.clone(), v.clone()
        want = decode_attention_ref(q_good, k_good, v_good, **meta, layout=layout, prefix_tiles=prefix,
                                    **{name: value for name, value in kw.items() if name == "tile_size"})

        def poison():
            for block, offset in cells:
                k[block, offset] = v[block, offset] = float("nan")
            q.fill_(float("nan"))

        def land():
            for block, offset in cells:
                k[block, offset], v[block, offset] = k_good[block, offset], v_good[block, offset]
            q.copy_(q_good)

        recorder.on_start, recorder.on_wait = poison, land
        try:
            out = decode_attention(q, k, v, **meta, layout=layout, prefix_tiles=prefix, **kw)
        finally:
            recorder.on_start = recorder.on_wait = None
            land()
        n = case["num_real_rows"]
        assert torch.isfinite(out[:n]).all(), f"{layout}, prefix {prefix}, {kw}: a value loaded before the wait"
        assert_close(out[:n], want[:n], f"{layout}, prefix {prefix}, {kw}")


@pytest.mark.parametrize("kw", [dict(), dict(min_split_tokens=32), dict(pipe_stages=2), dict(early_kv=False),
                                dict(exit_ahead=False, min_split_tokens=32)])
def test_attention_at_odd_positions(recorder, kw):
    # Rows at and past the cache's end, at -1 and 0 and on tile edges (one position per slot, as the engine runs
    # one row per request), against the reference; the caches hold no NaN, so the reference is finite everywhere.
    case = make_case(23, "cpu", torch.float32, [70] * 12, "mixed", padding_rows=2,
                     depths=lambda s: (1, 4) if s % 2 else (2, 3))
    meta = dict(case["meta"])
    max_ctx = min(meta["block_tables"].shape[2] * PAGE, meta["exit_map"].shape[1])
    odd = [max_ctx - 1, max_ctx, max_ctx + 5, 2**31 - 2, -1, 0, 31, 32, 63, 64, 15, 16, 1, 33, 69, 47]
    meta["row_pos"] = torch.tensor([odd[s % len(odd)] if s >= 0 else 10**6 for s in meta["row_slot"].tolist()],
                                   dtype=torch.int32)
    meta["row_first_alias"] = torch.clamp(meta["row_pos"] + 1, max=10**6).int()
    gen = torch.Generator().manual_seed(5)
    for layout, prefix in VARIANTS:
        if kw.get("pipe_stages") and layout == "alias":
            continue                        # pipe_stages is a native knob
        k, v = case[layout]
        for t in (k, v):
            unset = torch.isnan(t)
            t[unset] = torch.randn(int(unset.sum()), generator=gen)
        recorder.loads.clear()
        out = decode_attention(case["q"], k, v, **meta, layout=layout, prefix_tiles=prefix, **kw)
        if kw.get("early_kv", True):
            assert_none_before_the_wait(recorder, written_by_the_kv_write(case["q"], k, v, meta),
                                        f"{layout}, prefix {prefix}, {kw}")
        want = decode_attention_ref(case["q"], k, v, **meta, layout=layout, prefix_tiles=prefix)
        assert_close(out, want, f"{layout}, prefix {prefix}, {kw}")


@pytest.mark.parametrize("early", [True, False])
def test_qkv_rope_loads_no_activation_or_cache_before_its_wait(recorder, early):
    # GemmConfig.early_epilogue loads descriptors, rotary rows and block tables before the wait: never x (the
    # previous kernel's output) nor the caches; without it nothing at all is loaded before the wait.
    x, w, cos, sin, (k_cache, v_cache), meta = qkv_case("cpu", 2, 1, 64, 80)
    qkv_rope_write_kv(x, w, gm.GemmConfig(block_n=32, block_k=32, early_epilogue=early), cos, sin, k_cache, v_cache,
                      *meta, 2)
    early_loads = recorder.before_wait()
    for t in (x, k_cache, v_cache):
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert not ((early_loads >= lo) & (early_loads < hi)).any(), "a load before the wait read x or a cache"
    assert (len(early_loads) > 0) == early
