"""KV cells a row does not own are never written and never read, and the three KV layouts agree bitwise
where they part most easily (BRIEF section 1; DESIGN.md "Paged, depth-aware KV"):

- native fill and exit publication write nothing for entries that do not exit, in every backend;
- decode attention ignores keys past a row's context whatever the memory holds: every engine here runs
  with ``poison_kv`` (never-written and freed KV cells are NaN), so a reader that touches one gives NaN;
- layouts are bitwise equal when a row's first aliased position is the last key of a tile, and when
  tokens exit at depth 1;
- padding rows of a graph bucket change no live state.

Engine-vs-reference comparisons run in float64 (BRIEF section 5: no near-tie flips); layouts and
backends on the same kernels are compared bit for bit (logits included).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loopbench.runtime.attention import get_backend
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.descriptors import DESC_ROWS, PADDING_ROW
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.kv_cache import DepthKVCache
from loopbench.runtime.model import OuroModel
from loopbench.runtime.schedule import Schedule, ScheduledRequest, prompt_sha256
from loopbench.kernels.decode_attention import decode_attention_ref
from loopbench.kernels.kv_write import native_fill_ref, publish_exits_ref

from tests.kernels.test_decode_attention import VARIANTS, make_case

ARMS = {"native": dict(kv_layout="native"), "alias": dict(kv_layout="alias"),
        "alias_prefix": dict(kv_layout="alias", prefix_tiles=True)}
BACKENDS = ["torch", "triton"]        # triton: the Triton interpreter on CPU tensors (conftest)


@pytest.fixture(scope="module")
def model32(tiny_ckpt):
    return OuroModel.from_tensors(*tiny_ckpt, dtype=torch.float32)


def prompts(seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def make_engine(model, **cfg) -> LoopEngine:
    cfg.setdefault("max_model_len", 128)
    cfg.setdefault("poison_kv", True)
    cfg.setdefault("prefill_gemm_rows", 16)   # the tiny model: 256-row prefill packs only slow the interpreter
    return LoopEngine(model, EngineConfig(**cfg))


def run(model, reqs, *, spy=False, **cfg):
    """Run ``reqs`` to completion; with ``spy`` also count native-fill collisions (see below)."""
    eng = make_engine(model, keep_logits=True, **cfg)
    hits = [0]
    if spy:
        fill = eng.runner.backend.native_fill

        def counting_fill(k, v, bt, slot, pos, exit_depth, max_depth):
            hits[0] += fill_collisions(slot, pos, exit_depth, max_depth)
            return fill(k, v, bt, slot, pos, exit_depth, max_depth)

        eng.runner.backend = dataclasses.replace(eng.runner.backend, native_fill=counting_fill)
    for r in reqs:
        eng.add_request(r)
    return eng, eng.run(), hits[0]


def fill_collisions(slot, pos, exit_depth, max_depth) -> int:
    """Native-fill entries of slot 0 that copy into plane d at position p while an entry that does not
    exit (slot -1) sits at the same p with depth d: a backend that clamps the skipped entry to slot 0
    writes that very cell too, and the copy can be lost."""
    s, p, e, m = slot.tolist(), pos.tolist(), exit_depth.tolist(), max_depth.tolist()
    return sum(1 for i in range(len(s)) if s[i] == 0 for j in range(len(s))
               if s[j] < 0 and p[j] == p[i] and e[i] < e[j] <= m[i])


def designed_schedule(reqs: list[Request], exit_depths: list[list[int]], max_num_seqs: int) -> Schedule:
    """A schedule that forces the given decode exit depths (one per output token after the first,
    which prefill produces at max_loops). Tokens are left empty: the replay is checked against the
    naive reference, not against the schedule."""
    entries = []
    for r, depths in zip(reqs, exit_depths):
        assert len(depths) == r.max_tokens - 1
        entries.append(ScheduledRequest(r.request_id, prompt_sha256(r.prompt_token_ids), len(r.prompt_token_ids),
                                        r.max_tokens, r.min_loops, r.max_loops, r.exit_threshold, (),
                                        (r.max_loops, *depths)))
    return Schedule(Schedule.FORMAT_VERSION, max_num_seqs, tuple(r.request_id for r in reqs), tuple(entries),
                    0, "")


def run_arms(model, reqs, **cfg) -> dict:
    results = {}
    for name, arm in ARMS.items():
        eng, outs, hits = run(model, reqs, spy=name == "native", **cfg, **arm)
        results[name] = (outs, eng.logits_log, eng.stats.copy(), hits)
    return results


def assert_arms_bitwise(results: dict, what: str) -> None:
    ref_outs, ref_logits, ref_stats, _ = results["native"]
    for name, (outs, logits, stats, _) in results.items():
        for rid, rows in logits.items():
            assert all(torch.isfinite(row).all() for row in rows), f"{what}: {name} {rid}: NaN logits"
        if name == "native":
            continue
        assert outs == ref_outs, f"{what}: {name} tokens/exits differ from native"
        assert stats == ref_stats, f"{what}: {name} work counters differ from native"
        for rid, rows in ref_logits.items():
            for i, (a, b) in enumerate(zip(rows, logits[rid])):
                assert torch.equal(a, b), (f"{what}: {name} {rid} token {i}: logits differ from native, max diff "
                                           f"{(a - b).abs().max().item():.3e}")


_references: dict = {}


def assert_matches_reference(naive, reqs, outs, policy: str, what: str) -> None:
    for r in reqs:
        o = outs[r.request_id]
        forced = tuple(o.exit_depths) if policy == "replay" else None
        key = (r, policy, forced)
        if key not in _references:
            _references[key] = naive.generate(list(r.prompt_token_ids), r.max_tokens, policy=policy,
                                              min_loops=r.min_loops, max_loops=r.max_loops,
                                              threshold=r.exit_threshold, forced_exits=forced)
        tokens, exits = _references[key]
        assert (list(o.token_ids), list(o.exit_depths)) == (tokens, exits), \
            f"{what}: {r.request_id} (prompt {len(r.prompt_token_ids)}) differs from the naive reference"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that treats NaN like any other bit pattern (torch.equal says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------ item 1: entries that do not exit
@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_that_do_not_exit_write_nothing(backend):
    """A slot-0 token exits at depth 1 at position 5 while another row (not exiting, so passed with
    slot -1) sits at position 5 at depth 3: the fill of slot 0's plane 3 must land. Also: a batch where
    nothing exits leaves the cache bit-identical, and so does an exit-map publication of skipped rows."""
    be = get_backend(backend)
    gen = torch.Generator().manual_seed(0)
    block_tables = (torch.randperm(2 * 4 * 2, generator=gen) + 1).view(2, 4, 2).int()   # block 0 unused
    k = torch.randn((2, 20, 4, 2, 8), generator=gen)
    v = torch.randn((2, 20, 4, 2, 8), generator=gen)
    cases = {
        "fill beside a skipped row": ([0, -1, 1, -1], [5, 5, 2, 0], [1, 3, 2, 1], [4, 4, 3, 1]),
        "skipped row first": ([-1, 0], [5, 5], [2, 1], [4, 4]),
        "nothing exits": ([-1, -1, -1], [5, 3, 0], [3, 2, 1], [4, 4, 4]),
    }
    for what, entries in cases.items():
        args = [int32(x) for x in entries]
        k_be, v_be, k_ref, v_ref = k.clone(), v.clone(), k.clone(), v.clone()
        be.native_fill(k_be, v_be, block_tables, *args)
        native_fill_ref(k_ref, v_ref, block_tables, *args)
        assert torch.equal(k_be, k_ref) and torch.equal(v_be, v_ref), f"{backend} native_fill, {what}"
    assert torch.equal(k_be, k), "the reference should have changed nothing when nothing exits"

    exit_map = torch.full((2, 8), 4, dtype=torch.int32)
    for what, entries in {"publish beside a skipped row": ([0, -1], [0, 3], [2, 1]),
                          "skipped row first": ([-1, 1, -1], [0, 7, 7], [1, 1, 3]),
                          "nothing exits": ([-1, -1], [0, 1], [1, 2])}.items():
        args = [int32(x) for x in entries]
        em_be, em_ref = exit_map.clone(), exit_map.clone()
        be.publish_exits(em_be, *args)
        publish_exits_ref(em_ref, *args)
        assert torch.equal(em_be, em_ref), f"{backend} publish_exits, {what}: {em_be.tolist()} != {em_ref.tolist()}"


# Requests of one prompt length with mixed bounds, so rows of different requests meet at one position at
# different depths: that is where a skipped entry and slot 0's fill hit the same KV cell.
COLLIDING = [(1, 4, 0.6), (1, 4, 0.2), (2, 3, 0.4)]


def colliding_requests() -> list[Request]:
    return [Request(f"r{i}", p, 24, *COLLIDING[i % len(COLLIDING)]) for i, p in enumerate(prompts(0, [8] * 8))]


@pytest.mark.parametrize("case", ["ouro", "replay", "designed"])
def test_native_fill_beside_rows_that_do_not_exit(model64, naive, case):
    """native == alias == alias+prefix bitwise and == the naive reference, on workloads where slot 0's
    native fill meets a row that does not exit at the same position (counted, so the test is not vacuous):
    a natural ``ouro`` run with min_loops 1 and 2 and max_loops 3 and 4, its replay, and a designed
    schedule that forces such meetings."""
    reqs = colliding_requests()
    cfg = dict(max_num_seqs=4, exit_policy="ouro")
    sched = None
    if case == "replay":
        base, _, _ = run(model64, reqs, **cfg)
        sched = base.capture_schedule()
        cfg = dict(max_num_seqs=4, exit_policy="replay", schedule=sched)
    elif case == "designed":
        reqs = [Request(f"d{i}", p, 16, 1, 4, 0.5) for i, p in enumerate(prompts(1, [8, 8]))]
        pattern = [(2, 1, 3), (1, 3, 2)]
        depths = [[pattern[i][t % 3] for t in range(15)] for i in range(2)]
        cfg = dict(max_num_seqs=2, exit_policy="replay", schedule=designed_schedule(reqs, depths, 2))
    results = run_arms(model64, reqs, **cfg)
    assert results["native"][3] > 0, f"{case}: no fill met a row that does not exit; the workload is vacuous"
    assert_arms_bitwise(results, case)
    if sched is not None:          # the replay reproduces the natural run, which the "ouro" case checks
        sched.verify(results["alias"][0])
    else:
        assert_matches_reference(naive, reqs, results["alias"][0], case if case == "ouro" else "replay", case)


# -------------------------------------------------------------- item 2: keys outside a row's context
ENGINE_PADDING = 3          # padding rows as the engine writes them (PADDING_ROW)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exits", ["mixed", "boundary"])
def test_decode_attention_ignores_keys_outside_the_context(backend, exits):
    """Rows of very different lengths in one batch over a pool whose every unwritten cell is NaN
    (make_case): each backend matches the reference, the layouts agree bitwise, nothing is NaN, and
    padding rows give zeros."""
    case = make_case(21, "cpu", torch.float32, [1, 15, 17, 33, 64, 65], exits, padding_rows=0)
    meta = dict(case["meta"])
    slot, depth, pos, _, first = PADDING_ROW
    for name, value in (("row_slot", slot), ("row_depth", depth), ("row_pos", pos), ("row_first_alias", first)):
        meta[name] = torch.cat([meta[name], int32([value] * ENGINE_PADDING)])
    q = torch.cat([case["q"], case["q"][:ENGINE_PADDING]])
    attend = get_backend(backend).decode_attention
    n = case["num_real_rows"]
    outs = {}
    for layout, prefix in VARIANTS:
        k, v = case[layout]
        out = attend(q, k, v, *meta.values(), layout=layout, prefix_tiles=prefix)
        ref = decode_attention_ref(q, k, v, *meta.values(), layout=layout, prefix_tiles=prefix)
        assert torch.isfinite(out).all(), f"{backend} {layout}/{prefix}: NaN from a key outside a row's context"
        diff = (out[:n] - ref[:n]).abs().max().item()
        assert diff < 1e-5, f"{backend} {layout}/{prefix}: max abs diff {diff:.3e} from the reference"
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), f"{backend} {layout}/{prefix}: padding rows"
        outs[(layout, prefix)] = out
    for key, out in outs.items():
        assert torch.equal(out, outs[("native", False)]), f"{backend} {key} differs from native"


def test_poison_kv_marks_never_written_and_freed_cells():
    kw = dict(num_layers=2, num_kv_heads=1, head_dim=4, num_planes=2, max_num_seqs=2, max_model_len=8,
              block_size=4, num_blocks=9, device="cpu", dtype=torch.float32)
    plain = DepthKVCache(**kw)
    assert torch.equal(plain.k, torch.zeros_like(plain.k)), "without poison the pool starts at zero"
    kv = DepthKVCache(**kw, poison=True)
    assert torch.isnan(kv.k).all() and torch.isnan(kv.v).all()
    kv.open_slot(1, 2, 6, prompt_exit_depth=2)
    kv.flush_tables()                             # the device tables get the new entries once per step
    blocks = kv.block_tables[1].flatten().long()
    kv.k[:, blocks] = 1.0
    kv.v[:, blocks] = 1.0
    kv.close_slot(1)
    assert torch.isnan(kv.k).all() and torch.isnan(kv.v).all(), "freed blocks must be NaN again"
    assert torch.equal(kv.block_tables[1], torch.zeros_like(kv.block_tables[1])), \
        "a closed slot's table entries must point at the reserved block 0 again"


@pytest.mark.slow      # about 56 s on 2 cores with the Triton backend
@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_engine_with_slot_reuse_matches_reference(model64, model32, naive, backend):
    """Mixed prompt lengths in one batch, slots and blocks reused by later requests: with every free
    cell NaN the engine still matches the reference, and after the drain the whole pool is NaN again
    (nothing was written outside a live request's blocks, block 0 included)."""
    model = model64 if backend == "torch" else model32     # Triton kernels take fp32 at most
    lens = [1, 33, 17, 40] if backend == "torch" else [1, 33, 17]
    reqs = [Request(f"r{i}", p, 5, min_loops=2, max_loops=4, exit_threshold=0.5)
            for i, p in enumerate(prompts(2, lens))]
    for layout in (dict(kv_layout="native"), dict(kv_layout="alias", prefix_tiles=True)):
        eng, outs, _ = run(model, reqs, max_num_seqs=2, exit_policy="ouro_delayed", attention_backend=backend,
                           **layout)
        assert_matches_reference(naive, reqs, outs, "ouro_delayed", f"{backend} {layout}")
        assert torch.isnan(eng.kv.k).all() and torch.isnan(eng.kv.v).all(), \
            f"{backend} {layout}: a KV cell outside every live request's blocks was written"


# ---------------------------------------------------------------- item 8: tile boundaries, depth 1
def first_aliases(reqs, outs):
    """(request, depth d, first-alias position p, does a later token reach depth >= d) per request."""
    found = []
    for r in reqs:
        o = outs[r.request_id]
        T = len(r.prompt_token_ids)
        exits = {T + i - 1: e for i, e in enumerate(o.exit_depths) if i >= 1}   # decode position -> e_p
        for d in range(2, r.max_loops + 1):
            aliased = [p for p, e in sorted(exits.items()) if e < d]
            if aliased:
                p = aliased[0]
                found.append((r.request_id, d, p, any(q > p and e >= d for q, e in exits.items())))
    return found


def boundary_requests() -> tuple[list[Request], list[list[int]]]:
    """Requests whose first aliased position is the last key of a 16- and of a 32-key tile (15, 31, 47,
    63): the first decode token exits at depth 1 (T = 15, 31, 47), or tokens run to max_loops until
    position 31 exits at depth 2 (T = 20); later tokens go deeper again, so queries at depths 2..4 read
    the boundary key through its tile."""
    lens = [31, 15, 20, 47]
    reqs = [Request(f"b{i}", p, 15, 1, 4, 0.5) for i, p in enumerate(prompts(3, lens))]
    deep = [4, 3, 2, 4, 1, 3, 4, 2]
    depths = [[1] + [deep[t % len(deep)] for t in range(13)],
              [1] + [deep[(t + 3) % len(deep)] for t in range(13)],
              [4] * 11 + [2] + [deep[t % len(deep)] for t in range(2)],
              [1, 1] + [deep[(t + 5) % len(deep)] for t in range(12)]]
    return reqs, depths


@pytest.mark.parametrize("tile_size", [16, 32])
def test_layouts_bitwise_when_first_alias_is_the_last_key_of_a_tile(model64, naive, tile_size):
    reqs, depths = boundary_requests()
    sched = designed_schedule(reqs, depths, 4)
    results = run_arms(model64, reqs, max_num_seqs=4, exit_policy="replay", schedule=sched, tile_size=tile_size)
    outs = results["native"][0]
    hits = [(rid, d, p) for rid, d, p, read in first_aliases(reqs, outs) if read and p % tile_size == tile_size - 1]
    assert len({rid for rid, _, _ in hits}) >= 2, f"tile {tile_size}: no first alias on a tile's last key"
    assert_arms_bitwise(results, f"tile {tile_size}")
    assert_matches_reference(naive, reqs, results["alias_prefix"][0], "replay", f"tile {tile_size}")


def test_layouts_bitwise_with_depth_1_exits(model64, naive):
    """Natural ``ouro`` with min_loops 1: tokens exit after their first loop, and later tokens of the
    same request read them from deeper loops (so a depth-1 exit that is not published, or not filled,
    shows)."""
    reqs = [Request(f"e{i}", p, 16, 1, mx, thr) for i, (p, mx, thr) in
            enumerate(zip(prompts(4, [9, 31, 20, 15, 40]), [4, 4, 3, 4, 4], [0.3, 0.45, 0.3, 0.6, 0.45]))]
    results = run_arms(model64, reqs, max_num_seqs=3, exit_policy="ouro", tile_size=16)
    outs = results["native"][0]
    read_later = [(rid, p) for rid, d, p, read in first_aliases(reqs, outs) if d == 2 and read]
    assert len(read_later) >= 2, f"too few depth-1 exits read from depth 2 later: {read_later}"
    assert_arms_bitwise(results, "ouro min_loops 1")
    assert_matches_reference(naive, reqs, results["alias"][0], "ouro", "ouro min_loops 1")


# -------------------------------------------------------------------------- item 8: padding rows
def engine_state(eng: LoopEngine) -> dict[str, torch.Tensor]:
    """Every piece of resident state a step may write, live slots only (row S is the padding scratch)."""
    S = eng.config.max_num_seqs
    live = {name: getattr(eng.runner, name)[:S].clone() for name in
            ("hidden", "last_token", "out_tokens", "n_out", "survival", "triggered", "min_loops", "max_loops",
             "threshold")}
    return {**live, "kv.k": eng.kv.k.clone(), "kv.v": eng.kv.v.clone(), "kv.exit_map": eng.kv.exit_map.clone(),
            "kv.block_tables": eng.kv.block_tables.clone()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", list(ARMS))
def test_padding_rows_change_no_live_state(model64, model32, backend, arm):
    """The engine's device step on a bucket of padding rows only (what a graph warm-up runs, and what
    fills every bucket beyond its live rows) leaves every live slot's state bit-identical."""
    model = model64 if backend == "torch" else model32
    reqs = [Request(f"p{i}", p, 12, 1, mx, 0.4) for i, (p, mx) in enumerate(zip(prompts(5, [9, 5, 17]), [4, 3, 4]))]
    eng = make_engine(model, max_num_seqs=3, exit_policy="ouro", attention_backend=backend, **ARMS[arm])
    for r in reqs:
        eng.add_request(r)
    for _ in range(6):                     # every slot past prefill (4 loops), then decode steps
        eng.step()
    assert all(r is not None and r.phase == "decode" for r in eng.scheduler.slots), "expected three decoding slots"
    before = engine_state(eng)
    bucket = 4
    desc = torch.tensor(PADDING_ROW, dtype=torch.int32)[:, None].expand(DESC_ROWS, bucket).contiguous()
    eng.runner.decode_core(*desc)
    after = engine_state(eng)
    changed = [name for name in before if not same_bits(before[name], after[name])]
    assert not changed, f"{backend} {arm}: padding rows changed live state: {changed}"
