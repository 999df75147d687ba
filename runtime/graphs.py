"""CUDA Graphs for the engine: one manager (:class:`CudaGraphs`) over one captured graph per padded
decode bucket and one per padded row count of the packed full-prompt prefill loop.

vLLM v1 style: a pure function maps a batch of n rows to its bucket (:func:`bucket_for`); the descriptor
of a step ([DESC_ROWS, bucket] int32: slot, depth, position, first-alias, forced exit) is padded with
``PADDING_ROW`` columns and published into stable device storage before every replay, and replay returns
views of the stable outputs sliced to the n live rows. A bucket not yet captured is captured while the
cache has room (default 16 entries, as in the seed); otherwise the step runs eagerly *on the same padded
shape*, so a fallback computes exactly what a replay would and the token stream never depends on which
steps were captured (BRIEF section 5). Captures, replays and fallbacks are counted in the
``GraphCounters`` each cache is given (fields of the engine's stats).

The buckets cover every batch size up to 128 with 13 entries, so with the default capacity no
``max_num_seqs <= 128`` ever falls back.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch

from .api import GraphCounters
from .descriptors import DESC_ROWS, PADDING_COLUMNS, DescriptorBanks, pinned, unpack_prefill_descriptor

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
      engine is such a cycle: its cache holds its runner's bound ``decode_core``; its graphs, events and pinned banks make
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


class CudaGraphs:
    """The engine's CUDA graphs: the decode core by padded bucket, the packed prefill loop by padded rows.

    Owns the buckets, the static inputs of each graph (allocated on a bucket's first use, then reused),
    the padding of a decode step and the slicing of its outputs. ``decode_fn(slot, depth, pos,
    first_alias, forced)`` takes [bucket] int32 rows and returns (exit [bucket] bool, token [bucket]
    int64, logits [bucket, vocab] or None, triggered [bucket] bool); ``prefill_fn(x, slot, depth, positions,
    tiles)`` takes x [rows, hidden], [rows] int32 rows and [3, num_tiles] int32 query tiles and returns
    (x_out [rows, hidden],). Neither may synchronise with the host.
    """

    def __init__(self, decode_fn: Callable, prefill_fn: Callable, *, max_num_seqs: int, capacity: int,
                 decode_counters: GraphCounters, prefill_counters: GraphCounters, banks: DescriptorBanks,
                 device: torch.device):
        self.max_num_seqs, self.banks, self.device = max_num_seqs, banks, device
        self.decode = GraphCache(decode_fn, capacity, decode_counters)
        self.prefill = GraphCache(prefill_fn, capacity, prefill_counters, name="prefill")
        self._desc: dict[int, torch.Tensor] = {}          # bucket -> [DESC_ROWS, bucket] int32 on device
        self._prefill_inputs: dict[int, tuple] = {}       # rows -> (x [rows, hidden], descriptor int32)

    def bucket(self, n: int) -> int:
        """The padded batch size a decode step of n rows runs on (:func:`bucket_for`)."""
        return bucket_for(n, self.max_num_seqs)

    def run_decode(self, bank: torch.Tensor, host: np.ndarray, n: int) -> tuple:
        """Run the decode core on a descriptor bank ([DESC_ROWS, bucket] int32 host view; ``host`` its numpy
        view, the first n columns written): pads the rest, publishes it into the bucket's static
        descriptor and replays (or captures, or falls back eagerly on the same shape).
        Returns (exit [n] bool, token [n] int64, logits [n, vocab] or None, triggered [n] bool): views of the graph's static outputs,
        valid until the next decode step."""
        bucket = host.shape[1]
        host[:, n:] = PADDING_COLUMNS
        static = self._desc.get(bucket)
        if static is None:
            static = self._desc[bucket] = torch.empty((DESC_ROWS, bucket), dtype=torch.int32, device=self.device)
        outs = self.decode.run(
            bucket, tuple(static), publish=lambda: self.banks.publish(bank, into=static),
            warm_inputs=lambda: static.copy_(torch.from_numpy(PADDING_COLUMNS)))
        return outs if n == bucket else tuple(None if o is None else o[:n] for o in outs)


    def run_prefill(self, xs: list[torch.Tensor], meta: np.ndarray, rows: int) -> torch.Tensor:
        """One packed full-prompt loop through the graph of ``rows`` rows: the prompts' activations ``xs``
        ([T_i, hidden] each, sum T_i <= rows) are copied back to back into the static input, and ``meta``
        (``runner.prefill_descriptor``: per-row slot, depth, position, then the query tiles; int32) is
        published with one async copy. Returns the graph's static output [rows, hidden]: valid until the
        next prefill loop (the caller copies what it keeps)."""
        static = self._prefill_inputs.get(rows)
        if static is None:
            x = torch.zeros((rows, xs[0].shape[1]), dtype=xs[0].dtype, device=self.device)
            desc = torch.zeros(meta.shape[0], dtype=torch.int32, device=self.device)
            static = self._prefill_inputs[rows] = (x, desc)
        x, desc = static
        total = sum(t.shape[0] for t in xs)

        def publish():
            torch.cat(xs, out=x[:total])
            desc.copy_(pinned(meta), non_blocking=True)

        return self.prefill.run(rows, (x, *unpack_prefill_descriptor(desc, rows)), publish, warm_inputs=publish)[0]


def prefill_bucket_for(total: int, gemm_rows: int | None = None) -> int:
    """Smallest entry >= total of the ladder 16, 24, 32, 48, 64, 96, ... (2^k and 1.5 * 2^k): a bounded set
    of packed-prefill graph shapes (two per doubling) that pads a batch of prompts by less than 50%.

    With ``gemm_rows`` (batch-invariant prefill, whose projections run in calls of exactly that many rows)
    the ladder is ``gemm_rows`` x (1, 2, 3, 4, 6, 8, 12, ...), so every bucket is a whole number of calls."""
    if total < 1:
        raise ValueError(f"a packed prefill needs at least one row, got {total}")
    if gemm_rows is not None:
        if gemm_rows < 1:
            raise ValueError(f"gemm_rows must be >= 1, got {gemm_rows}")
        calls = -(-total // gemm_rows)
        return gemm_rows * (prefill_bucket_for(16 * calls) // 16) if calls > 1 else gemm_rows   # 16x: 2, 3, 4, 6, 8, ...
    b = 16
    while True:
        if total <= b:
            return b
        if total <= b + b // 2:
            return b + b // 2
        b *= 2


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
