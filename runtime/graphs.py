"""CUDA Graphs for the recurrent core: one captured loop per padded batch bucket.

A pure function maps a batch of n rows to its bucket (:func:`bucket_for`); the descriptor of a step
([4, bucket] int32: slot, depth, position, first-alias) sits in stable device storage that is refreshed
before every replay, and replay returns sliced views of stable outputs. A bucket not yet captured is
captured while the cache has room (default 16 entries, as in the seed); otherwise the step runs eagerly
*on the same padded shape*, so a fallback computes exactly what a replay would and the token stream
never depends on which steps were captured (BRIEF section 5). Captures, replays and fallbacks are
counted in the ``GraphCounters`` the cache is given (a field of the engine's stats).

The buckets cover every batch size up to 128 with 13 entries, so with the default capacity no
``max_num_seqs <= 128`` ever falls back.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable

import torch

from .api import GraphCounters

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)


def bucket_for(n: int, max_num_seqs: int) -> int:
    """Smallest padded batch size >= n: a BUCKETS entry below max_num_seqs, else max_num_seqs itself."""
    if not 1 <= n <= max_num_seqs:
        raise ValueError(f"batch of {n} rows outside 1..max_num_seqs={max_num_seqs}")
    for b in BUCKETS:
        if n <= b < max_num_seqs:
            return b
    return max_num_seqs


class GraphCaptureError(RuntimeError):
    """A CUDA-graph capture failed. The partial graph was discarded and the device synchronised, and the
    cache holds what it held before, so the process stays usable; the engine that asked is not."""


class GraphCache:
    """Captured graphs of ``fn(*static_inputs) -> tuple of tensors`` keyed by bucket.

    ``fn`` must not synchronise with the host. Before a capture it runs once eagerly, on the stream the
    capture will use, on inputs that must leave live state unchanged (padding rows, or inputs whose writes
    the replay repeats identically); the capture then records exactly that call on the same tensors.

    What a capture must never do, and how this class keeps it so. While a capture is open CUDA refuses
    calls that may synchronise or load code (module loads, synchronous copies, event or stream queries,
    from any thread of the process in torch's default "global" mode), and the refused call invalidates the
    capture: "operation not permitted when stream is capturing", then "operation failed due to a previous
    error during capture".

    - compile or load a kernel: the warm-up launches every kernel of ``fn`` with the same arguments as the
      capture (same static tensors, same shapes and strides, so the same Triton specialisations: integer
      arguments equal to 1 or divisible by 16, pointer alignment, None arguments), and ``fn`` has no
      host-side branch on tensor values. That is checked, not assumed: during the capture a Triton kernel
      that misses its in-memory cache raises before it would compile, naming the kernel;
    - initialise per-stream library state (cuBLAS keeps a workspace per handle and stream): the warm-up
      runs on the capture stream itself, not on a stream of its own;
    - run a finaliser: Python's cyclic collector may free objects that own CUDA resources (an earlier
      engine is such a cycle: its cache holds its bound ``_core``; its graphs, events and pinned banks make
      CUDA calls when destroyed), and torch no longer collects before a capture; the collector is paused
      for the capture.

    ``cuda`` is the namespace the CUDA calls go through (``torch.cuda``); tests pass a fake.
    """

    def __init__(self, fn: Callable, capacity: int, counters: GraphCounters, *, name: str = "decode",
                 cuda=torch.cuda):
        self.fn, self.capacity, self.counters, self.name, self.cuda = fn, capacity, counters, name, cuda
        self.graphs: dict[int, tuple[object, tuple]] = {}
        self.pool = cuda.graph_pool_handle()
        self.stream = None                       # the capture stream, made on the first capture

    def run(self, bucket: int, static_inputs: tuple, publish: Callable[[], None],
            warm_inputs: Callable[[], None] | None = None) -> tuple:
        """Run ``fn`` on ``static_inputs`` (the same tensors for every call with this bucket).

        ``publish()`` writes this step's inputs into the static tensors; it is called right before the
        replay (or eager fallback). On a capture, ``fn`` first runs once eagerly on the inputs that
        ``warm_inputs()`` writes (padding that touches no live state), then is captured, then replayed.
        Raises :class:`GraphCaptureError` (naming the bucket and the cause) if the capture fails.
        """
        hit = self.graphs.get(bucket)
        if hit is not None:
            publish()
            hit[0].replay()
            self.counters.replays += 1
            return hit[1]
        if len(self.graphs) >= self.capacity:
            publish()
            self.counters.fallbacks += 1
            return self.fn(*static_inputs)
        (warm_inputs or publish)()
        graph, outputs = self._warm_and_capture(bucket, static_inputs)
        self.graphs[bucket] = (graph, outputs)
        self.counters.captures += 1
        publish()
        graph.replay()
        return outputs

    def _warm_and_capture(self, bucket: int, static_inputs: tuple) -> tuple[object, tuple]:
        cuda = self.cuda
        if self.stream is None:
            self.stream = cuda.Stream()
        self.stream.wait_stream(cuda.current_stream())
        with cuda.stream(self.stream):
            self.fn(*static_inputs)              # compile, load and initialise outside the capture
        cuda.current_stream().wait_stream(self.stream)
        graph = cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with refuse_kernel_compiles(f"the capture of {self.name} graph bucket {bucket}"), \
                    cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = self.fn(*static_inputs)
        except Exception as err:
            del graph
            self.stream = None                   # a stream whose capture failed is not reused
            cause = f"{type(err).__name__}: {err}"
            if err.__context__ is not None:      # e.g. capture_end's error while the first one unwound
                cause += f" (raised while handling {type(err.__context__).__name__}: {err.__context__})"
            try:
                cuda.synchronize()
            except Exception as sync_err:        # a sticky device error: report it with the first cause
                cause += f"; synchronising afterwards failed too: {sync_err}"
            raise GraphCaptureError(f"CUDA-graph capture of {self.name} graph bucket {bucket} failed: {cause}. "
                                    f"The partial graph was discarded; nothing was replayed") from err
        finally:
            if collecting:
                gc.enable()
        return graph, outputs


class KernelCompileInCapture(RuntimeError):
    """A Triton kernel would have been compiled (or loaded) inside a CUDA-graph capture."""


@contextmanager
def refuse_kernel_compiles(where: str):
    """Inside the block, a Triton launch that misses the in-memory kernel cache raises
    :class:`KernelCompileInCapture` naming the kernel and its specialisation, before anything is
    compiled or loaded (a module load inside a capture would invalidate it). A no-op where Triton or its
    ``knobs.runtime.jit_cache_hook`` is absent; restores any hook that was set before."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield
        return

    def refuse(*args, **kwargs):
        kernel = kwargs.get("repr") or (args[0] if args else "?")
        raise KernelCompileInCapture(f"Triton kernel {kernel} was about to be compiled during {where}: the "
                                     f"warm-up before the capture did not launch this specialisation")

    runtime.jit_cache_hook = refuse
    try:
        yield
    finally:
        runtime.jit_cache_hook = previous
