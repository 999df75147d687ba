"""Quick single-arm throughput probe, not the paired benchmark.

One natural ``ouro_delayed`` run is captured as a schedule; then the timed policy runs the same requests:
``--policy replay`` (the default) an engine replaying that schedule, ``natural`` a fresh natural engine,
``both`` the two alternating per repeat, with their throughput ratio at the end. Each policy's engine has
one warmup, then the timed runs, each printed as tokens/s, ms per engine step and that run's own work and
graph counters. Every run must reproduce the captured tokens and exit depths; a run that does not is
printed and the probe exits 1. ``--profile PATH.md`` adds one measured run per timed policy under
torch.profiler and writes where its GPU time goes (harness/profile.py) to PATH.md and PATH.json.
For iterating on the runtime; published figures come from ``make bench`` and its audited bundle. On a
machine without CUDA it runs the torch backend on the CPU (slowly), on ``--cpu-threads`` torch threads (1, as a
measured CPU session), and warns on stderr when the machine is busier than its cores.

    python -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs 16 --num-requests 32
    python -m loopbench.harness.throughput --preset ouro-1.4b --policy both --profile /tmp/profile-b16.md

``--gemm-config ROLE.FIELD=VALUE`` (repeatable) changes one field of one projection's small-M GEMM configuration
(kernels/gemm.py, kernels/qkv_rope.py) for the probe's process, so that configurations are compared in the
decode loop itself rather than in an isolated microbenchmark, e.g.
``--gemm-config gate_up.num_stages=3 --gemm-config swiglu.prefetch_tiles=4``; ``ROLE.faster_up_to=0`` sends that
role to cuBLAS. The profile report records the overrides. ``--prefetch-next TARGET=FRACTION,...`` turns on the
model's cross-kernel L2 prefetch (OuroModel.prefetch_next); a GEMM configuration whose ``prefetch_programs`` the
plan gives no region is refused (exit 2, runtime/model.py check_prefetch_programs) before any weight loads.
``--attention-config KNOB=VALUE,...`` sets the Triton decode attention's tuning knobs (block_n, min_split_tokens,
maxnreg, ...). ``--variant OPTIONS`` (repeatable) is a sweep: one model load, per variant its own schedule and replay
engine, the variants timed alternately, a table at the end::

    python -m loopbench.harness.throughput --preset ouro-1.4b --repeats 3 --variant "" \
        --variant "--gemm-config swiglu.num_stages=3" --variant "--prefetch-next gate_up=0.5,down=0.5"

``--telemetry on`` runs the NVML sampler of the measured arms (harness/sampler.py) around every timed run;
``--telemetry ab`` measures what it costs: each repeat times the replay twice, sampler off and on in
alternating order, and prints the median tokens/s ratio on / off and the sampler thread's CPU time per
sample (run it with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so that the CUDA and the NVML index agree).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from loopbench.runtime.api import EngineConfig, EngineStats, Request
from loopbench.runtime.checkpoint import load_checkpoint, read_config
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import (PREFETCH_TARGETS, PRESETS, OuroConfig, OuroModel, check_prefetch_next,
                                     check_prefetch_programs, gemm_roles)
from loopbench.runtime.schedule import Schedule, ScheduleMismatchError

from .fixtures import config_of, write_calibrated_checkpoint
from .identity import code_identity
from .machine import busy_cpu_warning, cpu_name, visible_gpus
from .profile import annotate_runner, figure_lines, profile_call, summarize, write_report
from .records import ArmSpec
from .sampler import Sampler
from .spec import max_model_len

EXIT_POLICY = {"natural": "ouro_delayed", "replay": "replay"}
POLICIES = {"replay": ("replay",), "natural": ("natural",), "both": ("natural", "replay")}


def _at_least(lowest: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lowest``, else an error naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value
    return parse


_at_least_one, _at_least_zero = _at_least(1), _at_least(0)


def _markdown_path(text: str) -> Path:
    if not text.endswith(".md"):
        raise argparse.ArgumentTypeError(f"{text!r} does not end in .md (the JSON goes beside it)")
    return Path(text)


# --gemm-config's roles: the projection a GEMM configuration table entry serves; runtime/model.py gemm_roles says
# which table each lives in and under which weight shape (named here to parse the option before any model shape is
# known). The fused loop runs qkv_rope and swiglu where they have a configuration for the rows, and the plain qkv /
# gate_up entries (then RoPE or SwiGLU as separate launches) only where they do not.
GEMM_ROLES = ("qkv", "o_proj", "gate_up", "down", "lm_head", "swiglu", "qkv_rope")


def gemm_fields() -> dict[str, bool]:
    """The GemmConfig fields ``--gemm-config`` may set, name -> whether it is a bool (kernels are imported
    lazily, as everywhere in the probe)."""
    from loopbench.kernels.gemm import GemmConfig
    return {f.name: f.type in ("bool", bool) for f in dataclasses.fields(GemmConfig)}


def _flag(name: str, raw: str) -> bool:
    """``true``/``false``/``1``/``0`` (any case) -> bool; an argparse error names ``name`` and the value."""
    if raw.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{name} must be true or false, got {raw!r}")
    return raw.lower() in ("true", "1")


def _gemm_override(text: str) -> tuple[str, str, int | bool]:
    """``ROLE.FIELD=VALUE`` -> (role, field, value); an argparse error names the bad part."""
    key, sep, raw = text.partition("=")
    role, dot, field = key.partition(".")
    if not (sep and dot):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROLE.FIELD=VALUE (e.g. gate_up.num_stages=3)")
    if role not in GEMM_ROLES:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown role {role!r} (one of {', '.join(GEMM_ROLES)})")
    fields = gemm_fields()
    if field not in fields and field != "faster_up_to":
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown field {field!r} (one of {', '.join(fields)}, faster_up_to)")
    if field == "early_epilogue" and role != "qkv_rope":
        raise argparse.ArgumentTypeError(f"{text!r}: only qkv_rope's epilogue has inputs to load early")
    if fields.get(field):
        try:
            return role, field, _flag(field, raw)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {field} must be an integer, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: {field} must be >= 0, got {value}")
    return role, field, value


# The projections the fused loop can run on kernels/wgmma_gemm.py: the plain o_proj and down (where gemm.gemm would
# run) and gate_up + SwiGLU (where gemm.gemm_swiglu would); qkv and gate_up run fused (qkv_rope, swiglu) at its rows.
WGMMA_ROLES = ("o_proj", "down", "swiglu")


def _wgmma_override(text: str) -> tuple[str, tuple[tuple[str, int | bool], ...]]:
    """``ROLE:FIELD=VALUE,...`` -> (role, ((field, value), ...)) over kernels/wgmma_gemm.py WgmmaConfig's fields
    (``wgmma_gemm.parse_overrides``); an argparse error names the bad part, also a SwiGLU split or a pipeline that
    does not fit at ``wgmma_gemm.MAX_M`` rows."""
    from loopbench.kernels import wgmma_gemm
    role, _, rest = text.partition(":")
    if role not in WGMMA_ROLES:
        raise argparse.ArgumentTypeError(f"{text!r}: role {role!r} is not one of {', '.join(WGMMA_ROLES)} "
                                         "(ROLE:FIELD=INT,... e.g. o_proj:pre=4,early_trigger=1)")
    try:
        items = wgmma_gemm.parse_overrides(rest)
        c = wgmma_gemm.WgmmaConfig(**items)
        if role == "swiglu" and c.split_k != 1:
            raise ValueError(f"SwiGLU needs whole sums: split_k must be 1, got {c.split_k}")
        c.check_fits(wgmma_gemm.MAX_M, glu=role == "swiglu")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return role, tuple(items.items())


def _prefetch_next(text: str) -> dict[str, float]:
    """``TARGET=FRACTION,...`` -> {target: fraction}; an argparse error names the bad part."""
    plans = []
    for item in text.split(","):
        target, sep, raw = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            plans.append({target.strip(): float(raw)})
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not TARGET=FRACTION (e.g. gate_up=0.5)") from None
    try:
        return check_prefetch_next(_merge_plans(plans))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _merge_plans(plans: list[dict[str, float]]) -> dict[str, float] | None:
    """Several --prefetch-next plans as one (None: none given); ValueError names a target given twice."""
    merged: dict[str, float] = {}
    for plan in plans:
        for target, fraction in plan.items():
            if target in merged:
                raise ValueError(f"target {target!r} given twice ({merged[target]:g} and {fraction:g})")
            merged[target] = fraction
    return merged if plans else None


@dataclass(frozen=True)
class Variant:
    """One ``--variant``: kernel options applied, in this order, over the probe's own for that variant's runs."""

    label: str
    prefetch_tiles: int | None = None
    gemm_config: tuple[tuple[str, str, int | bool], ...] = ()
    prefetch_next: dict[str, float] | None = None
    attention_config: dict[str, int | bool] | None = None
    greedy_from_logits: bool | None = None
    norm_in_gemm: bool | None = None
    mlp_ring: bool | None = None
    wgmma: tuple[tuple[str, tuple[tuple[str, int | bool], ...]], ...] = ()
    no_wgmma: bool | None = None
    prefill_stream: str | None = None


class _VariantParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise argparse.ArgumentTypeError(message)


def _variant(text: str) -> Variant:
    """``--variant "--gemm-config swiglu.num_stages=3 --prefetch-next gate_up=0.5"`` -> Variant; an argparse
    error names the bad option. ``""`` is the probe's own configuration."""
    ap = _VariantParser(prog="--variant", add_help=False)
    add_kernel_options(ap)
    try:
        ns = ap.parse_args(shlex.split(text))
        plan = _merge_plans(ns.prefetch_next)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return Variant(text.strip() or "as configured", ns.prefetch_tiles, tuple(ns.gemm_config), plan,
                   ns.attention_config, ns.greedy_from_logits, ns.norm_in_gemm, ns.mlp_ring, tuple(ns.wgmma),
                   ns.no_wgmma, ns.prefill_stream)


