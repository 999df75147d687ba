"""The decode step's slot-state kernels (kernels/step_state.py) == the runner's torch code, exactly.

Rows mix depth 1 (input from the embedding of the slot's last token) and deeper rows (input from the slot's
hidden state), exiting and staying rows, and one padding row (the scratch slot); slots come in shuffled
order. Both sides start from the same state, and every output and every updated slot must be bitwise
equal. Interpreter on the CPU, the same cases on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from loopbench.kernels import step_state as ss

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _state(device, dtype, acc, S=6, hidden=48, vocab=40, max_len=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    st = dict(last_token=torch.randint(0, vocab, (S + 1,), generator=g),
              embed=torch.randn(vocab, hidden, generator=g).to(dtype),
              hidden=torch.randn(S + 1, hidden, generator=g).to(dtype),
              survival=torch.rand(S + 1, generator=g).to(acc),
              triggered=torch.rand(S + 1, generator=g) < 0.5,
              out_tokens=torch.randint(0, vocab, (S + 1, max_len), generator=g),
              n_out=torch.randint(0, max_len, (S + 1,), generator=g))     # up to the last column
    return {k: v.to(device) for k, v in st.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,acc", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float64, torch.float64)])
@pytest.mark.parametrize("block_v", [1024, None])      # chunk edges inside the case; the module's own chunk
def test_gather_and_apply_equal_the_torch_code(device, dtype, acc, block_v, monkeypatch):
    if block_v is not None:
        monkeypatch.setattr(ss, "_BLOCK_V", block_v)
    state = _state(device, dtype, acc)
    i32 = dict(dtype=torch.int32, device=device)
    row_slot = torch.tensor([4, 0, 2, -1, 5, 1, -1, -1], **i32)         # three padding rows, depths 1 and 2
    row_depth = torch.tensor([1, 3, 2, 1, 1, 4, 2, 1], **i32)
    gather_args = (row_slot, row_depth, state["last_token"], state["embed"], state["hidden"], state["survival"],
                   state["triggered"])
    got, want = ss.gather_rows(*gather_args), ss.gather_rows_ref(*gather_args)
    for name, a, b in zip(("sl", "x", "s_prev", "t_prev"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"gather_rows {name}: {a} != {b}"

    sl, x_in = want[0], want[1]
    g = torch.Generator().manual_seed(1)
    n = row_slot.shape[0]
    exit_now = torch.tensor([True, False, True, True, False, True, True, False], device=device)  # padding "exits"
    # greedy ties: row 0 holds its max twice in different chunks, row 1 twice in one chunk, row 2 on both sides
    # of a chunk edge (the first index must win); row 4 at the last logit, row 5 all -inf, row 6 NaN (torch
    # takes the first NaN)
    logits = torch.randn(n, 3000, generator=g)            # 1024-element chunks: two and a short third
    logits[0, [700, 2500]] = 9.0
    logits[1, [301, 17]] = 9.0
    logits[2, [2100, 2047]] = 9.0
    logits[4, 2999] = 9.0
    logits[5] = float("-inf")
    logits[6, [2200, 40]] = float("nan")
    logits = logits.to(device, dtype)
    x = (x_in.float() + 1).to(dtype)
    s = torch.rand(n, generator=g).to(device, acc)
    trig = torch.tensor([False, True, True, False, True, False, True, False], device=device)
    results = []
    for fn in (ss.apply_rows, ss.apply_rows_ref):
        st = {k: v.clone() for k, v in state.items()}
        out = fn(exit_now, logits, x, s, trig, sl, row_slot, st["hidden"], st["survival"], st["triggered"],
                 st["out_tokens"], st["n_out"], st["last_token"])
        results.append((out, st))
    (got_out, got_st), (want_out, want_st) = results
    for name, a, b in zip(("exit", "exit_slot", "token"), got_out, want_out):
        assert a.dtype == b.dtype and torch.equal(a, b), f"apply_rows {name}: {a} != {b}"
    assert want_out[1].tolist() == [4, -1, 2, -1, -1, 1, -1, -1]
    assert [want_out[2][i].item() for i in (0, 1, 2, 4, 5, 6)] == [700, 17, 2047, 2999, 0, 40]
    # every real slot exactly; the scratch slot S is written by several padding rows, in an unspecified order
    for name in state:
        a, b = got_st[name][:-1], want_st[name][:-1]
        assert torch.equal(a, b), f"apply_rows left {name} different: {a} vs {b}"
    # the reference really did something: exiting rows appended their token
    assert want_st["n_out"][4] == state["n_out"][4] + 1 and want_st["n_out"][0] == state["n_out"][0]


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_across_the_module_chunks(device):
    """At a vocabulary of three module-sized chunks (Ouro's is 49,152): maxima tied across the chunk edges,
    within a chunk, two chunks apart and at the last logit; the first index wins, as in torch.argmax."""
    state = _state(device, torch.float32, torch.float32)
    vocab, c = 40_000, ss._BLOCK_V
    assert 2 * c < vocab <= 3 * c
    ties = [[c - 1, c], [c + 5, c + 3], [2 * c + 1, 7], [2 * c, 2 * c - 1], [vocab - 1]]
    n = len(ties)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(n, vocab, generator=g)
    for row, cols in enumerate(ties):
        logits[row, cols] = 9.0
    args = (torch.ones(n, dtype=torch.bool), logits, state["hidden"][:n].clone(), torch.ones(n),
            torch.zeros(n, dtype=torch.bool), torch.arange(n), torch.arange(n, dtype=torch.int32))
    args = tuple(a.to(device) for a in args)
    tokens = []
    for fn in (ss.apply_rows, ss.apply_rows_ref):
        st = {k: v.clone() for k, v in state.items()}
        tokens.append(fn(*args, st["hidden"], st["survival"], st["triggered"], st["out_tokens"], st["n_out"],
                         st["last_token"])[2].tolist())
    assert tokens[0] == tokens[1] == [min(cols) for cols in ties], tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_v", [256, None])     # partials in several chunks, and in one
def test_apply_from_tile_partials_samples_the_logits_token(device, block_v, monkeypatch):
    """apply_rows on lm_head's per-tile partials (gemm.TileArgmax) == apply_rows on the logits they come from,
    kernel and torch: ties inside a tile, across tile edges and across the kernel's chunks of tiles, a row
    of -inf, a NaN, the last column; the partials are a row slice of a larger batch's (stride M, as a graph
    bucket's outputs are sliced to the live rows)."""
    from loopbench.kernels import gemm
    if block_v is not None:
        monkeypatch.setattr(ss, "_BLOCK_V", block_v)
    state = _state(device, torch.bfloat16, torch.float32)
    n, vocab, bn = 6, 40_000, 64                 # 625 tiles
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n + 2, vocab, generator=g)
    logits[0, [bn - 1, bn]] = 9.0                # across a tile edge
    logits[1, [300 * bn + 3, 300 * bn + 1]] = 9.0     # within one tile
    logits[2, [256 * bn + 5, 255 * bn + 9]] = 9.0     # across the kernel's 256-tile chunks
    logits[3] = float("-inf")
    logits[4, [vocab - 1, 12_345]] = float("nan")
    logits[5, vocab - 1] = 9.0
    logits = logits.to(torch.bfloat16)
    part = gemm.argmax_partials_ref(logits, bn)
    part = gemm.TileArgmax(part.tile_max.to(device), part.tile_index.to(device))[:n]
    logits = logits[:n].to(device)
    args = (torch.ones(n, dtype=torch.bool), None, state["hidden"][:n].clone(), torch.ones(n),
            torch.zeros(n, dtype=torch.bool), torch.arange(n), torch.arange(n, dtype=torch.int32))
    tokens = []
    for fn in (ss.apply_rows, ss.apply_rows_ref):
        for head in (logits, part):
            st = {k: v.clone() for k, v in state.items()}
            a = tuple(head if t is None else t.to(device) for t in args)
            tokens.append(fn(*a, st["hidden"], st["survival"], st["triggered"], st["out_tokens"], st["n_out"],
                             st["last_token"])[2].tolist())
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3] == [bn - 1, 300 * bn + 1, 255 * bn + 9, 0, 12_345,
                                                                 vocab - 1], tokens


