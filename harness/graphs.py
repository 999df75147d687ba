"""CUDA Graphs for the recurrent core: one captured loop per padded batch bucket.

A pure function maps a batch of n rows to its bucket (:func:`bucket_for`); the descriptor of a step
([4, bucket] int32: slot, depth, position, first-alias) sits in stable device storage that is refreshed
before every replay, and replay returns sliced views of stable outputs. A bucket not yet captured is
captured while the cache has room (default 16 entries, as in the seed); otherwise the step runs eagerly
*on the same padded shape*, so a fallback computes exactly what a replay would and the token stream
never depends on which steps were captured (BRIEF section 5). Captures, replays and fallbacks are
counted on the engine's stats.

The buckets cover every batch size up to 128 with 13 entries, so with the default capacity no
``max_num_seqs <= 128`` ever falls back.
"""
from __future__ import annotations

from typing import Callable

import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)


def bucket_for(n: int, max_num_seqs: int) -> int:
    """Smallest padded batch size >= n: a BUCKETS entry below max_num_seqs, else max_num_seqs itself."""
    if not 1 <= n <= max_num_seqs:
        raise ValueError(f"batch of {n} rows outside 1..max_num_seqs={max_num_seqs}")
    for b in BUCKETS:
        if n <= b < max_num_seqs:
            return b
    return max_num_seqs


class GraphCache:
    """Captured graphs of ``fn(*static_inputs) -> tuple of tensors`` keyed by bucket.

    ``fn`` must not synchronise with the host. Before a capture it runs once eagerly (to compile kernels
    and warm libraries) on inputs that must leave live state unchanged: padding rows, or inputs whose
    writes the replay repeats identically.
    """

    def __init__(self, fn: Callable, capacity: int, stats, *, prefix: str = "graph"):
        self.fn, self.capacity, self.stats, self.prefix = fn, capacity, stats, prefix
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _count(self, what: str) -> None:
        name = f"{self.prefix}_{what}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    def run(self, bucket: int, static_inputs: tuple, publish: Callable[[], None],
            warm_inputs: Callable[[], None] | None = None) -> tuple:
        """Run ``fn`` on ``static_inputs`` (the same tensors for every call with this bucket).

        ``publish()`` writes this step's inputs into the static tensors; it is called right before the
        replay (or eager fallback). On a capture, ``fn`` first runs once eagerly on the inputs that
        ``warm_inputs()`` writes (padding that touches no live state), then is captured, then replayed.
        """
        hit = self.graphs.get(bucket)
        if hit is not None:
            publish()
            hit[0].replay()
            self._count("replays")
            return hit[1]
        if len(self.graphs) >= self.capacity:
            publish()
            self._count("fallbacks")
            return self.fn(*static_inputs)
        (warm_inputs or publish)()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*static_inputs)                  # compile / warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*static_inputs)
        self.graphs[bucket] = (graph, outputs)
        self._count("captures")
        publish()
        graph.replay()
        return outputs
