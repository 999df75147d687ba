"""Per-point workloads: a point may set its own prompt_len (P) and output_len (D), so one plan sweeps context.

A point without them runs the plan's ``workload`` (its prompts are the first C of the workload's pool, as
always). A point with its own ``prompt_len`` runs seeded prompts of exactly P tokens: for each distinct P
(in point order) the pool gets one block of ``max C`` prompts of that length, appended after the workload's
own prompts, prompt j of the block drawn by the contract's ``documents.plan.prompt_rule`` seeded
``[workload.prompt_seed, P]`` (format 15; formats up to 14 drew the block from numpy's
``default_rng([workload.prompt_seed, P])``, whose stream numpy does not promise across its versions); the point's
requests take the first C of its block (``plan.json`` ``points[].requests[].prompt_index``). Every stage
after the plan (reference capture, checker, tokens/s, reports) reads the point's D from
``points[].output_len`` and its prompts from those indices.

Point keys stay ``B<B>C<C>`` for a point on the plan's workload, and gain ``P<P>`` / ``D<D>`` for the
values it sets itself (``B16C16P2048``), so a sweep of one B / C over contexts has distinct keys.
"""
from __future__ import annotations

from . import draws
from .spec import BenchSpec, PointSpec


def output_len(spec: BenchSpec, pt: PointSpec) -> int:
    """D of ``pt``: its own output_len, else the workload's."""
    return pt.output_len if pt.output_len is not None else spec.workload.output_len


def workload_requests(spec: BenchSpec) -> int:
    """How many prompts the workload's own pool needs: the largest C of the points on it (0 when none is)."""
    return max((pt.num_requests for pt in spec.points if pt.prompt_len is None), default=0)


def prompt_offsets(spec: BenchSpec) -> dict[int | None, int]:
    """Where each prompt length's block starts in the pool: None (the workload's prompts) at 0, then one
    block per distinct point prompt_len, in point order, of the largest C among its points."""
    offsets: dict[int | None, int] = {None: 0}
    at = workload_requests(spec)
    for p in dict.fromkeys(pt.prompt_len for pt in spec.points if pt.prompt_len is not None):
        offsets[p] = at
        at += max(pt.num_requests for pt in spec.points if pt.prompt_len == p)
    return offsets


def point_prompts(spec: BenchSpec, vocab_size: int) -> list[list[int]]:
    """The blocks of per-point prompt lengths (appended to the workload's pool), in :func:`prompt_offsets` order."""
    out: list[list[int]] = []
    for p in prompt_offsets(spec):
        if p is None:
            continue
        n = max(pt.num_requests for pt in spec.points if pt.prompt_len == p)
        out += [draws.prompt_tokens([spec.workload.prompt_seed, p], j, p, vocab_size) for j in range(n)]
    return out


def longest_request(spec: BenchSpec, workload_longest: int) -> int:
    """Positions the longest request of any point needs (P + D - 1; ``spec.max_model_len``'s rule), with
    ``workload_longest`` the longest prompt of the workload's own pool (0 when no point uses it)."""
    need = [(workload_longest if pt.prompt_len is None else pt.prompt_len) + output_len(spec, pt) - 1
            for pt in spec.points]
    return max(need)


def check_points_fit(spec: BenchSpec, positions: int, workload_longest: int) -> None:
    """ValueError naming the first point whose P + D - 1 positions exceed the model's ``positions``."""
    for i, pt in enumerate(spec.points):
        p = workload_longest if pt.prompt_len is None else pt.prompt_len
        need = p + output_len(spec, pt) - 1
        if need > positions:
            raise ValueError(f"points[{i}] ({pt.key}): prompt {p} + output {output_len(spec, pt)} - 1 = {need} "
                             f"positions exceed the model's max_position_embeddings={positions}")