def test_rejects_rows_of_different_lengths():
    state = _state("cpu", torch.float32, torch.float32)
    with pytest.raises(ValueError, match="row_depth has 2 rows"):
        ss.gather_rows(torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32), state["last_token"],
                       state["embed"], state["hidden"], state["survival"], state["triggered"])


@pytest.mark.parametrize("device", DEVICES)
def test_fp64_argmax_separates_what_fp32_cannot(device):
    """An fp64 model's logits are compared in fp64: 1 + 1e-12 beats an earlier 1.0 (in fp32 they would tie)."""
    state = _state(device, torch.float64, torch.float64)
    n = 2
    logits = torch.zeros(n, 100, dtype=torch.float64)
    logits[:, 10] = 1.0
    logits[:, 20] = 1.0 + 1e-12
    args = (torch.ones(n, dtype=torch.bool), logits, state["hidden"][:n].clone(), torch.ones(n, dtype=torch.float64),
            torch.zeros(n, dtype=torch.bool), torch.tensor([0, 1]), torch.tensor([0, 1], dtype=torch.int32))
    args = tuple(a.to(device) for a in args)
    for fn in (ss.apply_rows, ss.apply_rows_ref):
        st = {k: v.clone() for k, v in state.items()}
        _, _, token = fn(*args, st["hidden"], st["survival"], st["triggered"], st["out_tokens"], st["n_out"],
                         st["last_token"])
        assert token.tolist() == [20, 20], f"{fn.__name__}: {token.tolist()}"


def test_rejects_mismatched_state():
    state = _state("cpu", torch.float32, torch.float32)
    rows = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="embed"):
        ss.gather_rows(rows, rows, state["last_token"], state["embed"].double(), state["hidden"], state["survival"],
                       state["triggered"])
    with pytest.raises(ValueError, match="vocab >= 1"):
        ss.apply_rows(torch.ones(2, dtype=torch.bool), torch.zeros(2, 0), state["hidden"][:2].clone(),
                      torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2).long(), rows,
                      state["hidden"], state["survival"], state["triggered"], state["out_tokens"], state["n_out"],
                      state["last_token"])
    with pytest.raises(ValueError, match="survival must be torch.float64"):
        ss.apply_rows(torch.ones(2, dtype=torch.bool), torch.zeros(2, 5), state["hidden"][:2].clone(),
                      torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.bool), torch.zeros(2).long(), rows,
                      state["hidden"], state["survival"], state["triggered"], state["out_tokens"], state["n_out"],
                      state["last_token"])
