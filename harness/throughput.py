"""Quick single-arm throughput probe, not the paired benchmark.

One natural run is captured as a schedule, then one engine replays it: a warmup and a few timed runs,
each printed as tokens/s, ms per engine step and that run's own work and graph counters. For iterating
on the runtime; published figures come from ``make bench`` and its audited bundle. On a machine
without CUDA it runs the torch backend on the CPU (slowly).

    python -m loopbench.harness.throughput --preset ouro-1.4b --max-num-seqs 16 --num-requests 32
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from loopbench.runtime.api import Request
from loopbench.runtime.checkpoint import load_checkpoint
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import OuroModel

from .fixtures import write_calibrated_checkpoint
from .records import ArmSpec
from .spec import max_model_len


def parse_args(argv=None) -> argparse.Namespace:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = os.path.join(os.path.expanduser(os.environ.get("LOOPBENCH_CACHE", "~/.cache/loopbench")), "checkpoints")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="synthetic model preset (tiny, ouro-1.4b)")
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint directory (overrides --preset)")
    ap.add_argument("--cache", default=cache, help="where synthetic checkpoints are written and reused")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="B: batch capacity")
    ap.add_argument("--num-requests", type=int, default=32, help="C: requests submitted at once")
    ap.add_argument("--prompt-len", type=int, default=128, help="P: prompt tokens (seeded random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="D: output tokens per request")
    ap.add_argument("--layout", default="native", choices=["native", "alias", "alias_prefix"])
    ap.add_argument("--backend", default="triton" if device == "cuda" else "torch", choices=["torch", "triton"],
                    help="attention backend (default: triton on CUDA, torch on the CPU)")
    ap.add_argument("--no-graphs", action="store_true", help="run eagerly (graphs need CUDA and triton)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after the warmup")
    return ap.parse_args(argv)


def load(args: argparse.Namespace, device: str, max_len: int) -> OuroModel:
    """The checkpoint (a synthetic one is written once) as a model: bf16 on CUDA, fp32 on the CPU."""
    path = Path(args.checkpoint) if args.checkpoint else Path(args.cache) / f"{args.preset}-seed0-bfloat16-calibrated"
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_calibrated_checkpoint(path, args.preset, seed=0, dtype=torch.bfloat16, device=device)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f}s")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg, tensors = load_checkpoint(path, dtype=dtype)  # a release may mix dtypes (fp32 norms): cast on load
    return OuroModel.from_tensors(cfg, tensors, device=device, dtype=dtype, rope_len=max_len)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_len = max_model_len(args.prompt_len, args.output_len)
    model = load(args, device, max_len)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(f"r{i}", torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                    args.output_len, min_loops=2, max_loops=4, exit_threshold=0.5)
            for i in range(args.num_requests)]
    arm = ArmSpec(kv_layout="alias" if args.layout != "native" else "native", prefix_tiles=args.layout == "alias_prefix",
                  attention_backend=args.backend,
                  cuda_graphs=not args.no_graphs and device == "cuda" and args.backend == "triton")
    natural = LoopEngine(model, arm.engine_config(args.max_num_seqs, max_len, "ouro_delayed"))
    for r in reqs:
        natural.add_request(r)
    natural.run()
    schedule = natural.capture_schedule()
    eng = LoopEngine(model, arm.engine_config(args.max_num_seqs, max_len, "replay", schedule))
    for i in range(args.repeats + 1):
        if i:
            eng.reset_run()
        before = eng.stats.copy()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for r in reqs:
            eng.add_request(r)
        outs = eng.run()
        if device == "cuda":
            torch.cuda.synchronize()
        el = time.perf_counter() - t0
        schedule.verify(outs)
        delta = eng.stats.minus(before)
        n = sum(len(o.token_ids) for o in outs.values())
        exits = [e for o in outs.values() for e in o.exit_depths[1:]]
        print(f"{'warmup' if i == 0 else 'run'} {i}: {el:.3f}s {n / el:.1f} tok/s  {el / delta.steps * 1e3:.2f} "
              f"ms/step  three-loop share {exits.count(3) / max(1, len(exits)):.3f}  this run: {delta.work()} decode graphs {delta.decode_graphs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
