"""The auditor's own derivation of an arm's coverage counts from the bundle's frozen schedule.

A record's ``coverage`` claims how often each path where the KV layouts differ ran (the counts and
their meaning: DESIGN.md, "Coverage counts"). This module re-derives them from the frozen schedule
(``references/<point>.schedule.json``), the arm's config and the model's number of planes, following
the replay scheduling rules written in DESIGN.md ("Replay scheduling") and nothing of the harness:

- a step admits queued requests (admission order) into free slots, lowest slot first; then every
  prefilling request runs one prompt loop (its first token comes with the last, at depth max_loops);
  then every request that was decoding when the step began runs one loop, in slot order;
- a decode row at depth d exits when d is the schedule's exit depth of the token it computes; the next
  token starts at depth 1 one position later; a request leaves when it has all its tokens;
- the row trace hashes ``A<slot>:<repr(id)>;``, ``P<slot>:<depth>;`` and ``D<slot>:<depth>:<pos>,...;``.

Reproducing the frozen ``trace_sha256`` proves the rules were followed, so the counts describe the
rows the engine ran.
"""
from __future__ import annotations

import hashlib

from . import contract

RECORD = contract.DOCS["record"]
# Graph buckets of the runtime before records of schema 3 (DESIGN.md, "Replay scheduling"): a decode step of
# n rows ran on the smallest bucket >= n that is below max_num_seqs, else on max_num_seqs rows.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
KEYS = ("exits_per_depth", "lower_plane_reads", "routed_reads", "direct_tiles", "boundary_tiles",
        "boundary_last_key", "fill_token_planes", "padding_rows", "trace_sha256")


def padded(n: int, max_num_seqs: int) -> int:
    return next((b for b in BUCKETS if n <= b < max_num_seqs), max_num_seqs)


def decode_steps(schedule: dict) -> tuple[list[list[dict]], str]:
    """Every decode step's rows ({slot, depth, pos, first_alias, exits, max_loops, below, request}) and
    the row-trace sha256 of replaying ``schedule``; ``below`` maps each exit depth e < depth to how many
    of the request's earlier positions exited there. ValueError when a request's exits cannot be replayed."""
    spec = {r["request_id"]: r for r in schedule["requests"]}
    waiting = list(schedule["admission_order"])
    resident: dict[int, dict] = {}
    digest = hashlib.sha256()
    steps: list[list[dict]] = []
    while waiting or resident:
        decoding = [resident[s] for s in sorted(resident) if resident[s]["decoding"]]
        _admit(schedule["max_num_seqs"], spec, waiting, resident, digest)
        for slot in sorted(resident):
            q = resident[slot]
            if q["decoding"]:
                continue
            digest.update(f"P{slot}:{q['loop']};".encode())
            if q["loop"] < q["spec"]["max_loops"]:
                q["loop"] += 1
            else:
                q.update(decoding=True, loop=1, pos=q["spec"]["prompt_len"], done=1)
                _leave_if_done(resident, q)
        if not decoding:
            continue
        rows = []
        for q in decoding:
            d, p = q["loop"], q["pos"]
            rows.append({"slot": q["slot"], "depth": d, "pos": p, "request": q,
                         "first_alias": min(q["first_alias"].get(d, p + 1), p + 1),
                         "exits": d == q["spec"]["exit_depths"][q["done"]], "max_loops": q["spec"]["max_loops"],
                         "below": {e: n for e, n in q["exited_at"].items() if e < d}})
        digest.update(("D" + ",".join(f"{w['slot']}:{w['depth']}:{w['pos']}" for w in rows) + ";").encode())
        steps.append(rows)
        for w in rows:
            q = w["request"]
            if not w["exits"]:
                q["loop"] += 1
                continue
            q["exited_at"][w["depth"]] = q["exited_at"].get(w["depth"], 0) + 1
            for later in range(w["depth"] + 1, w["max_loops"] + 1):
                q["first_alias"].setdefault(later, w["pos"])
            q.update(loop=1, pos=q["pos"] + 1, done=q["done"] + 1)
            _leave_if_done(resident, q)
    return steps, digest.hexdigest()


def _admit(max_num_seqs: int, spec: dict, waiting: list, resident: dict, digest) -> None:
    """Admit waiting requests (admission order) into free slots, lowest slot first."""
    for slot in range(max_num_seqs):
        if waiting and slot not in resident:
            rid = waiting.pop(0)
            r = spec[rid]
            if not r["exit_depths"] or any(not 1 <= e <= r["max_loops"] for e in r["exit_depths"]):
                raise ValueError(f"request {rid!r}: exit depths {r['exit_depths'][:8]}... outside 1..{r['max_loops']}")
            resident[slot] = {"id": rid, "slot": slot, "decoding": False, "loop": 1, "pos": 0, "done": 0,
                              "spec": r, "first_alias": {}, "exited_at": {}}
            digest.update(f"A{slot}:{rid!r};".encode())


def _leave_if_done(resident: dict, q: dict) -> None:
    if q["done"] >= min(q["spec"]["max_tokens"], len(q["spec"]["exit_depths"])):
        del resident[q["slot"]]


def coverage(schedule: dict, arm: dict, num_planes: int, schema: int = 2) -> dict:
    """The record's ``coverage`` as the frozen schedule and the arm's config make it; ``schema`` (the
    record's) picks the padding rule (bundle_format.json ``padding_rows_about``)."""
    steps, trace = decode_steps(schedule)
    tile = arm["tile_size"]
    alias, prefix = arm["kv_layout"] == "alias", bool(arm["prefix_tiles"])
    exits, below = [0] * num_planes, [0] * (num_planes - 1)
    routed = direct = boundary = last_key = fill = padding = 0
    for rows in steps:
        if schema >= RECORD["full_batch_padding_since_schema"]:
            padding += schedule["max_num_seqs"] - len(rows)
        elif arm["cuda_graphs"]:
            padding += padded(len(rows), schedule["max_num_seqs"]) - len(rows)
        for w in rows:
            for e, n in w["below"].items():
                below[e - 1] += n
            keys, fa = w["pos"] + 1, w["first_alias"]
            if prefix:
                direct += fa // tile
                routed += keys - fa // tile * tile
                if fa < keys:
                    boundary += 1
                    last_key += fa % tile == tile - 1
            elif alias:
                routed += keys
            if w["exits"]:
                exits[w["depth"] - 1] += 1
                fill += 0 if alias else w["max_loops"] - w["depth"]
    return {"exits_per_depth": exits, "lower_plane_reads": below, "routed_reads": routed, "direct_tiles": direct,
            "boundary_tiles": boundary, "boundary_last_key": int(last_key), "fill_token_planes": fill,
            "padding_rows": padding, "trace_sha256": trace}
