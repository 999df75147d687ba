"""Every configuration key of ``conf.BenchConf`` with its type, default and meaning, for ``--help``.

The meanings live here, one line each; ``tests/harness/test_cli.py`` holds this table and the schema
to the same set of keys, so a key added to ``conf.py`` without a meaning fails a test.
"""
from __future__ import annotations

import dataclasses
import typing
from enum import Enum

from omegaconf import MISSING

from . import conf

MEANINGS: dict[str, str] = {
    "name": "the run's name: the bundle folder is results/<date>-<name>-<short sha>",
    "model.preset": "synthetic checkpoint of this runtime/model.py preset (tiny, ouro-1.4b...), written once into the cache",
    "model.checkpoint": "a real HF safetensors checkpoint directory instead of the preset",
    "model.dtype": "dtype every tensor is cast to and the model runs in",
    "model.seed": "seed of the synthetic weights",
    "workload.prompt_len": "P: tokens per seeded prompt (null when prompt_lens is set)",
    "workload.output_len": "D: output tokens per request, exactly (EOS ignored), greedy",
    "workload.prompt_seed": "seed of the random prompt token ids",
    "workload.prompts_file": "prompts from a parquet (prompt_token_ids column) or JSONL file instead",
    "workload.prompt_lens": "cycled prompt lengths instead of one prompt_len",
    "points[].max_num_seqs": "B: batch capacity of the engine at this point",
    "points[].num_requests": "C: requests submitted at once at this point",
    "points[].prompt_len": "this point's own P: seeded prompts of P tokens (null: the workload's prompts)",
    "points[].output_len": "this point's own D (null: workload.output_len)",
    "exit.policy": "natural exit policy of the frozen reference run (arms replay its exits)",
    "exit.threshold": "exit when 1 - survival reaches this (policy ouro / ouro_delayed)",
    "exit.min_loops": "earliest exit depth",
    "exit.max_loops": "deepest loop; every token exits there at the latest",
    "arms.<name>.kv_layout": "native (copy K/V into skipped planes) or alias (read through the exit map)",
    "arms.<name>.prefix_tiles": "alias only: read key tiles before the first aliased position directly",
    "arms.<name>.attention_backend": "torch (reference) or triton kernels",
    "arms.<name>.cuda_graphs": "capture decode and prefill as CUDA graphs (needs CUDA)",
    "arms.<name>.graph_cache_size": "most CUDA graphs kept per kind",
    "arms.<name>.descriptor_mode": "how step descriptors reach the GPU: h2d (pinned copies) or mapped",
    "arms.<name>.block_size": "KV block size in positions",
    "arms.<name>.tile_size": "attention key-tile size in positions",
    "arms.<name>.engine": "engine factory \"package.module:factory\" (default: our LoopEngine)",
    "comparisons[].baseline": "baseline arm; pair ratio = baseline_s / candidate_s",
    "comparisons[].candidate": "candidate arm (= baseline: an A/A noise-floor comparison)",
    "comparisons[].name": "table name; default <baseline>_vs_<candidate>",
    "comparisons[].track": "replay (arms replay the frozen natural run) or natural (each arm its own exits; report: Natural schedule)",
    "reference_arm": "arm of the frozen natural run; null = the first comparison's baseline",
    "pairs": "paired measurements per point and comparison (pairs x sessions at most 1000)",
    "sessions": "independent sessions per device, one after another (fresh processes), each with its own pairs",
    "order_seed": "seed of the balanced order of each pair's two arms",
    "warmup": "one full untimed run per arm before its measured run",
    "verdict.min_effect": "|speedup - 1| a faster / slower verdict needs",
    "verdict.confidence": "level of the bootstrap confidence interval",
    "verdict.min_pairs": "fewer pairs than this: always inconclusive",
    "verdict.n_resamples": "bootstrap resamples (x pairs x sessions at most 10^8)",
    "verdict.bootstrap_seed": "bootstrap seed",
    "verdict.eager_fraction_tolerance": "no verdict when a pair's arms' eager fractions (graph coverage) differ by more",
    "telemetry.sample_hz": "NVML samples per second during each measured run (>= 10; nothing without NVML)",
    "evidence.alpha": "level of the drift, order and allocator-creep tests (flagged when p < alpha)",
    "evidence.power": "power of the plan's minimum detectable effect",
    "evidence.noise_bundle": "a bundle whose A/A pair ratios give the noise of the plan's detectable effect",
    "evidence.noise_sigma": "else a declared noise: SD of one pair's log ratio (null: unknown)",
    "natural.gate_epsilon": "natural track: an exit divergence is a near-tie when |1 - S_r - threshold| < this",
    "natural.logit_epsilon": "natural track: a token divergence is a near-tie when top-1 - top-2 logit < this",
    "natural.floor": "natural track: the A/A comparison bounding divergent requests (null: baseline arm's A/A)",
    "executor.kind": "local (one subprocess per device) or slurm (one submitit job per device)",
    "executor.device": "auto (CUDA when available), cpu or cuda",
    "executor.gpus": "GPU indices of the local sessions; null = every visible GPU",
    "executor.cpu_threads": "torch threads of a CPU session",
    "executor.cpu_devices": "simulated devices of a CPU run (device=cpu): sessions cpu0..cpu<n-1> in parallel",
    "executor.session_timeout_s": "a measuring session is killed after this many seconds (plan and bench refuse "
                                  "a plan whose longest session is estimated well past it, and warn near it)",
    "executor.reference_timeout_s": "the reference capture is killed after this many seconds",
    "executor.poll_s": "how often the controller polls its children, seconds (below both timeouts)",
    "executor.stop_grace_s": "on SIGTERM / Ctrl-C: seconds between the children's SIGTERM and SIGKILL",
    "executor.slurm.cluster": "submitit cluster: null = Slurm, local / debug = submitit's test executors",
    "executor.slurm.partition": "Slurm partition (--partition; null: the cluster's default)",
    "executor.slurm.account": "Slurm account (--account; null: the user's default)",
    "executor.slurm.time_limit_min": "Slurm time limit, minutes (--time; null: the child's timeout)",
    "executor.slurm.cpus_per_task": "CPUs per Slurm task",
    "executor.slurm.gpus_per_task": "GPUs per Slurm task, where the sessions run on CUDA",
    "executor.slurm.mem_gb": "memory per Slurm job, GB (null: no --mem)",
    "executor.slurm.jobs": "sessions (one device each) to submit",
    "executor.slurm.additional_parameters": "extra sbatch parameters (a mapping)",
    "results_dir": "where bundles are written",
    "cache_dir": "synthetic checkpoints and frozen references; null = $LOOPBENCH_CACHE or ~/.cache/loopbench",
    "reuse_references": "reuse a cached frozen reference of the same inputs (hash) instead of capturing it",
    "fault.kill_after_arms": "testing aid: a session SIGKILLs itself after this many arms",
    "resume": "an incomplete bundle to finish measuring (every other key as in its plan)",
    # the online serving track (harness/online/config.py OnlineConf); online: null runs none
    "online.point": "the point whose B, prompts and frozen reference the online trace uses (null: the first)",
    "online.num_requests": "requests of the seeded Poisson trace (at most that point's C)",
    "online.trace_seed": "seed of the trace's arrivals",
    "online.rates": "arrival rates as multiples of the native capacity the calibration run measures",
    "online.pairs": "balanced pairs of online runs (baseline, candidate) per rate",
    "online.baseline": "online baseline arm (null: the first comparison's baseline)",
    "online.candidate": "online candidate arm (null: the first comparison's candidate)",
    "online.slo_ttft_s": "declared SLO on time to first token (with slo_tpot_s; null: 1.5 x calibration p99)",
    "online.slo_tpot_s": "declared SLO on time per output token after the first",
    "online.warmup_requests": "untimed requests each fresh server serves before its measured run",
    "online.max_duration_s": "bound of one online run; requests still open then fail",
    "online.health_timeout_s": "a server not healthy within this fails its run",
}