def attention_knobs() -> dict[str, type]:
    """The Triton decode attention's tuning knobs (the keyword-only parameters of
    kernels/decode_attention.decode_attention), name -> bool or int."""
    from loopbench.kernels import decode_attention as da
    params = inspect.signature(da.decode_attention).parameters.values()
    return {p.name: bool if isinstance(p.default, bool) else int for p in params if p.kind is p.KEYWORD_ONLY}


def _attention_config(text: str) -> dict[str, int | bool]:
    """``KNOB=VALUE,...`` -> {knob: value}, checked by the kernel's own ``check_knobs``; an argparse error
    names the bad part."""
    from loopbench.kernels import decode_attention as da
    knobs, config = attention_knobs(), {}
    for item in text.split(","):
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or name not in knobs:
            raise argparse.ArgumentTypeError(f"{item!r} is not KNOB=VALUE with KNOB one of {', '.join(knobs)}")
        if name in config:
            raise argparse.ArgumentTypeError(f"knob {name!r} given twice")
        if knobs[name] is bool:
            config[name] = _flag(name, raw)
        else:
            try:
                config[name] = int(raw)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be an integer, got {raw!r}") from None
    try:
        da.check_knobs(**config)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return config


def with_attention_config(engine: LoopEngine, config: dict[str, int | bool] | None) -> LoopEngine:
    """``engine`` whose Triton decode attention runs with ``config``'s knobs (before its first step, so its graphs
    are captured with them). Raises ValueError for another attention backend."""
    if config:
        backend = engine.runner.backend
        if backend.name != "triton":
            raise ValueError(f"--attention-config needs the triton attention backend, got {backend.name!r}")
        engine.runner.backend = dataclasses.replace(
            backend, decode_attention=functools.partial(backend.decode_attention, **config))
    return engine


