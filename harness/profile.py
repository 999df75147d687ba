"""Where the GPU time of one engine run goes: a torch.profiler trace reduced to a few figures.

The probe (``throughput.py --profile``) runs one measured run under ``torch.profiler`` with the engine's
``runner.decode`` and ``runner.prefill`` wrapped in ``record_function`` ranges (:func:`annotate_runner`),
exports the Chrome trace (Kineto's JSON: ``torch.profiler.profile.export_chrome_trace``) and reads it
back with :func:`load_chrome_trace`. We read the exported JSON rather than ``prof.events()``: the JSON is
written by Kineto in C++ and holds every raw field we need, while ``events()`` builds a Python
``FunctionEvent`` tree (slow for the few hundred thousand kernels of a run with CUDA graphs) and does not
expose correlation ids.

Trace facts used (Kineto's Chrome-trace export, torch 2.11 and 2.13 alike): complete events (``"ph": "X"``)
carry ``cat``, ``name``, ``ts`` and ``dur`` in microseconds, ``tid``; device activity (``"kernel"``,
``"gpu_memcpy"``, ``"gpu_memset"``) and the host call that launched it (``"cuda_runtime"``: cudaLaunchKernel,
cudaGraphLaunch, cudaMemcpyAsync...; ``"cuda_driver"``: cuLaunchKernel, as Triton launches) share
``args.correlation``. A kernel replayed from a CUDA graph is its own kernel event, correlated with the
``cudaGraphLaunch``. A ``record_function`` range is a ``"user_annotation"`` event on the calling thread; the
launch call lies inside it, on the same thread (``tid`` is the system thread id for both).

:func:`summarize` is pure (plain :class:`TraceEvent` records in, a frozen :class:`ProfileSummary` out) and
runs in O(n log n): one sort per category, then linear sweeps. It knows nothing of the engine.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

PART_PREFIX = "loopbench::"
PARTS = ("decode", "prefill")                      # the runner methods wrapped, each a range of its own
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
ANNOTATION_CAT = "user_annotation"
KEPT_CATS = frozenset(DEVICE_CATS + LAUNCH_CATS + (ANNOTATION_CAT,))
_QUALIFIER = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_]\w*)::")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One complete trace event: ``cat`` as Kineto names it, times in microseconds, ``tid`` the host thread
    (or the stream, for device activity), ``correlation`` the id linking device activity to its launch (0: none)."""

    cat: str
    name: str
    ts_us: float
    dur_us: float
    tid: int | str = 0
    correlation: int = 0


@dataclass(frozen=True)
class KernelRow:
    """One distinct kernel (grouped by its full name): launches, summed GPU time, share of the busy time."""

    name: str
    short_name: str
    count: int
    total_ms: float
    mean_us: float
    share_of_busy: float


@dataclass(frozen=True)
class PartRow:
    """GPU kernels attributed to one step part: ``decode``/``prefill`` (launched inside a ``loopbench::`` range
    of that name) or ``other`` (launched anywhere else; ``ranges`` is 0 and ``kernels_per_range`` 0.0)."""

    part: str
    ranges: int
    kernels: int
    kernels_per_range: float
    gpu_s: float                 # summed kernel durations
    share_of_kernel_time: float


@dataclass(frozen=True)
class ProfileSummary:
    """The figures of one profiled run. ``idle_share`` = 1 - kernel_busy_s / wall_s, clamped to [0, 1]; it is
    0.0 when the trace holds no GPU activity (nothing measured: a CPU run) or wall_s is 0."""

    wall_s: float
    kernel_busy_s: float         # union of kernel intervals: overlapping kernels count once
    idle_share: float
    memcpy_busy_s: float
    memset_busy_s: float
    num_kernels: int
    num_memcpy: int
    num_memset: int
    graph_launches: int
    graph_launches_without_kernels: int   # > 0: the profiler missed graph kernels, the figures undercount
    gaps_within_launches_s: float  # idle inside launches: a graph's span minus its kernels' busy time
    parts: tuple[PartRow, ...]
    top_kernels: tuple[KernelRow, ...]

    @property
    def idle_between_launches_share(self) -> float:
        """Idle while no launch was on the GPU (the host had queued nothing): idle minus the gaps between
        the kernels of one graph replay (launch latency inside the graph, set by its kernel count)."""
        if not self.wall_s:
            return 0.0
        return max(0.0, self.idle_share - self.gaps_within_launches_s / self.wall_s)

    @property
    def has_gpu_activity(self) -> bool:
        return self.num_kernels + self.num_memcpy + self.num_memset > 0

    def part(self, name: str) -> PartRow:
        for row in self.parts:
            if row.part == name:
                return row
        raise KeyError(f"no part {name!r}; parts: {[r.part for r in self.parts]}")


