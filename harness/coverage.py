"""Coverage: how often each path where the KV layouts differ ran in one arm, derived on the host.

Native, alias and alias + prefix tiles differ only in a few places (DESIGN.md, "Paged, depth-aware
KV"): keys whose token exited below the query depth (native reads a copy, alias resolves the key
through the exit map), the per-key reader itself, the tile where the direct prefix meets the routed
rest, and the native fill. A comparison whose workload never reaches them compares identical code
paths, so its bitwise-equality check says nothing about the layouts. :func:`derive` counts, per arm,
how often each of them ran, so a reader can see that a comparison was not vacuous.

Why derived and not counted: counting inside the decode step would add work (or a host sync) to the
timed region. Under ``replay`` every host decision of the engine is a pure function of the frozen
schedule (DESIGN.md, "Replay scheduling"): FIFO admission into the lowest free slot, one full-depth
prefill loop per step per prefilling request, then one decode loop over the decode rows resident at the
start of the step in slot order, with the schedule's exit depths forced. :func:`simulate` re-enacts
those decisions without a model and yields every decode step's rows (slot, depth, position,
first-alias position), hashing the same row trace the engine hashes. The session calls :func:`derive`
after the measured run (outside the timer) and the checker requires the simulated trace to equal the
measured run's ``trace_sha256``, so the counts describe exactly the rows that ran; the auditor
re-derives them with its own code (``audit/coverage.py``).

Counts of one run (every layer repeats a row's reads, so reads are counted per decode row, not per
layer; lists are indexed by depth or plane 1..num_planes):

- ``exits_per_depth[d-1]``: decode tokens that exited at depth d (prompt tokens always run every loop);
- ``lower_plane_reads[e-1]`` (e = 1..num_planes-1): key reads that LAST_EXITED resolves to plane e
  below the query depth (key k < position p with e_k = e < d); alias reads them through the exit map,
  native reads the copy the fill made in plane d. Equal for every arm of a schedule; all zero means
  that no read differed between the layouts;
- ``routed_reads``: keys the alias reader resolved one by one through the exit map (alias: every key of
  the context; alias + prefix tiles: the keys of the boundary tile and after); 0 for native;
- ``direct_tiles``: key tiles of ``tile_size`` positions that the prefix reader read directly from
  plane d because they end at or before the row's first-alias position; 0 without prefix tiles;
- ``boundary_tiles``: rows whose first-alias position lies inside their context, i.e. rows with a
  boundary tile where direct and routed reads meet; ``boundary_last_key``: of those, rows whose
  first-alias position is the last key of its tile (where an off-by-one in the direct bound bites);
  both 0 without prefix tiles;
- ``fill_token_planes``: native only: token-planes the fill copied; a token exiting at e < max_loops
  fills planes e+1..max_loops, each a copy of its K and V in every layer;
- ``padding_rows``: rows added to decode steps to fill them to ``max_num_seqs`` rows (the batch-invariant
  runtime runs every decode step on that shape, with CUDA Graphs or without; records of schema 3);
- ``trace_sha256``: the simulated row trace.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


COUNT_KEYS = ("exits_per_depth", "lower_plane_reads", "routed_reads", "direct_tiles", "boundary_tiles",
              "boundary_last_key", "fill_token_planes", "padding_rows")


@dataclass(frozen=True)
class DecodeRow:
    slot: int
    depth: int          # query depth d, 1-based
    pos: int            # query position; keys 0..pos
    first_alias: int    # descriptor value: smallest position with e_p < d, else pos + 1
    exits: bool         # the schedule forces an exit after this loop
    max_loops: int      # the request's max_loops (its prompt positions hold e_p = max_loops)
    lower: tuple[int, ...]  # lower[e-1]: the request's positions < pos that exited at depth e


@dataclass
class _Req:
    request_id: str
    prompt_len: int
    max_tokens: int
    max_loops: int
    exit_depths: tuple[int, ...]
    slot: int = -1
    phase: str = "prefill"
    depth: int = 1
    pos: int = 0
    n_out: int = 0
    first_alias: dict[int, int] = field(default_factory=dict)
    lower: list[int] = field(default_factory=list)   # lower[e-1]: positions < pos that exited at depth e


def _requests(schedule: dict) -> list[_Req]:
    """The schedule's requests in admission (= submission) order, from ``Schedule.to_json`` data."""
    by_id = {r["request_id"]: r for r in schedule["requests"]}
    return [_Req(rid, by_id[rid]["prompt_len"], by_id[rid]["max_tokens"], by_id[rid]["max_loops"],
                 tuple(by_id[rid]["exit_depths"])) for rid in schedule["admission_order"]]