def add_kernel_options(ap: argparse.ArgumentParser) -> None:
    """The probe's per-configuration kernel options, which ``--variant`` takes too (process-wide switches such
    as ``--pdl`` stay with the probe)."""
    ap.add_argument("--prefetch-tiles", type=_at_least_zero, default=None, metavar="TILES",
                    help="GemmConfig.prefetch_tiles of every small-M GEMM configuration: weight K tiles each "
                         "program prefetches into L2 before its PDL wait (default: as configured; the projections "
                         "on kernels/wgmma_gemm.py copy WgmmaConfig.pre tiles into shared memory instead)")
    ap.add_argument("--gemm-config", type=_gemm_override, action="append", default=[], metavar="ROLE.FIELD=VALUE",
                    help="override one field of one projection's small-M GEMM configuration for this probe, e.g. "
                         "gate_up.num_stages=3 or qkv_rope.faster_up_to=128 (repeatable; applied after "
                         "--prefetch-tiles). ROLE: " + ", ".join(GEMM_ROLES) + "; FIELD: a GemmConfig field ("
                         + ", ".join(gemm_fields()) + ") or faster_up_to (the most rows it runs at)")
    ap.add_argument("--prefetch-next", type=_prefetch_next, action="append", default=[], metavar="TARGET=FRACTION,...",
                    help="cross-kernel L2 prefetch (OuroModel.prefetch_next; off by default): e.g. "
                         "gate_up=0.5,down=0.25 makes o_proj's programs bring the first half of the K columns "
                         "of gate_up's weight into L2 before their PDL wait, and gate_up's a quarter of down's. "
                         "TARGET: " + ", ".join(PREFETCH_TARGETS) + " (each prefetched by the projection before it)")
    ap.add_argument("--greedy-from-logits", action="store_true", default=None,
                    help="decode writes lm_head's logits and samples from them (OuroModel.greedy_tiles off) "
                         "instead of from lm_head's per-tile maxima: the same tokens, the A/B of that fusion")
    ap.add_argument("--wgmma", type=_wgmma_override, action="append", default=[], metavar="ROLE:FIELD=INT,...",
                    help="run one projection on kernels/wgmma_gemm.py (weight tiles into shared memory before the PDL "
                         "wait) with these WgmmaConfig fields over its defaults, split_k defaulting to the role's "
                         "gemm.CONFIGS split, where the model would run gemm.gemm (o_proj, down) or gemm.gemm_swiglu "
                         "(swiglu) at up to 64 rows (repeatable). ROLE: " + ", ".join(WGMMA_ROLES))
    ap.add_argument("--no-wgmma", action="store_true", default=None,
                    help="empty kernels/wgmma_gemm.py's tables before any --wgmma: every projection on kernels/gemm.py "
                         "(the same bits; the A/B of the shared-memory weight copies before the PDL wait)")
    ap.add_argument("--norm-in-gemm", action="store_true", default=None,
                    help="o_proj and down run the norm step after them in their own launch (OuroModel.norm_in_gemm, "
                         "kernels/gemm_norm.py; off by default): one kernel fewer after each, where they run on our "
                         "split-K GEMM")
    ap.add_argument("--mlp-ring", action="store_true", default=None,
                    help="the layer half after attention (o_proj, norm, gate_up + SwiGLU, down, norm) as one "
                         "persistent launch whose weight ring runs across its grid barriers (kernels/mlp_ring.py; "
                         "off by default) at up to 64 rows, the norm kernels at its warps elsewhere; prefill loops "
                         "then share the decode stream")
    ap.add_argument("--prefill-stream", default=None, choices=["on", "off"],
                    help="EngineConfig.prefill_stream: a step's prefill loop on a second CUDA stream, concurrent with "
                         "its decode loop (on, EngineConfig's default), or on the decode loop's stream (off)")
    ap.add_argument("--attention-config", type=_attention_config, default=None, metavar="KNOB=VALUE,...",
                    help="the Triton decode attention's tuning knobs for this probe (kernels/decode_attention.py "
                         "decode_attention's keyword-only parameters), e.g. block_n=64,min_split_tokens=128")


def _variant_values_joined(argv: list[str]) -> list[str]:
    """``--variant OPTIONS`` as ``--variant=OPTIONS``: argparse would take a value that looks like one option
    (``--variant --greedy-from-logits``) for an option of the probe's own and report --variant's value missing."""
    out, it = [], iter(argv)
    for a in it:
        value = next(it, None) if a == "--variant" else None
        out.append(a if value is None else f"--variant={value}")      # a trailing --variant: argparse's error
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The probe's options; a bad value is an argparse error (exit 2) naming it, before anything runs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = os.path.join(os.path.expanduser(os.environ.get("LOOPBENCH_CACHE", "~/.cache/loopbench")), "checkpoints")
    # No abbreviations: "--var X" would be --variant without _variant_values_joined's care, and an abbreviation
    # can come to mean another option when one is added.
    ap = argparse.ArgumentParser(prog="python3 -m loopbench.harness.throughput", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                    help="synthetic model preset (default: %(default)s)")
    ap.add_argument("--checkpoint", default=None,
                    help="HF checkpoint directory (overrides --preset; it must hold config.json: a wrong path is an "
                         "error, never a synthetic model written there)")
    ap.add_argument("--cache", default=cache, help="where synthetic checkpoints are written and reused")
    ap.add_argument("--cpu-threads", type=_at_least_one, default=1, metavar="N",
                    help="torch intra-op threads on the CPU, as a measured CPU session's executor.cpu_threads "
                         "(default: %(default)s); CUDA runs leave torch's own count")
    ap.add_argument("--max-num-seqs", type=_at_least_one, default=16, help="B: batch capacity (default: %(default)s)")
    ap.add_argument("--num-requests", type=_at_least_one, default=32,
                    help="C: requests submitted at once (default: %(default)s)")
    ap.add_argument("--prompt-len", type=_at_least_one, default=128,
                    help="P: prompt tokens (seeded random ids) (default: %(default)s)")
    ap.add_argument("--output-len", type=_at_least_one, default=128,
                    help="D: output tokens per request (default: %(default)s)")
    ap.add_argument("--layout", default="native", choices=["native", "alias", "alias_prefix"],
                    help="KV layout (default: %(default)s)")
    ap.add_argument("--backend", default="triton" if device == "cuda" else "torch", choices=["torch", "triton"],
                    help="attention backend (default: triton on CUDA, torch on the CPU)")
    ap.add_argument("--no-graphs", action="store_true", help="run eagerly (graphs need CUDA and triton)")
    ap.add_argument("--batch-invariant", default="on", choices=["on", "off"],
                    help="EngineConfig.batch_invariant: decode on max_num_seqs rows, prefill projections in "
                         "fixed-size calls (on), or on padded buckets (off)")
    ap.add_argument("--prefill-gemm-rows", type=_at_least_one, default=None, metavar="ROWS",
                    help="EngineConfig.prefill_gemm_rows: rows per batch-invariant prefill projection call "
                         "(default: EngineConfig.prefill_call_rows, by max_model_len)")
    ap.add_argument("--prefill-gemm", default="cublas", choices=["cublas", "ours"],
                    help="batch-invariant prefill projections as cuBLAS calls of exactly --prefill-gemm-rows rows, or "
                         "each in one launch of kernels/prefill_gemm.py (OuroModel.prefill_gemm; CUDA, fused loop)")
    ap.add_argument("--gemm", default="ours", choices=["cublas", "ours"],
                    help="decode projections on our small-M GEMM where it was measured faster, cuBLAS for the "
                         "rest (kernels/gemm.py; CUDA; the runtime's default), or all on cuBLAS")
    ap.add_argument("--pdl", default="on", choices=["on", "off", "late", "early"],
                    help="programmatic dependent launch of our Triton kernels (kernels/pdl.py; sm_90+ only): on "
                         "(with the default trigger), off, or on with the trigger late or early (pdl.TRIGGER)")
    ap.add_argument("--norm-trigger", default="late", choices=["late", "early"],
                    help="where the decode loop's residual norm kernels release their dependents "
                         "(kernels/fused_ops.py NORM_TRIGGER): after their loads (late) or right after their PDL wait "
                         "(early), so the next projection's programs start during the norm")
    add_kernel_options(ap)
    ap.add_argument("--variant", type=_variant, action="append", default=[], metavar="OPTIONS",
                    help="sweep mode (repeatable): time each variant's replay in one process, one model load, "
                         "each variant with its own captured schedule and engine, the variants alternating "
                         "within a repeat; OPTIONS: any of --prefetch-tiles, --gemm-config, --prefetch-next, "
                         "--attention-config, --greedy-from-logits, --norm-in-gemm, --wgmma, --no-wgmma "
                         "(quoted; \"\" is the probe's own configuration). Ends with each variant's median tok/s "
                         "and its ratio to the first")
    ap.add_argument("--repeats", type=_at_least_one, default=3,
                    help="timed runs per policy after the warmup (default: %(default)s)")
    ap.add_argument("--policy", default="replay", choices=sorted(POLICIES),
                    help="what is timed: the schedule's replay, the natural ouro_delayed engine, or both alternating "
                         "(default: %(default)s)")
    ap.add_argument("--profile", type=_markdown_path, default=None, metavar="PATH.md",
                    help="after the timed runs, one more run per policy under torch.profiler; "
                         "the report goes to PATH.md and PATH.json")
    ap.add_argument("--profile-top", type=_at_least_one, default=15, metavar="N", help="kernels in the report's table")
    ap.add_argument("--telemetry", default="off", choices=["off", "on", "ab"],
                    help="NVML sampler around each timed run: off, on, or ab (alternating off/on: its cost)")
    ap.add_argument("--sample-hz", type=float, default=20.0, help="the sampler's rate (as telemetry.sample_hz)")
    ap.add_argument("--trace", type=Path, default=None, metavar="PATH",
                    help="keep the profiler's Chrome trace here (with --policy both: PATH's stem + .natural/.replay)")
    args = ap.parse_args(_variant_values_joined(sys.argv[1:] if argv is None else list(argv)))
    if args.trace is not None and args.profile is None:
        ap.error(f"--trace {str(args.trace)!r} needs --profile (the trace is of the profiled run)")
    try:
        args.prefetch_next = _merge_plans(args.prefetch_next)
    except ValueError as e:
        ap.error(f"argument --prefetch-next: {e}")
    if (args.attention_config or any(v.attention_config for v in args.variant)) and args.backend != "triton":
        ap.error(f"--attention-config needs --backend triton, got {args.backend}")
    if args.variant and (args.policy != "replay" or args.profile or args.telemetry != "off"):
        ap.error(f"--variant times replays only, without --profile or --telemetry (got --policy {args.policy}"
                 f"{', --profile' if args.profile else ''}{', --telemetry ' + args.telemetry if args.telemetry != 'off' else ''})")
    return args