# ------------------------------------------------------------------------------------------ reading
def events_from_chrome_trace(doc: Mapping) -> list[TraceEvent]:
    """The complete events of a Chrome-trace document (``{"traceEvents": [...]}``) in the categories
    :func:`summarize` reads; others (cpu ops, flows, metadata) are dropped. TypeError when it is no trace."""
    raw = doc.get("traceEvents") if isinstance(doc, Mapping) else None
    if not isinstance(raw, list):
        raise TypeError(f"not a Chrome trace (no traceEvents list): {type(doc).__name__}")
    out = []
    for e in raw:
        cat = e.get("cat")
        if cat not in KEPT_CATS or e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        out.append(TraceEvent(cat, e.get("name", ""), float(e["ts"]), float(e.get("dur", 0.0)), e.get("tid", 0),
                              int(args.get("correlation", 0) or 0)))
    return out


def load_chrome_trace(path: str | Path) -> list[TraceEvent]:
    """:func:`events_from_chrome_trace` of a trace file written by ``export_chrome_trace``."""
    with open(path) as f:
        return events_from_chrome_trace(json.load(f))


def short_kernel_name(name: str, width: int = 80) -> str:
    """A readable kernel name: no ``void``, no parameter list, no namespace qualifiers, at most ``width`` chars.
    ``void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int, ...)`` ->
    ``vectorized_elementwise_kernel<4, AddFunctor<float>>``."""
    s = name.strip()
    if s.startswith("void "):
        s = s[5:]
    if s.endswith(")"):
        depth = 0
        for i in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[i], 0)
            if depth == 0:
                s = s[:i] if i > 0 else s
                break
    s = " ".join(_QUALIFIER.sub("", s).split())
    return s if len(s) <= width else s[:width - 1] + "…"


# ---------------------------------------------------------------------------------------- analysis
def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: one sort, one sweep."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def _innermost(ranges: Sequence[TraceEvent], launches: Sequence[TraceEvent]) -> dict[int, str]:
    """correlation -> part of the innermost range whose interval holds the launch's start (ranges of one
    thread, well nested). A launch's start, not its end: host and CUPTI clocks can skew by a few ns."""
    ranges = sorted(ranges, key=lambda r: (r.ts_us, -r.dur_us))
    out, stack, i = {}, [], 0
    for ev in sorted(launches, key=lambda e: e.ts_us):
        while i < len(ranges) and ranges[i].ts_us <= ev.ts_us:
            while stack and stack[-1].ts_us + stack[-1].dur_us < ranges[i].ts_us:
                stack.pop()
            stack.append(ranges[i])
            i += 1
        while stack and stack[-1].ts_us + stack[-1].dur_us < ev.ts_us:
            stack.pop()
        if stack and ev.correlation:
            out[ev.correlation] = stack[-1].name[len(PART_PREFIX):]
    return out


def attribute_launches(ranges: Sequence[TraceEvent], launches: Sequence[TraceEvent]) -> dict[int, str]:
    """Which part (``decode``/``prefill``) launched each correlation id, matching a launch with the ranges of
    its own thread; a launch on a thread without any range is matched against the ranges when they all
    come from one thread (a safety net should a torch version number CPU and runtime threads differently)."""
    by_tid: dict = defaultdict(list)
    for r in ranges:
        by_tid[r.tid].append(r)
    out: dict[int, str] = {}
    orphans = []
    launches_by_tid: dict = defaultdict(list)
    for ev in launches:
        (launches_by_tid[ev.tid] if ev.tid in by_tid else orphans).append(ev)
    for tid, evs in launches_by_tid.items():
        out.update(_innermost(by_tid[tid], evs))
    if orphans and ranges and len(by_tid) == 1:
        out.update(_innermost(ranges, orphans))
    return out


def gaps_within_launches_us(kernels: Sequence[TraceEvent]) -> float:
    """Idle time inside launches, microseconds: for the kernels of each launch (one correlation id: one
    graph replay, or one kernel), their GPU span minus the union of their intervals."""
    by_launch: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for k in kernels:
        by_launch[k.correlation].append((k.ts_us, k.ts_us + k.dur_us))
    return sum(max(e for _, e in iv) - min(b for b, _ in iv) - union_us(iv) for iv in by_launch.values())


