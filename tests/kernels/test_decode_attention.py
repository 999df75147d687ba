"""Decode attention: Triton kernel == torch reference, and native == alias == alias+prefix bitwise.

Every case builds one request per slot with a chosen context length, an exit map, and an ``alias`` cache
in which planes a token never computed hold NaN (so a wrong plane shows up as NaN). The ``native`` cache is
that cache with the skipped planes actually filled (``native_fill``), so both hold identical logical KV.
Rows are every (slot, depth) pair plus padding rows; block tables are shuffled across the whole pool.
On CPU the kernels run in the Triton interpreter (fp32, small heads); on CUDA the same cases run in bf16.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from loopbench.kernels import decode_attention as da
from loopbench.kernels.decode_attention import (REGISTER_CAP, UNCAPPED_PROGRAMS_PER_SM, decode_attention,
                                                decode_attention_ref, key_planes_ref, launch_config)
from loopbench.kernels.kv_write import native_fill, native_fill_ref

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="CPU tensors need the Triton interpreter")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
CONTEXTS = [1, 15, 16, 17, 31, 32, 33, 34, 63, 64, 65]
# First-alias positions on both sides of block (16) and tile (32) boundaries.
BOUNDARIES = [0, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64]
NUM_PLANES = 4
PAGE = 16


def sweep_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = 2e-2 if actual.dtype in (torch.bfloat16, torch.float16) else 2e-5
    a, e = actual.float(), expected.float()
    diff = (a - e).abs()
    ok = torch.isfinite(a).all() and bool((diff <= tol + tol * e.abs()).all())
    assert ok, f"{what}: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}"


def alternate_depths(slot: int) -> tuple[int, ...]:
    """Two query depths per slot, alternating, so every depth is covered at half the interpreter time."""
    return (2, 4) if slot % 2 == 0 else (1, 3)


def make_case(seed: int, device: str, dtype: torch.dtype, contexts: list[int], exits: str,
              heads: int = 1, kv_heads: int = 1, head_dim: int = 16, padding_rows: int = 2,
              fill_with_kernel: bool = False, depths=alternate_depths, boundaries=BOUNDARIES) -> dict:
    """One request per slot (context ``contexts[s]``), rows at ``depths(slot)``, two cache layouts.

    ``exits``: ``none`` (every token ran all loops), ``all`` (every earlier token exited after loop 1),
    ``mixed`` (random exit depths) or ``boundary`` (no exits before a first-alias position taken from
    ``boundaries``, which exits after loop 1; random exits after it).
    """
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(contexts)
    max_blocks = -(-max(contexts) // PAGE) + 1
    max_len = max_blocks * PAGE
    num_blocks = num_slots * NUM_PLANES * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=gen)[: num_slots * NUM_PLANES * max_blocks]
    block_tables = block_tables.view(num_slots, NUM_PLANES, max_blocks).int()

    exit_map = torch.zeros((num_slots, max_len), dtype=torch.int32)     # beyond the context: never read
    for s, ctx in enumerate(contexts):
        pos = ctx - 1
        if exits == "none":
            e = torch.full((pos,), NUM_PLANES)
        elif exits == "all":
            e = torch.ones(pos)
        elif exits == "mixed":
            e = torch.randint(1, NUM_PLANES + 1, (pos,), generator=gen)
        elif exits == "boundary":
            first = min(boundaries[(s + seed) % len(boundaries)], pos)
            e = torch.full((pos,), NUM_PLANES)
            e[first:] = torch.randint(1, NUM_PLANES + 1, (pos - first,), generator=gen)
            if first < pos:
                e[first] = 1
        else:
            raise ValueError(exits)
        exit_map[s, :pos] = e.int()
        exit_map[s, pos] = NUM_PLANES                                     # the token being computed

    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_alias = torch.full(shape, float("nan"))
    v_alias = torch.full(shape, float("nan"))
    for s, ctx in enumerate(contexts):
        for plane in range(1, NUM_PLANES + 1):
            p = torch.nonzero(exit_map[s, :ctx] >= plane).flatten()       # tokens that computed this plane
            blocks = block_tables[s, plane - 1, p // PAGE].long()
            k_alias[blocks, p % PAGE] = torch.randn((len(p), kv_heads, head_dim), generator=gen)
            v_alias[blocks, p % PAGE] = torch.randn((len(p), kv_heads, head_dim), generator=gen)
    k_alias, v_alias = k_alias.to(dtype), v_alias.to(dtype)

    fill = [(s, p, int(exit_map[s, p])) for s, ctx in enumerate(contexts) for p in range(ctx)
            if exit_map[s, p] < NUM_PLANES]
    fill_args = [torch.tensor([f[i] for f in fill], dtype=torch.int32) for i in range(3)]
    fill_args.append(torch.full((len(fill),), NUM_PLANES, dtype=torch.int32))
    k_native, v_native = k_alias.clone()[None], v_alias.clone()[None]
    if fill_with_kernel:
        k_native, v_native = k_native.to(device), v_native.to(device)
        native_fill(k_native, v_native, block_tables.to(device), *[t.to(device) for t in fill_args])
    else:
        native_fill_ref(k_native, v_native, block_tables, *fill_args)

    rows = [(s, d, ctx - 1) for s, ctx in enumerate(contexts) for d in depths(s)]
    rows += [(-1, 0, 10**6)] * padding_rows
    row_slot, row_depth, row_pos = (torch.tensor([r[i] for r in rows], dtype=torch.int32) for i in range(3))
    first_alias = []
    for s, d, pos in rows:
        aliased = torch.nonzero(exit_map[s, : pos + 1] < d).flatten() if s >= 0 else torch.empty(0)
        first_alias.append(int(aliased[0]) if len(aliased) else pos + 1)
    q = torch.randn((len(rows), heads, head_dim), generator=gen).to(dtype)
    meta = dict(block_tables=block_tables, row_slot=row_slot, row_depth=row_depth, row_pos=row_pos,
                exit_map=exit_map, row_first_alias=torch.tensor(first_alias, dtype=torch.int32))
    to = lambda t: t.to(device)  # noqa: E731
    return dict(q=to(q), native=(to(k_native[0]), to(v_native[0])), alias=(to(k_alias), to(v_alias)),
                meta={k: to(v) for k, v in meta.items()}, num_real_rows=len(rows) - padding_rows)


VARIANTS = [("native", False), ("alias", False), ("alias", True)]


def run_variants(case: dict, fn=decode_attention, **kw) -> dict:
    outs = {}
    for layout, prefix in VARIANTS:
        k, v = case[layout]
        outs[(layout, prefix)] = fn(case["q"], k, v, **case["meta"], layout=layout, prefix_tiles=prefix, **kw)
    return outs


def check_case(case: dict, **kw) -> None:
    outs = run_variants(case, **kw)
    refs = run_variants(case, fn=decode_attention_ref, **{k: v for k, v in kw.items() if k == "tile_size"})
    n = case["num_real_rows"]
    for key, out in outs.items():
        assert torch.isfinite(out.float()).all(), f"{key}: non-finite output (padding rows included)"
        assert_close(out[:n], refs[key][:n], f"{key} vs reference")
    native = outs[("native", False)]
    for key in VARIANTS[1:]:
        assert torch.equal(native, outs[key]), (
            f"{key} differs from native: max abs diff {(native.float() - outs[key].float()).abs().max():.3e}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exits", ["none", "all", "mixed", "boundary"])
def test_layouts_match_reference_and_each_other(device, exits):
    case = make_case(1, device, sweep_dtype(device), CONTEXTS, exits)
    check_case(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exits", ["mixed", "boundary"])
def test_split_key_range(device, exits):
    # Splits of 32 keys: every context above 32 goes through the split-merge path.
    case = make_case(2, device, sweep_dtype(device), [1, 33, 63, 64, 65], exits)
    check_case(case, min_split_tokens=32)
    if exits == "mixed":
        # max_splits=2 forces splits longer than the minimum (tiles_per_split from the context length).
        check_case(case, min_split_tokens=16, max_splits=2, block_n=16)


# Long direct prefixes: first-alias positions that leave 3..8 whole 32-key tiles before them, so the
# direct loop runs, hands over to the routed loop mid-split, or covers whole splits.
LONG_CONTEXTS = [97, 130, 161, 200, 256]
LATE_BOUNDARIES = [96, 100, 127, 128, 129, 160, 199, 255]


@pytest.mark.slow      # about 12 s a case on 2 cores (the interpreter)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exit_ahead", [True, False])
def test_long_direct_prefix(device, exit_ahead):
    case = make_case(10, device, sweep_dtype(device), LONG_CONTEXTS, "boundary", boundaries=LATE_BOUNDARIES,
                     depths=lambda s: (2, 4) if s % 2 == 0 else (1, 3, 4))
    check_case(case, exit_ahead=exit_ahead)                             # one split per row
    check_case(case, exit_ahead=exit_ahead, min_split_tokens=64)         # splits of two tiles


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tile_size", [16, 48, 64])
def test_prefix_granularity(device, tile_size):
    # tile_size not a multiple of block_n (16, 48): the routed loop masks keys before the direct end.
    case = make_case(11, device, sweep_dtype(device), [40, 130, 200], "boundary",
                     boundaries=[17, 33, 47, 100, 130, 150], depths=lambda s: (2, 3, 4))
    check_case(case, tile_size=tile_size)
    check_case(case, tile_size=tile_size, exit_ahead=False, min_split_tokens=64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (4, 1, 16), (2, 2, 24)])
def test_grouped_query_and_padded_shapes(device, heads, kv_heads, head_dim):
    case = make_case(3, device, sweep_dtype(device), [1, 65], "mixed", heads=heads,
                     kv_heads=kv_heads, head_dim=head_dim)
    check_case(case)


@pytest.mark.parametrize("device", DEVICES)
def test_ouro_shape_bf16(device):
    # Ouro-1.4B attention: 16 heads (MHA), head_dim 128, bf16.
    contexts = [40] if device == "cpu" else CONTEXTS       # cpu: first alias at 33, one past a tile
    case = make_case(6, device, torch.bfloat16, contexts, "boundary", heads=16, kv_heads=16, head_dim=128,
                     padding_rows=1, depths=lambda s: (2, 4) if device == "cpu" else (1, 2, 3, 4))
    check_case(case)


@pytest.mark.parametrize("device", DEVICES)
def test_native_cache_filled_by_kernel(device):
    case = make_case(5, device, sweep_dtype(device), [17, 34, 64], "mixed", fill_with_kernel=True)
    check_case(case)


@pytest.mark.parametrize("device", DEVICES)
def test_row_result_does_not_depend_on_batch(device):
    case = make_case(6, device, sweep_dtype(device), [16, 33, 65], "mixed", padding_rows=0)
    k, v = case["alias"]
    full = decode_attention(case["q"], k, v, **case["meta"], layout="alias", prefix_tiles=True)
    pick = torch.tensor([5, 2, 3], device=device)
    meta = {name: (t[pick] if name.startswith("row_") else t) for name, t in case["meta"].items()}
    part = decode_attention(case["q"][pick], k, v, **meta, layout="alias", prefix_tiles=True)
    assert torch.equal(part, full[pick])


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_read_nothing(device):
    case = make_case(7, device, sweep_dtype(device), [5], "none", padding_rows=0)
    meta = dict(case["meta"])
    n = 4
    meta["row_slot"] = torch.tensor([-1, -7, 1, 99], dtype=torch.int32, device=device)   # 1 and 99: no such slot
    meta["row_depth"] = torch.tensor([0, 9, -3, 2], dtype=torch.int32, device=device)
    meta["row_pos"] = torch.tensor([10**9, -5, 3, 2**31 - 2], dtype=torch.int32, device=device)
    meta["row_first_alias"] = torch.tensor([-1, 10**9, 0, 5], dtype=torch.int32, device=device)
    q = case["q"][:1].expand(n, -1, -1).contiguous()
    for layout, prefix in VARIANTS:
        k, v = case[layout]
        out = decode_attention(q, k, v, **meta, layout=layout, prefix_tiles=prefix)
        assert torch.equal(out, torch.zeros_like(out)), f"{layout}/{prefix}: padding rows must give zeros"


def test_rejects_bad_arguments():
    case = make_case(8, "cpu", torch.float32, [3], "none", padding_rows=0)
    k, v = case["native"]
    with pytest.raises(ValueError, match="layout"):
        decode_attention(case["q"], k, v, **case["meta"], layout="paged")
    meta = dict(case["meta"], block_tables=case["meta"]["block_tables"].long())
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(case["q"], k, v, **meta)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(case["q"].double(), k, v, **case["meta"])
    with pytest.raises(ValueError, match="row_pos"):
        decode_attention(case["q"], k, v, **dict(case["meta"], row_pos=case["meta"]["row_pos"][:0]))
    with pytest.raises(ValueError, match="tile_size"):
        decode_attention(case["q"], k, v, **case["meta"], tile_size=0)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="pipe_stages"):
            decode_attention(case["q"], k, v, **case["meta"], pipe_stages=bad)
    for bad in (-1, True, 128.0):
        with pytest.raises(ValueError, match="maxnreg"):
            decode_attention(case["q"], k, v, **case["meta"], maxnreg=bad)
    for knob, bad in (("num_warps", 3), ("num_stages", 0), ("exit_ahead", 1), ("early_kv", 0), ("early_trigger", 0),
                      ("block_n", 16.0), ("max_splits", 0),
                      ("prefetch_kv", -1), ("prefetch_kv", 33)):
        with pytest.raises(ValueError, match=knob):
            decode_attention(case["q"], k, v, **case["meta"], **{knob: bad})
    with pytest.raises(ValueError, match="prefetch_kv needs early_kv"):
        decode_attention(case["q"], k, v, **case["meta"], prefetch_kv=4, early_kv=False)
    many = make_case(8, "cpu", torch.float32, [3, 3], "none", padding_rows=0)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(many["q"], *many["native"],
                         **dict(many["meta"], row_depth=torch.ones(8, dtype=torch.int32)[::2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("contexts,boundaries,tile_size,kw", [
    ([40, 65, 66], BOUNDARIES, 32, {}),
    ([130, 200, 161], LATE_BOUNDARIES, 32, {}),                          # the direct loop runs
    ([130, 200, 161], LATE_BOUNDARIES, 32, dict(exit_ahead=False, min_split_tokens=64)),
    # direct end inside a compute tile (144 with tile_size 48, 112 with 16)
    ([130, 200, 161], [150, 160, 199], 48, {}),
    ([130, 200, 161], [150, 160, 199], 48, dict(exit_ahead=False)),
    ([130, 200, 161], LATE_BOUNDARIES, 16, dict(exit_ahead=False)),
])
def test_prefix_tiles_skip_the_exit_map(device, contexts, boundaries, tile_size, kw):
    # Keys in tiles that end at or before the first-alias position must be read from plane d without
    # consulting the exit map: overwrite those entries with depth 1 and the output must not move.
    case = make_case(9, device, sweep_dtype(device), contexts, "boundary", padding_rows=0,
                     depths=lambda s: (2, 3, 4), boundaries=boundaries)
    k, v = case["alias"]
    meta = case["meta"]
    kw = dict(kw, tile_size=tile_size)
    before = decode_attention(case["q"], k, v, **meta, layout="alias", prefix_tiles=True, **kw)
    tampered = meta["exit_map"].clone()
    direct_end = {}                                  # per slot: the direct prefix shared by all its rows
    for slot, first_alias in zip(meta["row_slot"].tolist(), meta["row_first_alias"].tolist()):
        direct_end[slot] = min(direct_end.get(slot, first_alias), first_alias) // tile_size * tile_size
    for slot, end in direct_end.items():
        tampered[slot, :end] = 1
    assert not torch.equal(tampered, meta["exit_map"]), "case has no direct tiles"
    meta = dict(meta, exit_map=tampered)
    after = decode_attention(case["q"], k, v, **meta, layout="alias", prefix_tiles=True, **kw)
    assert torch.equal(before, after)
    plain = decode_attention(case["q"], k, v, **meta, layout="alias", prefix_tiles=False, **kw)
    assert not torch.equal(before, plain), "the tampered exit map should change the per-key reader"


@pytest.mark.slow      # about 18 s on 2 cores (the interpreter)
@pytest.mark.parametrize("device", DEVICES)
def test_early_kv_changes_no_bit(device):
    # Loading the first K/V tile before the PDL wait (without the key at the row's position, reloaded after it
    # where that tile holds it: contexts of at most one tile, and the one-tile last split of context 264) gives
    # the bits of waiting first.
    dtype = sweep_dtype(device)
    case = make_case(13, device, dtype, [1, 17, 32, 33, 264], "boundary")
    for kw in (dict(), dict(min_split_tokens=128)):
        early = run_variants(case, **kw)
        late = run_variants(case, early_kv=False, **kw)
        for key in VARIANTS:
            assert torch.equal(early[key], late[key]), f"{key} with {kw}: early_kv changed a bit"
    check_case(case)


@triton.jit
def _prefetch_lines_kernel(out_ptr, block_tables_ptr, exit_map_ptr, slot, depth, n_ctx, direct_end, num_planes,
                           stride_bts, stride_btp, stride_btj, stride_ems, stride_b, stride_t, stride_d,
                           KEYS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_PAD: tl.constexpr, LINE_ELEMS: tl.constexpr, LAYOUT_ALIAS: tl.constexpr):
    """The offsets the split kernel's K/V prefetch asks for, keys 0 .. KEYS - 1 of one row in one span (no PTX);
    -1 where it asks for nothing (keys at or past the context)."""
    LINES: tl.constexpr = max(1, HEAD_DIM_PAD // LINE_ELEMS)
    bt_row = block_tables_ptr + slot * stride_bts
    offs = tl.arange(0, KEYS)
    mask = offs < n_ctx
    pages = da._span_pages(bt_row, bt_row + (depth - 1) * stride_btp, exit_map_ptr + slot * stride_ems, offs, mask,
                           depth, direct_end, num_planes, stride_btp, stride_btj, 1, PAGE_SIZE, LAYOUT_ALIAS)
    lines = da._kv_line_offsets(pages, offs, stride_b, stride_t, stride_d, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD,
                                LINE_ELEMS)
    cells = offs[:, None] * LINES + tl.arange(0, LINES)[None, :]
    tl.store(out_ptr + cells, tl.where(mask[:, None], lines, -1))


@pytest.mark.parametrize("layout,prefix", VARIANTS)
@pytest.mark.parametrize("head_dim,line_elems", [(16, 8), (12, 4)])
def test_kv_prefetch_asks_for_the_lines_each_key_is_read_from(layout, prefix, head_dim, line_elems):
    # decode_attention(prefetch_kv=...)'s L2 prefetch (CUDA only) asks, for every key before the context's end, for
    # the lines of the row the kernel then reads: the page of the plane LAST_EXITED names (key_planes_ref), every
    # line of the head (a made-up element stride of 3 so the lines' spacing counts), none past the row's last
    # element (head_dim 12 padded to 16: lines at 0, 4, 8 and the row's last, 11), and nothing past the context.
    case = make_case(5, "cpu", torch.float32, [40, 70], "boundary", head_dim=head_dim)
    meta, (k_cache, _) = case["meta"], case[layout]
    bt, em = meta["block_tables"], meta["exit_map"]
    pad, stride_d = triton.next_power_of_2(head_dim), 3
    lines = pad // line_elems
    for row in range(case["num_real_rows"]):
        slot, depth, pos = (int(meta[name][row]) for name in ("row_slot", "row_depth", "row_pos"))
        n_ctx, first_alias = pos + 1, int(meta["row_first_alias"][row])
        direct_end = (first_alias // 32) * 32 if prefix else (0 if layout == "alias" else n_ctx)
        keys = triton.next_power_of_2(n_ctx + 5)
        out = torch.full((keys, lines), -2, dtype=torch.int64)
        _prefetch_lines_kernel[(1,)](out, bt, em, slot, depth, n_ctx, direct_end, bt.shape[1], *bt.stride(),
                                     em.stride(0), *k_cache.stride()[:2], stride_d, KEYS=keys,
                                     PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=pad,
                                     LINE_ELEMS=line_elems, LAYOUT_ALIAS=layout == "alias")
        planes = key_planes_ref(bt, slot, depth, n_ctx, em, first_alias, layout, prefix, 32)
        p = torch.arange(n_ctx)
        blocks = bt[slot, planes - 1, p // k_cache.shape[1]].long()
        firsts = torch.clamp(torch.arange(lines) * line_elems, max=head_dim - 1)
        want = blocks[:, None] * k_cache.stride(0) + (p % k_cache.shape[1])[:, None] * k_cache.stride(1) \
            + firsts[None, :] * stride_d
        assert torch.equal(out[:n_ctx], want), f"row {row} ({layout}, prefix {prefix}): wrong lines asked for"
        assert (out[n_ctx:] == -1).all(), f"row {row}: a key past the context was asked for"


def test_register_cap_follows_the_grid_not_the_layout():
    # The cap is chosen from the launch shape alone: on at a grid beyond one uncapped wave, off at or
    # below it and without an SM count (CPU / interpreter); the warps follow the tile only.
    sms = 132
    wave = UNCAPPED_PROGRAMS_PER_SM * sms
    assert launch_config(128, 32, programs=wave + 1, sm_count=sms)["maxnreg"] == REGISTER_CAP
    assert "maxnreg" not in launch_config(128, 32, programs=wave, sm_count=sms)
    assert "maxnreg" not in launch_config(128, 32, programs=10 * wave, sm_count=0)
    assert launch_config(128, 32)["num_warps"] == 4 and launch_config(128, 16)["num_warps"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kw", [dict(maxnreg=0), dict(maxnreg=128), dict(exit_ahead=False),
                                dict(pipe_stages=3), dict(early_kv=False), dict(early_trigger=True),
                                dict(prefetch_kv=4)])
def test_schedule_knobs_change_no_bit(kw):
    # The register cap and the exit-map look-ahead change the schedule only: same bits as the defaults.
    case = make_case(12, "cuda", torch.bfloat16, [17, 64, 130, 256], "boundary", heads=16, kv_heads=16,
                     head_dim=128, boundaries=LATE_BOUNDARIES + BOUNDARIES, depths=lambda s: (1, 2, 3, 4))
    default = run_variants(case)
    knobbed = run_variants(case, **kw)
    for key in VARIANTS:
        assert torch.equal(default[key], knobbed[key]), f"{key} with {kw}"
    check_case(case, **kw)