def kernel_tables() -> tuple[dict, ...]:
    """The module tables the model reads at every launch: the GEMM configurations (kernels/gemm.py CONFIGS,
    SWIGLU_CONFIGS; kernels/qkv_rope.py CONFIGS), then their FASTER_UP_TO tables, then kernels/wgmma_gemm.py
    CONFIGS and SWIGLU_CONFIGS, then kernels/mlp_ring.py CONFIGS."""
    from loopbench.kernels import gemm, mlp_ring, qkv_rope, wgmma_gemm
    return (gemm.CONFIGS, gemm.SWIGLU_CONFIGS, qkv_rope.CONFIGS,
            gemm.FASTER_UP_TO, gemm.SWIGLU_FASTER_UP_TO, qkv_rope.FASTER_UP_TO, wgmma_gemm.CONFIGS,
            wgmma_gemm.SWIGLU_CONFIGS, mlp_ring.CONFIGS)


def snapshot_tables() -> list[dict]:
    return [dict(t) for t in kernel_tables()]


def load_tables(snapshot: list[dict]) -> None:
    for table, old in zip(kernel_tables(), snapshot):
        table.clear()
        table.update(old)


def set_prefetch_tiles(tiles: int | None) -> None:
    """``--prefetch-tiles``: GemmConfig.prefetch_tiles of every configuration (None: as configured)."""
    if tiles is not None:
        for table in kernel_tables()[:3]:
            for shape, c in table.items():
                table[shape] = dataclasses.replace(c, prefetch_tiles=tiles)


def apply_kernel_options(args: argparse.Namespace) -> Callable[[], None]:
    """``--pdl`` and ``--prefetch-tiles``: process-wide kernel switches, set before any kernel is launched or
    captured (kernels/pdl.ENABLED and TRIGGER; the prefetch in the GEMM configuration tables the model reads).
    Returns the function that puts the previous values back (:func:`main` calls it when it ends, so a later probe in
    the same process starts from the defaults)."""
    from loopbench.kernels import fused_ops, pdl
    saved_enabled, saved_trigger, saved_tables = pdl.ENABLED, pdl.TRIGGER, snapshot_tables()
    saved_norm = fused_ops.NORM_TRIGGER

    def restore() -> None:
        pdl.ENABLED, pdl.TRIGGER, fused_ops.NORM_TRIGGER = saved_enabled, saved_trigger, saved_norm
        load_tables(saved_tables)

    mode = getattr(args, "pdl", "on")
    pdl.ENABLED = mode != "off"
    if mode in pdl.TRIGGERS:
        pdl.TRIGGER = mode
    fused_ops.NORM_TRIGGER = getattr(args, "norm_trigger", "late")
    set_prefetch_tiles(getattr(args, "prefetch_tiles", None))
    return restore


def apply_wgmma(cfg: OuroConfig | None, overrides: list[tuple[str, tuple[tuple[str, int | bool], ...]]],
                clear: bool = False, gemm_overrides: list[tuple[str, str, int | bool]] = ()) -> None:
    """``--no-wgmma`` (``clear``): empty kernels/wgmma_gemm.py's tables. A ``--gemm-config`` field of o_proj, down or
    swiglu (``gemm_overrides``; not ``faster_up_to``, which decides where either kernel runs) asks for kernels/gemm.py's
    kernel with that field, so that role leaves the wgmma tables: otherwise the field would change nothing at the
    rows wgmma runs. Then ``--wgmma``: put a WgmmaConfig for each role's weight shape (``cfg``) into its table, its
    split_k the role's gemm.CONFIGS split unless given (swiglu: ``SWIGLU_CONFIGS``, split_k 1).
    :func:`apply_kernel_options`' restore puts the tables back. ValueError naming a role given to both options."""
    from loopbench.kernels import gemm, wgmma_gemm
    if clear:
        wgmma_gemm.CONFIGS.clear()
        wgmma_gemm.SWIGLU_CONFIGS.clear()
    if not (overrides or gemm_overrides):
        return
    roles = gemm_roles(cfg)

    def table(role: str) -> dict:
        return wgmma_gemm.SWIGLU_CONFIGS if role == "swiglu" else wgmma_gemm.CONFIGS

    to_gemm = {role for role, field, _ in gemm_overrides if role in WGMMA_ROLES and field != "faster_up_to"}
    both = sorted(to_gemm & {role for role, _ in overrides})
    if both:
        raise ValueError(f"--gemm-config {both[0]}.* and --wgmma {both[0]}:... both given: one kernel runs {both[0]}")
    for role in to_gemm:
        table(role).pop(roles[role].shape, None)
    for role, items in overrides:
        shape = roles[role].shape
        base = gemm.CONFIGS.get(shape) if role != "swiglu" else None
        table(role)[shape] = wgmma_gemm.WgmmaConfig(**{"split_k": base.split_k if base else 1, **dict(items)})