def _top_kernels(kernels: Sequence[TraceEvent], busy_us: float, top_n: int) -> tuple[KernelRow, ...]:
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for k in kernels:
        count[k.name] += 1
        total[k.name] += k.dur_us
    names = sorted(total, key=lambda n: (-total[n], n))[:top_n]
    return tuple(KernelRow(n, short_kernel_name(n), count[n], total[n] / 1e3, total[n] / count[n],
                           total[n] / busy_us if busy_us > 0 else 0.0) for n in names)


def _parts(kernels: Sequence[TraceEvent], part_of: Mapping[int, str],
           ranges: Sequence[TraceEvent]) -> tuple[PartRow, ...]:
    n_ranges: dict[str, int] = defaultdict(int)
    for r in ranges:
        n_ranges[r.name[len(PART_PREFIX):]] += 1
    n: dict[str, int] = defaultdict(int)
    t: dict[str, float] = defaultdict(float)
    for k in kernels:
        p = part_of.get(k.correlation, "other")
        n[p] += 1
        t[p] += k.dur_us
    all_us = sum(t.values())
    return tuple(PartRow(p, n_ranges[p], n[p], n[p] / n_ranges[p] if n_ranges[p] else 0.0, t[p] / 1e6,
                         t[p] / all_us if all_us > 0 else 0.0) for p in PARTS + ("other",))


def summarize(events: Iterable[TraceEvent], wall_s: float, top_n: int = 15) -> ProfileSummary:
    """The figures of one run from its trace events and its wall time (first submission to drain, seconds).

    Busy times are unions of intervals; part and kernel GPU times are summed durations. Raises ValueError
    for a negative ``wall_s`` or ``top_n``."""
    if not wall_s >= 0:
        raise ValueError(f"wall_s = {wall_s!r} must be >= 0")
    if top_n < 0:
        raise ValueError(f"top_n = {top_n!r} must be >= 0")
    by_cat: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_cat[e.cat].append(e)
    ranges = [r for r in by_cat[ANNOTATION_CAT] if r.name in {PART_PREFIX + p for p in PARTS}]
    launches = [e for c in LAUNCH_CATS for e in by_cat[c]]
    part_of = attribute_launches(ranges, launches)
    kernels = by_cat["kernel"]
    busy_us = union_us((k.ts_us, k.ts_us + k.dur_us) for k in kernels)
    device_corr = {e.correlation for c in DEVICE_CATS for e in by_cat[c]}
    graphs = [e for e in launches if "GraphLaunch" in e.name]
    n_gpu = sum(len(by_cat[c]) for c in DEVICE_CATS)
    idle = min(1.0, max(0.0, 1.0 - busy_us / 1e6 / wall_s)) if wall_s > 0 and n_gpu else 0.0
    return ProfileSummary(
        wall_s=wall_s, kernel_busy_s=busy_us / 1e6, idle_share=idle,
        memcpy_busy_s=union_us((e.ts_us, e.ts_us + e.dur_us) for e in by_cat["gpu_memcpy"]) / 1e6,
        memset_busy_s=union_us((e.ts_us, e.ts_us + e.dur_us) for e in by_cat["gpu_memset"]) / 1e6,
        num_kernels=len(kernels), num_memcpy=len(by_cat["gpu_memcpy"]), num_memset=len(by_cat["gpu_memset"]),
        graph_launches=len(graphs),
        graph_launches_without_kernels=sum(1 for g in graphs if g.correlation not in device_corr),
        gaps_within_launches_s=gaps_within_launches_us(kernels) / 1e6,
        parts=_parts(kernels, part_of, ranges), top_kernels=_top_kernels(kernels, busy_us, top_n))


