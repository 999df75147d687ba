"""GraphCache on the CPU, through a fake ``torch.cuda``: the warm-up and the capture run the same call on
the capture stream, a capture runs with the cyclic collector paused and Triton compiles refused, and a
failed capture raises a GraphCaptureError naming the bucket and the cause, discards the graph,
synchronises, and leaves the cache as it was (the next capture works). The real thing on a GPU, with a
cold Triton cache, is in test_gpu_runtime.py."""
from __future__ import annotations

import gc
from contextlib import contextmanager
import pytest

from loopbench.runtime.api import GraphCounters
from loopbench.runtime.graphs import GraphCache, GraphCaptureError, bucket_for, refuse_kernel_compiles


class FakeCuda:
    """The few torch.cuda calls GraphCache makes, recording what happened and in which state."""

    def __init__(self):
        self.log: list[str] = []
        self.capturing = False
        self.current = None             # the stream set by ``stream(...)`` / ``graph(..., stream=...)``
        self.streams_made = 0

    def graph_pool_handle(self):
        return ("pool",)

    def Stream(self):  # noqa: N802 (torch.cuda's name)
        self.streams_made += 1
        return FakeStream(self.streams_made)

    def current_stream(self):
        return self.current or FakeStream(0)

    @contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def CUDAGraph(self):  # noqa: N802
        return FakeGraph(self)

    @contextmanager
    def graph(self, g, pool=None, stream=None):
        assert pool == ("pool",)
        before, self.current = self.current, stream
        self.capturing = True
        self.log.append("capture_begin")
        try:
            yield
        finally:
            self.capturing = False
            self.current = before
            self.log.append("capture_end")

    def synchronize(self):
        self.log.append("synchronize")


class FakeStream:
    def __init__(self, ident):
        self.ident = ident

    def wait_stream(self, other):
        pass


class FakeGraph:
    def __init__(self, cuda):
        self.cuda = cuda

    def replay(self):
        self.cuda.log.append("replay")


class Core:
    """A stand-in for the engine's device step: records each call's stream, capture state and whether
    the collector was running; ``fail`` makes the captured call raise, ``compile_in_capture`` makes it
    behave like a Triton launch that misses its kernel cache."""

    def __init__(self, cuda):
        self.cuda, self.calls, self.fail, self.compile_in_capture = cuda, [], None, False

    def __call__(self, x):
        c = self.cuda
        self.calls.append(dict(capturing=c.capturing, stream=getattr(c.current, "ident", 0), gc=gc.isenabled()))
        if c.capturing and self.fail is not None:
            raise self.fail
        if c.capturing and self.compile_in_capture:
            from triton import knobs
            hook = knobs.runtime.jit_cache_hook       # what JITFunction._do_compile calls before compiling
            if hook is not None:
                hook(key="k", repr="_fake_kernel[num_warps=4](n: i32)", fn=None, compile={},
                     is_manual_warmup=False, already_compiled=False)
        return (x,)


def make_cache(capacity=4):
    cuda = FakeCuda()
    core = Core(cuda)
    stats = GraphCounters()
    return GraphCache(core, capacity, stats, cuda=cuda), core, cuda, stats


def test_capture_warms_on_the_capture_stream_then_replays():
    cache, core, cuda, stats = make_cache()
    published = []
    out = cache.run(4, ("x",), publish=lambda: published.append("real"), warm_inputs=lambda: published.append("pad"))
    assert out == ("x",)
    warm, captured = core.calls
    assert not warm["capturing"] and captured["capturing"]
    assert warm["stream"] == captured["stream"] != 0, "the warm-up must run on the capture stream"
    assert captured["gc"] is False and gc.isenabled(), "collector paused for the capture only"
    assert published == ["pad", "real"] and cuda.log == ["capture_begin", "capture_end", "replay"]
    assert (stats.captures, stats.replays) == (1, 0)
    cache.run(4, ("x",), publish=lambda: published.append("real"))
    assert (stats.captures, stats.replays, len(core.calls)) == (1, 1, 2)


def test_failed_capture_raises_names_bucket_and_cause_and_leaves_the_cache_usable():
    cache, core, cuda, stats = make_cache()
    core.fail = RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(GraphCaptureError, match=r"graph bucket 8 failed: RuntimeError: operation not permitted"):
        cache.run(8, ("x",), publish=lambda: None)
    assert cache.graphs == {} and stats.captures == 0, "a failed capture must not be cached or counted"
    assert cuda.log[-2:] == ["capture_end", "synchronize"], "the capture is closed, then the device synchronised"
    assert "replay" not in cuda.log and gc.isenabled()
    core.fail = None                              # the cache works again, on a fresh capture stream
    assert cache.run(8, ("x",), publish=lambda: None) == ("x",)
    assert stats.captures == 1 and cuda.streams_made == 2


def test_a_kernel_compile_inside_a_capture_is_refused_by_name():
    pytest.importorskip("triton")
    from triton import knobs
    cache, core, cuda, stats = make_cache()
    core.compile_in_capture = True
    before = knobs.runtime.jit_cache_hook
    with pytest.raises(GraphCaptureError, match=r"_fake_kernel.*was about to be compiled during the capture of "
                                                r"decode graph bucket 2"):
        cache.run(2, ("x",), publish=lambda: None)
    assert knobs.runtime.jit_cache_hook is before, "the previous hook must be restored"
    core.compile_in_capture = False
    cache.run(2, ("x",), publish=lambda: None)
    assert stats.captures == 1


def test_refuse_kernel_compiles_restores_a_hook_that_was_set():
    pytest.importorskip("triton")
    from triton import knobs
    seen = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["repr"])
    try:
        with refuse_kernel_compiles("a test"):
            with pytest.raises(RuntimeError, match="kernel k0 was about to be compiled during a test"):
                knobs.runtime.jit_cache_hook(repr="k0")
        knobs.runtime.jit_cache_hook(repr="k1")
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert seen == ["k1"]


def test_bucket_for_pads_to_the_smallest_bucket():
    assert [bucket_for(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket_for(20, 20) == 20
    with pytest.raises(ValueError, match="batch of 0 rows"):
        bucket_for(0, 8)