def apply_gemm_overrides(cfg: OuroConfig | None, overrides: list[tuple[str, str, int | bool]]) -> None:
    """``--gemm-config``: replace one field of a role's configuration (or its FASTER_UP_TO) for this model's
    weight shapes (``cfg``), in the tables the model reads at every launch; :func:`apply_kernel_options`' restore
    puts them back. Raises ValueError naming the role and shape that has no configuration (that projection runs
    on cuBLAS), or the field GemmConfig refuses; :func:`main` applies them before any weight is loaded."""
    if not overrides:
        return
    from loopbench.kernels import gemm, qkv_rope
    roles = gemm_roles(cfg)
    for role, field, value in overrides:
        configs, faster, shape = roles[role].configs, roles[role].faster_up_to, roles[role].shape
        if shape not in configs:
            raise ValueError(f"--gemm-config {role}.{field}: no {role} configuration for weight shape {shape} "
                             f"(it runs on cuBLAS; configured shapes: {sorted(configs)})")
        if field == "faster_up_to":
            faster[shape] = value
            continue
        try:
            configs[shape] = c = dataclasses.replace(configs[shape], **{field: value})
            if role == "qkv_rope":      # the launchers' own checks, so a refusal comes before anything runs
                qkv_rope.check_config(c, cfg.head_dim)
            elif role == "swiglu":
                gemm.check_swiglu_config(c)
        except ValueError as e:
            raise ValueError(f"--gemm-config {role}.{field}={value}: {e}") from None


def model_config(args: argparse.Namespace) -> OuroConfig:
    """The probe's model shape without loading weights: ``--checkpoint``'s config.json, else ``--preset``'s.
    Raises ValueError (CheckpointError for a bad checkpoint) naming the bad folder, file, key or preset."""
    return read_config(args.checkpoint) if args.checkpoint else config_of(args.preset)


def load(args: argparse.Namespace, device: str, max_len: int) -> OuroModel:
    """The checkpoint (``--checkpoint``, else --preset's synthetic one, written once into ``--cache``) as a model:
    bf16 on CUDA, fp32 on the CPU. A ``--checkpoint`` is only read (main checks it before anything runs)."""
    path = Path(args.checkpoint) if args.checkpoint else Path(args.cache) / f"{args.preset}-seed0-bfloat16-calibrated"
    if not args.checkpoint and not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_calibrated_checkpoint(path, args.preset, seed=0, dtype=torch.bfloat16, device=device)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f}s")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg, tensors = load_checkpoint(path, dtype=dtype)  # a release may mix dtypes (fp32 norms): cast on load
    model = OuroModel.from_tensors(cfg, tensors, device=device, dtype=dtype, rope_len=max_len,
                                   small_m_gemm=getattr(args, "gemm", "ours") == "ours",
                                   prefetch_next=getattr(args, "prefetch_next", None))
    model.greedy_tiles = not getattr(args, "greedy_from_logits", None)
    model.norm_in_gemm = bool(getattr(args, "norm_in_gemm", None))
    model.prefill_gemm = getattr(args, "prefill_gemm", "cublas") == "ours"
    if getattr(args, "mlp_ring", None):
        ring_on(cfg)
    asked = getattr(args, "prefetch_next", None) or any(v.prefetch_next for v in getattr(args, "variant", []))
    if asked and not prefetch_applies(model):
        print(f"note: --prefetch-next changes nothing in this run ({PREFETCH_IDLE})", file=sys.stderr)
    return model


def make_requests(vocab_size: int, args: argparse.Namespace) -> list[Request]:
    """C seeded random prompts of P tokens, D output tokens each, the seed's delayed gate 0.5/min2/max4."""
    g = torch.Generator().manual_seed(0)
    return [Request(f"r{i}", torch.randint(0, vocab_size, (args.prompt_len,), generator=g).tolist(),
                    args.output_len, min_loops=2, max_loops=4, exit_threshold=0.5)
            for i in range(args.num_requests)]


def arm_spec(args: argparse.Namespace, device: str) -> ArmSpec:
    return ArmSpec(kv_layout="alias" if args.layout != "native" else "native",
                   prefix_tiles=args.layout == "alias_prefix",
                   attention_backend=args.backend,
                   cuda_graphs=not args.no_graphs and device == "cuda" and args.backend == "triton")


@dataclass(frozen=True)
class TimedRun:
    """One run from first submission to drain: wall seconds, output tokens and the engine's counters of it."""

    policy: str
    label: str
    elapsed_s: float
    tokens: int
    three_loop_share: float
    delta: EngineStats
    sampler: dict | None = None     # Sampler.record() when the sampler ran around this run

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        d = self.delta
        return (f"{self.policy} {self.label}: {self.elapsed_s:.3f}s {self.tokens_per_s:.1f} tok/s  "
                f"{self.elapsed_s / max(1, d.steps) * 1e3:.2f} ms/step  three-loop share {self.three_loop_share:.3f}  "
                f"this run: {d.work()} decode graphs {d.decode_graphs}"
                + (f"  sampler {self.sampler['samples']} samples, {self.sampler['cpu_s'] * 1e3:.2f} ms CPU"
                   if self.sampler else ""))


class PolicyEngine:
    """One timed policy's engine, run again and again on the probe's requests (``reset_run`` between)."""

    def __init__(self, policy: str, engine: LoopEngine, schedule: Schedule):
        self.policy, self.engine, self.schedule, self.runs = policy, engine, schedule, 0

    def run(self, reqs: list[Request], label: str, sample_hz: float | None = None) -> TimedRun:
        """One timed run; ScheduleMismatchError (naming policy and run) when its tokens or exit depths differ
        from the captured schedule. Nothing but submission, stepping and the final sync is timed; with
        ``sample_hz`` the NVML sampler runs from before the first submission to after the drain, as in a
        measured arm."""
        eng, cuda = self.engine, self.engine.model.device.type == "cuda"
        if self.runs:
            eng.reset_run()
        self.runs += 1
        before = eng.stats.copy()
        if cuda:
            torch.cuda.synchronize()
        sampler = Sampler(gpu_index(), sample_hz).start() if sample_hz else None
        t0 = time.perf_counter()
        for r in reqs:
            eng.add_request(r)
        outs = eng.run()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if sampler is not None:
            sampler.stop()
        try:
            self.schedule.verify(outs)
        except ScheduleMismatchError as e:
            raise ScheduleMismatchError(
                f"the {self.policy} {label} does not reproduce the captured schedule: {e}") from e
        exits = [e for o in outs.values() for e in o.exit_depths[1:]]
        return TimedRun(self.policy, label, elapsed, sum(len(o.token_ids) for o in outs.values()),
                        exits.count(3) / max(1, len(exits)), eng.stats.minus(before),
                        None if sampler is None else sampler.record())