# --------------------------------------------------------------------------------------- rendering
def figure_lines(s: ProfileSummary) -> list[str]:
    """The main figures of one profiled run as short sentences (printed by the probe, bullets in the report)."""
    d, p, o = s.part("decode"), s.part("prefill"), s.part("other")
    lines = [f"wall {s.wall_s:.3f} s (first submission to drain, profiler on)"]
    if not s.has_gpu_activity:
        lines.append("no GPU kernels in the trace (a CPU run): no GPU busy or idle time to report")
    else:
        lines += [f"GPU kernel-busy {s.kernel_busy_s * 1e3:.1f} ms (union of {s.num_kernels:,} kernel intervals); "
                  f"GPU idle {s.idle_share:.1%} of wall: {s.gaps_within_launches_s / s.wall_s if s.wall_s else 0:.1%} "
                  f"between the kernels of one launch, {s.idle_between_launches_share:.1%} with no launch on the GPU",
                  f"memcpy busy {s.memcpy_busy_s * 1e3:.2f} ms ({s.num_memcpy:,} copies); "
                  f"memset busy {s.memset_busy_s * 1e3:.2f} ms ({s.num_memset:,})",
                  f"GPU kernel time: decode {d.gpu_s * 1e3:.1f} ms ({d.share_of_kernel_time:.1%}), prefill "
                  f"{p.gpu_s * 1e3:.1f} ms ({p.share_of_kernel_time:.1%}), other {o.gpu_s * 1e3:.1f} ms "
                  f"({o.share_of_kernel_time:.1%})"]
    lines.append(f"kernels per decode step {d.kernels_per_range:.1f} ({d.ranges:,} steps); per prefill call "
                 f"{p.kernels_per_range:.1f} ({p.ranges:,} calls); other kernels {o.kernels:,}")
    if s.has_gpu_activity and d.ranges and not d.kernels:
        lines.append("WARNING: no kernel was attributed to a decode range (launches not found inside the ranges)")
    if s.graph_launches_without_kernels:
        lines.append(f"WARNING: {s.graph_launches_without_kernels:,} of {s.graph_launches:,} CUDA graph launches have "
                     "no kernel records: the profiler missed graph kernels, GPU figures undercount")
    return lines


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, params: Mapping[str, object], s: ProfileSummary) -> str:
    """One report section: the run parameters, the figures, the GPU time by part and the top kernels."""
    out = [f"## {title}", "", "| parameter | value |", "|---|---|"]
    out += [f"| {_cell(k)} | {_cell(v)} |" for k, v in params.items()]
    out += ["", *(f"- {line}" for line in figure_lines(s)), "",
            "| part | ranges | kernels | kernels per range | GPU ms | share of kernel time |",
            "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {r.part} | {r.ranges:,} | {r.kernels:,} | {r.kernels_per_range:.1f} | {r.gpu_s * 1e3:.2f} | "
            f"{r.share_of_kernel_time:.1%} |" for r in s.parts]
    out.append("")
    if not s.top_kernels:
        return "\n".join(out + ["No kernels recorded: no top-kernels table.", ""])
    out += [f"Top {len(s.top_kernels)} kernels by GPU time (share of the kernel-busy time):", "",
            "| # | kernel | count | total ms | mean us | share of busy |", "|---:|---|---:|---:|---:|---:|"]
    out += [f"| {i} | `{_cell(k.short_name)}` | {k.count:,} | {k.total_ms:.2f} | {k.mean_us:.1f} | "
            f"{k.share_of_busy:.1%} |" for i, k in enumerate(s.top_kernels, 1)]
    return "\n".join(out + [""])


Section = tuple[str, Mapping[str, object], ProfileSummary]      # (title, run parameters, summary)


def write_report(path: str | Path, sections: Sequence[Section]) -> tuple[Path, Path]:
    """Write the sections as markdown to ``path`` (must end in ``.md``, ValueError otherwise) and as JSON beside
    it (``path`` with ``.json``: ``{"sections": [{"title", "params", "summary"}]}``); returns both paths."""
    md = Path(path)
    if md.suffix != ".md":
        raise ValueError(f"profile report path {str(path)!r} must end in .md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("# loopbench profile\n\n" + "\n".join(render_markdown(*sec) for sec in sections))
    js = md.with_suffix(".json")
    doc = {"sections": [{"title": t, "params": dict(p), "summary": asdict(s)} for t, p, s in sections]}
    js.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return md, js


# ------------------------------------------------------------------------------- torch.profiler side
def _ranged(fn: Callable, name: str) -> Callable:
    import torch

    def ranged(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return ranged


@contextmanager
def annotate_runner(runner) -> Iterator[None]:
    """Wrap this ``runner`` instance's ``decode`` and ``prefill`` in ``record_function("loopbench::<part>")``
    ranges (instance attributes: other engines are untouched), restored on exit. AttributeError naming
    the method when the runner has none."""
    fns = {p: getattr(runner, p) for p in PARTS}
    own = {p: vars(runner)[p] for p in PARTS if p in vars(runner)}
    for p in PARTS:
        setattr(runner, p, _ranged(fns[p], PART_PREFIX + p))
    try:
        yield
    finally:
        for p in PARTS:
            if p in own:
                setattr(runner, p, own[p])
            else:
                delattr(runner, p)


def profile_call(fn: Callable[[], object], trace_path: str | Path) -> tuple[object, list[TraceEvent]]:
    """Run ``fn()`` under ``torch.profiler`` (CPU, plus CUDA when available), export the Chrome trace to
    ``trace_path`` and return ``(fn's result, the trace's events)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        result = fn()
    prof.export_chrome_trace(str(trace_path))
    return result, load_chrome_trace(trace_path)