def _replayable_requests(schedule: dict, num_planes: int) -> list[_Req]:
    """The schedule's requests in admission order; ValueError for one that cannot be replayed."""
    queue = _requests(schedule)
    for r in queue:
        if not r.exit_depths or not 1 <= r.max_loops <= num_planes or any(
                not 1 <= e <= r.max_loops for e in r.exit_depths):
            raise ValueError(f"request {r.request_id!r} of the schedule cannot be replayed: max_loops "
                             f"{r.max_loops}, exit depths {sorted(set(r.exit_depths))} (num_planes {num_planes})")
        r.lower = [0] * num_planes
    return queue


def simulate(schedule: dict, num_planes: int):
    """The decode steps of a replay of ``schedule`` (``Schedule.to_json`` data) and its row-trace hash.

    Returns (steps, trace_sha256): steps is a list of decode steps, each the list of its
    :class:`DecodeRow` in the engine's row order. ValueError when the schedule cannot be replayed (an
    exit depth outside 1..max_loops, an empty exit list, or a ``max_loops`` above ``num_planes``).
    """
    S = schedule["max_num_seqs"]
    queue = _replayable_requests(schedule, num_planes)
    slots: list[_Req | None] = [None] * S
    trace = hashlib.sha256()
    steps: list[list[DecodeRow]] = []

    def after_token(r: _Req) -> None:
        # the engine's _after_token under replay: length, or the natural run's end (EOS) as a stop
        if r.n_out >= r.max_tokens or r.n_out >= len(r.exit_depths):
            slots[r.slot] = None

    while queue or any(s is not None for s in slots):
        decode = [r for r in slots if r is not None and r.phase == "decode"]
        for slot in range(S):                      # admission: FIFO into free slots (the pool never runs out)
            if queue and slots[slot] is None:
                r = queue.pop(0)
                r.slot, slots[slot] = slot, r
                trace.update(f"A{slot}:{r.request_id!r};".encode())
        for r in [s for s in slots if s is not None]:
            if r.phase != "prefill":
                continue
            trace.update(f"P{r.slot}:{r.depth};".encode())
            if r.depth < r.max_loops:
                r.depth += 1
                continue
            r.n_out, r.phase, r.depth, r.pos = 1, "decode", 1, r.prompt_len
            after_token(r)
        if not decode:
            continue
        step = [DecodeRow(r.slot, r.depth, r.pos, min(r.first_alias.get(r.depth, r.pos + 1), r.pos + 1),
                          r.depth == r.exit_depths[r.n_out], r.max_loops, tuple(r.lower)) for r in decode]
        steps.append(step)
        trace.update(("D" + ",".join(f"{row.slot}:{row.depth}:{row.pos}" for row in step) + ";").encode())
        for r, row in zip(decode, step):
            if row.exits:
                r.lower[r.depth - 1] += 1
                r.n_out += 1
                for d in range(r.depth + 1, r.max_loops + 1):
                    r.first_alias.setdefault(d, r.pos)
                r.pos, r.depth = r.pos + 1, 1
                after_token(r)
            else:
                r.depth += 1
    return steps, trace.hexdigest()


def derive(schedule: dict, arm: dict, num_planes: int) -> dict:
    """The counts of the module docstring for one arm replaying ``schedule``.

    schedule: ``Schedule.to_json`` data; arm: the arm's config (``kv_layout``, ``prefix_tiles``,
    ``tile_size``); num_planes: the model's ``total_ut_steps``. Pure host arithmetic:
    about one microsecond per decode row. ValueError as :func:`simulate`, or for an unknown layout.
    """
    if arm["kv_layout"] not in ("native", "alias"):
        raise ValueError(f"unknown kv_layout {arm['kv_layout']!r}")
    alias, prefix, tile = arm["kv_layout"] == "alias", bool(arm["prefix_tiles"]), int(arm["tile_size"])
    S = schedule["max_num_seqs"]
    steps, trace = simulate(schedule, num_planes)
    out = {"exits_per_depth": [0] * num_planes, "lower_plane_reads": [0] * (num_planes - 1), "routed_reads": 0,
           "direct_tiles": 0, "boundary_tiles": 0, "boundary_last_key": 0, "fill_token_planes": 0,
           "padding_rows": 0}
    for step in steps:
        out["padding_rows"] += S - len(step)
        for row in step:
            ctx = row.pos + 1
            for e in range(1, row.depth):
                out["lower_plane_reads"][e - 1] += row.lower[e - 1]
            direct_keys = (row.first_alias // tile) * tile if prefix else 0
            if alias:
                out["routed_reads"] += ctx - direct_keys
            if prefix:
                out["direct_tiles"] += row.first_alias // tile
                if row.first_alias < ctx:
                    out["boundary_tiles"] += 1
                    out["boundary_last_key"] += int(row.first_alias % tile == tile - 1)
            if row.exits:
                out["exits_per_depth"][row.depth - 1] += 1
                if not alias:
                    out["fill_token_planes"] += row.max_loops - row.depth
    out["trace_sha256"] = trace
    return out
