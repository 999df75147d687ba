"""Child process of the CUDA-graph capture tests in test_gpu_runtime.py (not a test module itself).

Run as ``python -m tests.runtime.gpu_capture_child SCENARIO OUT.json`` from the repository root, normally with a
fresh empty ``TRITON_CACHE_DIR`` so that every Triton kernel is compiled in this process for the first
time (a cold machine). Writes a JSON report to OUT.json; the parent test asserts on it.

- ``workload``: for each exit policy (fixed, ouro, ouro_delayed, and replay of the ouro_delayed run) and
  each layout (native, alias, alias+prefix), a fresh graph engine (tiny preset, bf16, Triton backend)
  runs requests whose batch shrinks through the decode buckets 8, 4, 2 and 1 and whose prompts have
  several lengths (packed into two prefill buckets). The collector stays on, and every engine is dropped for the
  next, as in the benchmark. Reports each run's graph counters, captured buckets and outputs.
- ``failed-capture``: a graph whose captured call launches a Triton specialisation its warm-up did not
  (an integer argument of 1 instead of 16) must fail with a GraphCaptureError naming the bucket and the
  kernel; afterwards a correct capture and replay in the same process must still give right results.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

POLICIES = ("fixed", "ouro", "ouro_delayed", "replay")
ARMS = {"native": dict(kv_layout="native"), "alias": dict(kv_layout="alias"),
        "alias_prefix": dict(kv_layout="alias", prefix_tiles=True)}
BOUNDS = [(1, 4, 0.5), (2, 4, 0.5), (1, 3, 0.4), (2, 3, 0.6)]
PROMPT_LENS = [5, 17, 33, 16, 31, 1, 40]
MAX_TOKENS = [3, 5, 8, 12, 16, 20, 24]     # the batch of 7 shrinks to 4, 2 and 1 rows as they finish


def workload() -> dict:
    from loopbench.harness.fixtures import write_synthetic_checkpoint
    from loopbench.runtime.checkpoint import load_checkpoint
    from loopbench.runtime.api import EngineConfig, Request
    from loopbench.runtime.engine import LoopEngine
    from loopbench.runtime.model import OuroModel

    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_checkpoint(Path(tmp) / "tiny", "tiny", seed=0, dtype=torch.bfloat16)
        cfg, tensors = load_checkpoint(Path(tmp) / "tiny")
    model = OuroModel.from_tensors(cfg, tensors, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    reqs = [Request(f"r{i}", torch.randint(0, 256, (n,), generator=g).tolist(), t, *BOUNDS[i % len(BOUNDS)])
            for i, (n, t) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))]
    runs, schedule = [], None
    for policy in POLICIES:
        for arm, layout in ARMS.items():
            t0 = time.perf_counter()
            record = {"policy": policy, "arm": arm}
            try:
                extra = dict(exit_policy="replay", schedule=schedule) if policy == "replay" else \
                    dict(exit_policy=policy)
                # batch_invariant=False: decode on its shrinking buckets, so every bucket's graph is captured
                eng = LoopEngine(model, EngineConfig(max_num_seqs=8, max_model_len=128, attention_backend="triton",
                                                     cuda_graphs=True, poison_kv=True, batch_invariant=False,
                                                     **layout, **extra))
                for r in reqs:
                    eng.add_request(r)
                outs = eng.run()
                if policy == "ouro_delayed" and arm == "native":
                    schedule = eng.capture_schedule()
                if policy == "replay":
                    schedule.verify(outs)
                record.update(stats=dataclasses.asdict(eng.stats), decode_buckets=sorted(eng.runner.graphs.decode.graphs),
                              prefill_buckets=sorted(eng.runner.graphs.prefill.graphs),
                              outputs={rid: [list(o.token_ids), list(o.exit_depths)] for rid, o in outs.items()})
            except Exception as err:
                record["error"] = "".join(traceback.format_exception(err))
            record["seconds"] = round(time.perf_counter() - t0, 2)
            runs.append(record)
            if "error" in record:
                return {"runs": runs}
    return {"runs": runs}


def failed_capture() -> dict:
    import triton
    import triton.language as tl

    from loopbench.runtime.api import GraphCounters
    from loopbench.runtime.graphs import GraphCache, GraphCaptureError

    @triton.jit
    def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.zeros(16, device="cuda")

    def diverging(t):
        # The captured call takes another Triton specialisation (n == 1) than its warm-up (n == 16).
        n = 1 if torch.cuda.is_current_stream_capturing() else 16
        _add_one_kernel[(1,)](t, n, BLOCK=16)
        return (t,)

    report = {}
    cache = GraphCache(diverging, 4, GraphCounters())
    try:
        cache.run(4, (x,), publish=lambda: None)
        report["error"] = None
    except GraphCaptureError as err:
        report["error"] = str(err)
    report["cached_after_failure"] = sorted(cache.graphs)
    # The process must still work: a correct graph captures and replays, eager kernels run.
    y = torch.zeros(16, device="cuda")
    good = GraphCache(lambda t: (_add_one_kernel[(1,)](t, 16, BLOCK=16), t)[1:], 4, GraphCounters())
    good.run(4, (y,), publish=lambda: None)       # warm-up (+1), capture (no effect), replay (+1)
    good.run(4, (y,), publish=lambda: None)       # replay (+1)
    z = (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum()
    torch.cuda.synchronize()
    report.update(after=y.tolist(), matmul=float(z))
    return report


def main(argv: list[str]) -> int:
    scenario, out = argv
    report = {"workload": workload, "failed-capture": failed_capture}[scenario]()
    Path(out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