_CONTAINERS = {"points": "points[]", "comparisons": "comparisons[]", "arms": "arms.<name>", "online": "online"}


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (list, typing.List):
        return f"list of {_type_name(args[0])}"
    if typing.get_origin(tp) in (dict, typing.Dict):
        return "mapping"
    if args and typing.get_origin(tp) is typing.Union:
        return _type_name(args[0]) + " or null"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "|".join(m.name for m in tp)
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is MISSING or f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return value.name if isinstance(value, Enum) else "null" if value is None else str(value)


def schema_keys(node=conf.BenchConf, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, default) of every leaf key of the schema, in declaration order."""
    hints = typing.get_type_hints(node)
    out = []
    for f in dataclasses.fields(node):
        key, tp = prefix + f.name, hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            out += schema_keys(tp, key + ".")
        elif inner and f.name in _CONTAINERS:
            out += schema_keys(inner[0], _CONTAINERS[f.name] + ".")
        else:
            out.append((key, _type_name(tp), _default(f)))
    return out


def help_text() -> str:
    """The ``--help`` section of configuration keys: one line per key (type, default: meaning)."""
    lines = ["configuration keys (override as KEY=VALUE; presets in configs/):"]
    for key, tp, default in schema_keys():
        lines.append(f"  {key} ({tp}; {default}): {MEANINGS[key]}")
    return "\n".join(lines)
