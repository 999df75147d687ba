"""Programmatic dependent launch (PDL) for the decode loop's Triton kernels: one switch, one capability test.

A kernel launched with CUDA's programmatic stream serialization (Triton's ``launch_pdl=True``) may start
while the kernel before it on the stream is still running, as soon as every program of that kernel has
executed ``griddepcontrol.launch_dependents`` (or exited). It must then execute ``griddepcontrol.wait``
before it touches memory the earlier kernel writes: the wait returns once the earlier grid has completed
and its memory operations are visible (PTX ISA, "griddepcontrol"; CUDA C++ Programming Guide,
"Programmatic Dependent Launch and Synchronization"). Under a CUDA graph capture the stream order
becomes a programmatic graph edge, so replays overlap the same way.

Every PDL kernel of this package follows one pattern, which keeps chains of them safe: ``gdc_wait`` before
its first load of anything the kernel launched right before it writes, and a program releases its dependents
(``gdc_launch_dependents``) only after its own wait; a program that never waits (a GEMM's extra prefetch
programs, ``gemm.GemmConfig.prefetch_programs``) exits without releasing, and every launch has programs that
wait. So when a kernel's programs start, the kernel two launches back has completed and its memory operations
are performed (PTX ISA, "griddepcontrol"). Whether a load issued before the wait sees them is not documented,
though: visibility is promised to a dependent grid only after its own wait. So before its wait a kernel reads
only data that no kernel writes (weights, rotary tables) or that was last written before a full boundary
earlier in the stream: a graph launch, a host-to-device copy, or a kernel launched without PDL that is not its
immediate predecessor (a kernel launched without PDL right before a PDL kernel is that kernel's predecessor
like any other: its writes may not be flushed when the PDL kernel starts). In the decode step that holds for
what is read early: the GEMMs bring their weights into L2; the fused qkv + RoPE + KV write loads its epilogue's
descriptors (published before the graph launch), rotary-table rows and cache pages (block tables, uploaded
before the step); decode attention loads the rows' descriptors, page lookups, exit map and first K/V tile, all
but the key at the row's position, which the step's KV write (its predecessor) writes, every earlier key having
been written by an earlier step (a graph launch, and ``native_fill`` / ``publish_exits`` without PDL, ago).
Where the trigger sits is a schedule choice that changes no value (:data:`TRIGGER`):
``"late"`` after the main loop, before the stores; ``"early"`` right after the wait, so the next kernel's
programs launch, and run the part before their own wait (a GEMM's L2 weight prefetch), while this kernel's
last wave runs. The next kernel launches only once every program of this one has triggered, so its
waiting programs never hold resources that this kernel's later programs need.

What PDL buys: the next kernel's launch, its programs' start-up and their address arithmetic overlap the
previous kernel's tail, which is most of the gap between two short kernels in a graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The process-wide switch (the throughput probe's ``--pdl off``): read when a kernel is launched or
# captured, so a graph captured with PDL keeps it until it is captured again.
ENABLED = True
# Where kernels execute griddepcontrol.launch_dependents: "late" (after their main loop) or "early" (right
# after their wait). Read at launch, like ENABLED (the probe's ``--pdl early|late``).
TRIGGER = "late"
TRIGGERS = ("late", "early")
# The kernels' ``PDL`` constexpr: 0 without PDL, else where the trigger sits.
LATE = tl.constexpr(1)
EARLY = tl.constexpr(2)


def active(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t``'s device launches with PDL: :data:`ENABLED`, a CUDA tensor, an NVIDIA GPU of
    compute capability 9.0 or newer (griddepcontrol needs sm_90; ROCm has no PDL). Never on the CPU, so the
    Triton interpreter never sees the ``griddepcontrol`` instructions."""
    if not (ENABLED and t.is_cuda) or torch.version.hip is not None:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _SM90:
        _SM90[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _SM90[index]


_SM90: dict[int, bool] = {}


def mode(use_pdl: bool, early: bool = False) -> int:
    """The ``PDL`` constexpr of a launch: 0 without PDL, else :data:`LATE` or :data:`EARLY` per
    :data:`TRIGGER`, or :data:`EARLY` whatever it says with ``early`` (one kernel's own choice, e.g.
    ``gemm.GemmConfig.early_trigger``). Raises ValueError for a ``TRIGGER`` outside :data:`TRIGGERS`."""
    if not use_pdl:
        return 0
    if TRIGGER not in TRIGGERS:
        raise ValueError(f"pdl.TRIGGER must be one of {TRIGGERS}, got {TRIGGER!r}")
    return int(EARLY.value if early or TRIGGER == "early" else LATE.value)


@triton.jit
def wait(PDL: tl.constexpr):
    """In a kernel with a ``PDL`` constexpr (:func:`mode`): ``griddepcontrol.wait`` before its first load of
    another kernel's output, then, under the early trigger, the release of its dependents."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release(PDL: tl.constexpr):
    """The late trigger's release of a kernel's dependents, after its main loop and before its stores."""
    if PDL == LATE:
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(use_pdl: bool, **options) -> dict:
    """Triton launch keyword arguments: ``options`` plus ``launch_pdl=True`` when ``use_pdl``."""
    if use_pdl:
        options["launch_pdl"] = True
    return options