def gpu_index() -> int | None:
    """The NVML index of the probe's GPU: the first of CUDA_VISIBLE_DEVICES, else CUDA's current device."""
    if not torch.cuda.is_available():
        return None
    return (visible_gpus() or [torch.cuda.current_device()])[0]


def engine_config(arm: ArmSpec, args: argparse.Namespace, max_len: int, policy: str,
                  schedule: Schedule | None = None, prefill_stream: str | None = None) -> EngineConfig:
    """The arm's EngineConfig at the probe's B, with ``--batch-invariant``, ``--prefill-gemm-rows`` and
    ``--prefill-stream`` (``prefill_stream``, a variant's, over the probe's) applied."""
    cfg = arm.engine_config(args.max_num_seqs, max_len, policy, schedule)
    stream = prefill_stream or getattr(args, "prefill_stream", None)
    return dataclasses.replace(cfg, batch_invariant=args.batch_invariant == "on",
                               prefill_gemm_rows=getattr(args, "prefill_gemm_rows", None) or cfg.prefill_gemm_rows,
                               prefill_stream=cfg.prefill_stream if stream is None else stream == "on")


def capture(model: OuroModel, arm: ArmSpec, args: argparse.Namespace, max_len: int, reqs: list[Request],
            attention_config: dict | None = None, prefill_stream: str | None = None) -> Schedule:
    """One natural ouro_delayed run of the requests, frozen as the schedule every timed run must reproduce;
    ``attention_config``: the decode attention's knobs (default ``--attention-config``); ``prefill_stream``: a
    variant's ``--prefill-stream`` (default the probe's)."""
    natural = with_attention_config(LoopEngine(model, engine_config(arm, args, max_len, "ouro_delayed",
                                                                    prefill_stream=prefill_stream)),
                                    attention_config or getattr(args, "attention_config", None))
    for r in reqs:
        natural.add_request(r)
    natural.run()
    return natural.capture_schedule()


def time_telemetry_ab(pe: PolicyEngine, reqs: list[Request], repeats: int, hz: float) -> dict[str, list[TimedRun]]:
    """The sampler's cost: after a warmup, each repeat times the engine with the sampler off and on, their
    order alternating over repeats; prints the median tokens/s ratio on / off and CPU seconds per sample."""
    print(pe.run(reqs, "warmup").line(), flush=True)
    timed: dict[str, list[TimedRun]] = {"off": [], "on": []}
    for i in range(1, repeats + 1):
        for mode in (("off", "on") if i % 2 else ("on", "off")):
            run = pe.run(reqs, f"run {i} telemetry {mode}", hz if mode == "on" else None)
            print(run.line(), flush=True)
            timed[mode].append(run)
    med = {m: statistics.median(r.tokens_per_s for r in runs) for m, runs in timed.items()}
    per_sample = [r.sampler["cpu_s"] / r.sampler["samples"] for r in timed["on"] if r.sampler and r.sampler["samples"]]
    cost = f"{statistics.median(per_sample) * 1e6:.1f} us CPU per sample" if per_sample else "no NVML: nothing sampled"
    print(f"telemetry on/off throughput ratio {med['on'] / med['off']:.4f}x (median tok/s {med['on']:.1f} / "
          f"{med['off']:.1f} over {repeats} alternating repeats at {hz:g} Hz); sampler {cost}")
    return timed


def time_policies(engines: dict[str, PolicyEngine], reqs: list[Request], repeats: int,
                  sample_hz: float | None = None) -> dict[str, list[TimedRun]]:
    """A warmup per engine, then ``repeats`` timed runs per engine, the policies alternating within a repeat."""
    timed: dict[str, list[TimedRun]] = {p: [] for p in engines}
    for i in range(repeats + 1):
        for p, pe in engines.items():
            run = pe.run(reqs, f"run {i}" if i else "warmup", sample_hz)
            print(run.line(), flush=True)
            if i:
                timed[p].append(run)
    return timed


def print_medians(timed: dict[str, list[TimedRun]]) -> dict[str, float]:
    """Median tokens/s per policy (and natural/replay when both ran); returns the medians."""
    med = {p: statistics.median(r.tokens_per_s for r in runs) for p, runs in timed.items()}
    for p, v in med.items():
        print(f"median {p}: {v:.1f} tok/s over {len(timed[p])} timed runs")
    if {"natural", "replay"} <= med.keys() and med["replay"] > 0:
        print(f"natural/replay throughput ratio {med['natural'] / med['replay']:.3f}x "
              f"(median tok/s {med['natural']:.1f} / {med['replay']:.1f})")
    return med


def _versions() -> dict[str, str]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": device, "torch": torch.__version__, "triton": triton_version}


def run_params(args: argparse.Namespace, arm: ArmSpec, run: TimedRun, identity: dict,
               timed: list[TimedRun], model: OuroModel) -> dict[str, object]:
    """The report's parameter table for one profiled run; ``timed`` are its policy's unprofiled runs, whose median
    wall says how much the profiler itself slowed the profiled run."""
    from loopbench.kernels import pdl
    return {"preset": args.checkpoint or args.preset, "B": args.max_num_seqs, "C": args.num_requests,
            "P": args.prompt_len, "D": args.output_len, "layout": args.layout, "backend": args.backend,
            "policy": run.policy, "graphs": arm.cuda_graphs, "batch_invariant": args.batch_invariant,
            "prefill_gemm_rows": getattr(args, "prefill_gemm_rows", None) or "auto",
            "prefill_gemm": "ours" if model.prefill_gemm_on() else "cublas",
            "prefill_stream": engine_config(arm, args, 1, "fixed").prefill_stream,
            "gemm": getattr(args, "gemm", "ours"), "pdl": getattr(args, "pdl", "on"),
            "pdl_trigger": pdl.TRIGGER if pdl.ENABLED else None,
            "prefetch_tiles": "as configured" if getattr(args, "prefetch_tiles", None) is None else args.prefetch_tiles,
            "prefetch_next": _prefetch_record(model),
            "greedy_tiles": _greedy_record(model, args),
            "norm_in_gemm": _norm_record(model, args),
            "attention_config": ",".join(f"{k}={v}" for k, v in (getattr(args, "attention_config", None) or {}).items())
                                or "as configured",
            "gemm_config": " ".join(f"{r}.{f}={v}" for r, f, v in getattr(args, "gemm_config", [])) or "as configured",
            "norm_trigger": getattr(args, "norm_trigger", "late"),
            "mlp_ring": "on" if model.ring_on() else "off",
            "cpu_threads": getattr(args, "cpu_threads", 1) if model.device.type == "cpu" else "not pinned (CUDA)",
            "wgmma": _wgmma_record(model, args),
            "git_sha": identity.get("git_sha") or "unknown", "git_sha_source": identity.get("git_sha_source"),
            "tokens": run.tokens, "tokens_per_s": round(run.tokens_per_s, 1),
            "unprofiled_median_wall_s": round(statistics.median(r.elapsed_s for r in timed), 4),
            "engine_steps": run.delta.steps,
            "decode_steps": run.delta.decode_steps}


PREFETCH_IDLE = "it needs our small-M GEMM with PDL on an sm_90 GPU"


def prefetch_applies(model: OuroModel) -> bool:
    """Whether the model's projections can prefetch (OuroModel.prefetch_next): our small-M GEMM runs
    (``model.small_m_gemm``: CUDA sm_90, not ``--gemm cublas``) and PDL is on (the prefetch precedes the wait)."""
    from loopbench.kernels import pdl
    return model.small_m_gemm and pdl.ENABLED


def _greedy_record(model: OuroModel, args: argparse.Namespace) -> str:
    """Whether decode sampled from lm_head's per-tile maxima (OuroModel.greedy_partials) in this run: "on", or
    "off" with why (``--greedy-from-logits``; or lm_head not on our GEMM at max_num_seqs rows, or not the
    Triton backend, where the step samples from logits whatever the switch says)."""
    if not model.greedy_tiles:
        return "off"
    runs = args.backend == "triton" and model.greedy_tiles_config(args.max_num_seqs) is not None
    return "on" if runs else "off (lm_head on cuBLAS at these rows, or the torch backend)"


def _projections(model: OuroModel, rows: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """o_proj, gate_up + SwiGLU ("swiglu") and down of layer 0 as the fused loop launches them at ``rows`` rows:
    (name, rows [rows, K] on the meta device, weight, the L2 region it is asked to prefetch or None)."""
    w, cfg = model.layers[0], model.cfg
    return [(name, torch.empty(rows, k, dtype=model.dtype, device="meta"), weight, region)
            for name, weight, k, region in (
                ("o_proj", w.o, cfg.num_attention_heads * cfg.head_dim, model._prefetch_region("gate_up", w.gate_up)),
                ("swiglu", w.gate_up, cfg.hidden_size, model._prefetch_region("down", w.down)),
                ("down", w.down, cfg.intermediate_size, model._prefetch_region("qkv", w.qkv)))]


def _wgmma_record(model: OuroModel, args: argparse.Namespace) -> str:
    """Which projections ran on kernels/wgmma_gemm.py at max_num_seqs rows, as the model decides it
    (``OuroModel.wgmma_config``, with this run's tables and prefetch plan, the norm step in o_proj / down taking
    precedence), with their configurations; "off" where none did."""
    ran = []
    for name, a, weight, nxt in _projections(model, args.max_num_seqs):
        glu = name == "swiglu"
        wc = model.wgmma_config(a, weight, None, nxt, swiglu=glu)
        if wc is not None and (glu or model.norm_gemm_config(a, weight, None, nxt) is None):
            ran.append(f"{name} ({wc})")
    return ", ".join(ran) or "off"


def _norm_record(model: OuroModel, args: argparse.Namespace) -> str:
    """Where o_proj and down ran their norm step in their own launch (OuroModel.norm_in_gemm) at max_num_seqs rows,
    as the model decides it (``norm_gemm_config``, with this run's GEMM tables and prefetch plan): "on", "o_proj
    only", "down only", or "off" (with why where the switch is on)."""
    if not model.norm_in_gemm:
        return "off"
    fused = [name for name, a, weight, nxt in _projections(model, args.max_num_seqs)
             if name != "swiglu" and model.norm_gemm_config(a, weight, None, nxt)]
    if len(fused) == 2:
        return "on"
    return f"{fused[0]} only" if fused else "off (neither runs on a split-K pointer GEMM that fits here)"


def _prefetch_record(model: OuroModel) -> str:
    """What --prefetch-next did in this run: the plan, or "off" with why where no kernel could prefetch."""
    if not model.prefetch_next:
        return "off"
    if not prefetch_applies(model):
        return f"off ({PREFETCH_IDLE})"
    return ",".join(f"{t}={f:g}" for t, f in model.prefetch_next.items())


def _trace_path(args: argparse.Namespace, policy: str, tmp: str) -> Path:
    if args.trace is None:
        return Path(tmp) / f"trace-{policy}.json"
    if len(POLICIES[args.policy]) == 1:
        return args.trace
    return args.trace.with_name(f"{args.trace.stem}.{policy}{args.trace.suffix or '.json'}")


def profile_policies(engines: dict[str, PolicyEngine], reqs: list[Request], args: argparse.Namespace,
                     arm: ArmSpec, identity: dict, timed: dict[str, list[TimedRun]]) -> None:
    """One more measured run per engine under torch.profiler, decode/prefill ranged; the report to args.profile."""
    sections, kept = [], []
    with tempfile.TemporaryDirectory(prefix="loopbench-trace-") as tmp:
        for p, pe in engines.items():
            trace = _trace_path(args, p, tmp)
            trace.parent.mkdir(parents=True, exist_ok=True)
            with annotate_runner(pe.engine.runner):
                run, events = profile_call(lambda: pe.run(reqs, "profiled run"), trace)
            summary = summarize(events, run.elapsed_s, args.profile_top)
            if args.trace is None:
                trace.unlink()                  # a run with CUDA graphs leaves a trace of some hundred MB
            else:
                kept.append(str(trace))
            print(run.line())
            for line in figure_lines(summary):
                print(f"  {line}")
            title = f"{p}: one measured run under torch.profiler"
            sections.append((title, run_params(args, arm, run, identity, timed[p], pe.engine.model), summary))
            del events
    md, js = write_report(args.profile, sections)
    print(f"profile written to {md} and {js}" + (f"; traces kept: {', '.join(kept)}" if kept else ""))


def pin_cpu_threads(device: str, threads: int) -> Callable[[], None]:
    """On the CPU, torch's intra-op threads set to ``threads``, as a measured CPU session sets
    ``executor.cpu_threads`` (harness/machine.py ``child_device``: OpenMP threads that spin-wait for cores held by
    other processes make CPU timings on a busy machine vary many-fold); nothing on CUDA. Returns what puts the
    previous count back."""
    if device != "cpu":
        return lambda: None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    return lambda: torch.set_num_threads(before)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({cpu_name()})"


def header_line(device: str) -> str:
    """The probe's first output line: the device and the torch threads its timings ran on."""
    how = "--cpu-threads" if device == "cpu" else "not pinned: --cpu-threads applies on the CPU only"
    return f"probe on {device_name(device)}, torch threads: {torch.get_num_threads()} ({how})"


def main(argv=None) -> int:
    args = parse_args(argv)
    identity = code_identity() if args.profile else {}     # a malformed LOOPBENCH_GIT_SHA fails before any run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = max_model_len(args.prompt_len, args.output_len)
    restore_kernel_options = apply_kernel_options(args)
    restore_threads = pin_cpu_threads(device, args.cpu_threads)
    try:
        try:
            shape = model_config(args)      # a --checkpoint without config.json is named here, before any run
            cfg = shape if args.gemm_config or args.variant or args.wgmma else None
            apply_gemm_overrides(cfg, args.gemm_config)
            apply_wgmma(cfg, args.wgmma, bool(args.no_wgmma), args.gemm_config)
            # GemmConfig.prefetch_programs without the region the plan gives them would time programs never launched.
            # Without --gemm-config the shipped tables ask for none (tests/runtime/test_engine.py holds them to it);
            # with --variant each variant's tables and plan are what runs, and a variant's plan may complete ours.
            if cfg is not None and not args.variant:
                check_prefetch_programs(cfg, args.prefetch_next)
            base = snapshot_tables()
            for v in args.variant:                  # each variant's tables and plan are checked before anything runs
                apply_variant(cfg, v, base, args.prefetch_next)
            load_tables(base)
        except ValueError as e:                     # CheckpointError too: a bad config.json or preset, named
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(header_line(device), flush=True)
        warning = busy_cpu_warning(args.cpu_threads) if device == "cpu" else None
        if warning:
            print(warning, file=sys.stderr, flush=True)
        if args.variant:
            return _sweep(args, device, max_len)
        return _run(args, identity, device, max_len)
    finally:
        restore_threads()
        restore_kernel_options()


def ring_on(cfg: OuroConfig) -> None:
    """``--mlp-ring``: kernels/mlp_ring.py's table gets the default RingConfig for this model's layer shape (the
    restore of :func:`apply_kernel_options` or a variant's tables take it out again)."""
    from loopbench.kernels import mlp_ring
    mlp_ring.CONFIGS[(cfg.hidden_size, cfg.intermediate_size)] = mlp_ring.RingConfig()


def apply_variant(cfg: OuroConfig, variant: Variant, base: list[dict],
                  prefetch_next: dict[str, float] | None) -> dict[str, float] | None:
    """Load ``base`` (the probe's own tables) and apply ``variant``'s --prefetch-tiles, then its --gemm-config;
    returns the variant's prefetch plan (its --prefetch-next, else ``prefetch_next``, the probe's own). ValueError,
    naming the variant, for a bad override (:func:`apply_gemm_overrides`) or a configuration whose prefetch programs
    that plan gives no region (:func:`check_prefetch_programs`)."""
    load_tables(base)
    set_prefetch_tiles(variant.prefetch_tiles)
    plan = prefetch_next if variant.prefetch_next is None else variant.prefetch_next
    try:
        apply_gemm_overrides(cfg, list(variant.gemm_config))
        apply_wgmma(cfg, list(variant.wgmma), bool(variant.no_wgmma), list(variant.gemm_config))
        if variant.mlp_ring:
            ring_on(cfg)
        check_prefetch_programs(cfg, plan)
    except ValueError as e:
        raise ValueError(f"--variant {variant.label!r}: {e}") from None
    return plan


def _sweep(args: argparse.Namespace, device: str, max_len: int) -> int:
    """``--variant``: per variant a natural run captured as its schedule (a configuration that changes the
    arithmetic changes the tokens) and a replay engine with one warmup; then ``--repeats`` rounds, each timing
    every variant once, the order reversed every other round; each variant's tables and prefetch plan are put
    in place before each of its runs. Prints each run, then per variant the median tok/s and its ratio to the
    first variant's; exits 1 if a run does not reproduce its variant's schedule."""
    model = load(args, device, max_len)
    reqs = make_requests(model.cfg.vocab_size, args)
    arm = arm_spec(args, device)
    base, own_plan, own_greedy, own_norm = snapshot_tables(), model.prefetch_next, model.greedy_tiles, model.norm_in_gemm
    states = []
    try:
        for v in args.variant:
            model.prefetch_next = apply_variant(model.cfg, v, base, own_plan)
            model.greedy_tiles = own_greedy if v.greedy_from_logits is None else not v.greedy_from_logits
            model.norm_in_gemm = own_norm if v.norm_in_gemm is None else v.norm_in_gemm
            knobs = {**(args.attention_config or {}), **(v.attention_config or {})}
            schedule = capture(model, arm, args, max_len, reqs, knobs, v.prefill_stream)
            pe = PolicyEngine(f"replay [{v.label}]", with_attention_config(LoopEngine(model, engine_config(
                arm, args, max_len, "replay", schedule, v.prefill_stream)), knobs), schedule)
            print(pe.run(reqs, "warmup").line(), flush=True)
            states.append((v, snapshot_tables(), (model.prefetch_next, model.greedy_tiles, model.norm_in_gemm), pe, []))
        for i in range(1, args.repeats + 1):
            for v, tables, (plan, greedy, norm), pe, runs in (states if i % 2 else states[::-1]):
                load_tables(tables)
                model.prefetch_next, model.greedy_tiles, model.norm_in_gemm = plan, greedy, norm
                runs.append(pe.run(reqs, f"run {i}"))
                print(runs[-1].line(), flush=True)
    except ScheduleMismatchError as e:
        sys.stdout.flush()
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    finally:
        load_tables(base)
        model.prefetch_next, model.greedy_tiles, model.norm_in_gemm = own_plan, own_greedy, own_norm
    first = statistics.median(r.tokens_per_s for r in states[0][4])
    print(f"| variant | median tok/s | vs {states[0][0].label!r} | runs | schedule (tokens, exits) |\n"
          "|---|---|---|---|---|")
    for v, _, _, pe, runs in states:
        med = statistics.median(r.tokens_per_s for r in runs)
        same = "the first's" if pe.schedule == states[0][3].schedule else "differs from the first's"
        print(f"| {v.label} | {med:.1f} | {med / first:.4f} | {len(runs)} | {same} |")
    return 0


def _run(args: argparse.Namespace, identity: dict, device: str, max_len: int) -> int:
    """:func:`main` after the options are parsed and the kernel switches set."""
    model = load(args, device, max_len)
    reqs = make_requests(model.cfg.vocab_size, args)
    arm = arm_spec(args, device)
    schedule = capture(model, arm, args, max_len, reqs)
    engines = {p: PolicyEngine(p, with_attention_config(LoopEngine(model, engine_config(
        arm, args, max_len, EXIT_POLICY[p], schedule if p == "replay" else None)), args.attention_config), schedule)
        for p in POLICIES[args.policy]}
    try:
        if args.telemetry == "ab":
            time_telemetry_ab(engines[POLICIES[args.policy][-1]], reqs, args.repeats, args.sample_hz)
            return 0
        timed = time_policies(engines, reqs, args.repeats, args.sample_hz if args.telemetry == "on" else None)
        if args.profile:
            profile_policies(engines, reqs, args, arm, identity, timed)
    except ScheduleMismatchError as e:
        sys.stdout.flush()
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print_medians(timed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
