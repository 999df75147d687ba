"""Batch invariance on the Ouro-1.4B shape (GPU, marker ``gpu``): a request's tokens and exit depths do not
depend on what it is batched with, on padding rows, or on whether its steps ran as CUDA-graph replays.

Random bf16 weights of the exact Ouro-1.4B shape (made on the GPU, not a checkpoint: only the shapes
matter, since a matmul's algorithm is picked by shape). Under the natural ``ouro`` policy with per-request
thresholds 0.3-0.95 and ``min_loops=1`` tokens exit at every depth 1-4, so batches change composition
every step. For every max_num_seqs in graphs.BUCKETS (the sizes whose invariance issue 11 asks for):

- natural runs with graphs and without give the same tokens and exits;
- replaying the graph run's schedule, with graphs and without, reproduces them;
- a third of the requests run alone in a fresh engine (other batch mates, other padding, other prefill
  packing) give the same tokens and exits as in the full run.
"""
import pytest
import torch

from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.graphs import BUCKETS
from loopbench.runtime.model import PRESETS, OuroModel, tensor_shapes

pytestmark = pytest.mark.gpu

THRESHOLDS = (0.3, 0.5, 0.7, 0.95)
MAX_TOKENS = 6
MAX_MODEL_LEN = 64


def random_ouro_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the Ouro-1.4B layout: norms 1, embeddings N(0, 1), projections N(0, 0.02^2), and an
    exit gate whose logit has std ~1 over tokens, so hazards spread over (0.1, 0.9)."""
    cfg = PRESETS["ouro-1.4b"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, device="cuda")
        elif name == "model.early_exit_gate.bias":
            t = torch.zeros(shape, device="cuda")
        else:
            std = 1.0 if "embed" in name else cfg.hidden_size ** -0.5 if "gate.weight" in name else 0.02
            t = torch.randn(shape, device="cuda", generator=gen) * std
        tensors[name] = t.to(torch.bfloat16)
    return tensors


@pytest.fixture(scope="module", params=["cublas", "ours", "ours+prefill_gemm"])
def model(request):
    """The Ouro-1.4B shape with its decode projections on cuBLAS, on our small-M GEMM (kernels/gemm.py), and on
    ours with the prefill projections in one launch each (kernels/prefill_gemm.py, ``OuroModel.prefill_gemm``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = OuroModel.from_tensors(PRESETS["ouro-1.4b"], random_ouro_tensors(), device="cuda",
                                   dtype=torch.bfloat16, rope_len=MAX_MODEL_LEN,
                                   small_m_gemm=request.param != "cublas")
    model.prefill_gemm = request.param.endswith("prefill_gemm")
    return model


def requests(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(5, 41, (n,), generator=g).tolist()
    return [Request(f"r{i}", torch.randint(0, 49152, (lens[i],), generator=g).tolist(), MAX_TOKENS,
                    min_loops=1, max_loops=4, exit_threshold=THRESHOLDS[i % len(THRESHOLDS)]) for i in range(n)]


def run(model, reqs, max_num_seqs, **cfg):
    eng = LoopEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                         attention_backend="triton", **cfg))
    for r in reqs:
        eng.add_request(r)
    outs = eng.run()
    return eng, {rid: (list(o.token_ids), list(o.exit_depths)) for rid, o in outs.items()}


def first_difference(a: dict, b: dict) -> str:
    for rid in a:
        if a[rid] != b[rid]:
            return f"{rid}: {a[rid]} vs {b[rid]}"
    return "none"


@pytest.mark.parametrize("max_num_seqs", BUCKETS)
def test_tokens_and_exits_do_not_depend_on_batch_padding_or_graphs(model, max_num_seqs):
    reqs = requests(max_num_seqs + max_num_seqs // 2 + 1)      # a second, staggered wave and a draining tail
    eng, graph = run(model, reqs, max_num_seqs, exit_policy="ouro", cuda_graphs=True)
    assert eng.stats.decode_graphs.fallbacks == 0
    depths = {d for _, exits in graph.values() for d in exits}
    assert 1 in depths and len(depths) >= 3, f"exit depths seen: {sorted(depths)}"
    _, eager = run(model, reqs, max_num_seqs, exit_policy="ouro", cuda_graphs=False)
    assert eager == graph, f"natural, graphs vs eager: first difference {first_difference(graph, eager)}"
    schedule = eng.capture_schedule()
    for graphs in (True, False):
        _, replay = run(model, reqs, max_num_seqs, exit_policy="replay", schedule=schedule, cuda_graphs=graphs)
        assert replay == graph, f"replay (graphs={graphs}): first difference {first_difference(graph, replay)}"
    alone = reqs[::3]
    _, solo = run(model, alone, max_num_seqs, exit_policy="ouro", cuda_graphs=True)
    full = {r.request_id: graph[r.request_id] for r in alone}
    assert solo == full, f"a third of the requests alone: first difference {first_difference(full, solo)}"


def test_cross_kernel_prefetch_changes_no_token_exit_or_logit(monkeypatch):
    """OuroModel.prefetch_next (each projection bringing part of the next one's weight into L2 before its PDL
    wait, or with GemmConfig.prefetch_at_end at its end) on the Ouro shape with our small-M GEMM: the same tokens,
    exits and logits as without, with graphs and without. Not a speed claim: that is the throughput probe's
    --prefetch-next."""
    import dataclasses
    from loopbench.kernels import gemm, qkv_rope
    from loopbench.runtime.model import PREFETCH_TARGETS, check_prefetch_next
    model = OuroModel.from_tensors(PRESETS["ouro-1.4b"], random_ouro_tensors(), device="cuda", dtype=torch.bfloat16,
                                   rope_len=MAX_MODEL_LEN)
    assert model.small_m_gemm
    reqs = requests(25)
    results = {}
    tables = (gemm.CONFIGS, gemm.SWIGLU_CONFIGS, qkv_rope.CONFIGS)
    for plan, at_end in (({}, False), (dict.fromkeys(PREFETCH_TARGETS, 0.5), False),
                         (dict.fromkeys(PREFETCH_TARGETS, 1.0), False), (dict.fromkeys(PREFETCH_TARGETS, 0.5), True)):
        model.prefetch_next = check_prefetch_next(plan)
        for table in tables:
            for shape, c in list(table.items()):
                monkeypatch.setitem(table, shape, dataclasses.replace(c, prefetch_at_end=at_end))
        for graphs in (True, False):
            eng, outs = run(model, reqs, 16, exit_policy="ouro", cuda_graphs=graphs, keep_logits=True)
            results[(tuple(plan.values()) + (at_end,) * at_end, graphs)] = (outs, eng.logits_log)
    for graphs in (True, False):
        ref_outs, ref_logits = results[((), graphs)]
        for (plan, g), (outs, logits) in results.items():
            if g == graphs:
                assert outs == ref_outs, f"prefetch {plan} graphs={g}: {first_difference(ref_outs, outs)}"
                for rid, rows in ref_logits.items():
                    assert all(torch.equal(a, b) for a, b in zip(rows, logits[rid])), f"prefetch {plan} {rid}"


@pytest.mark.parametrize("max_num_seqs", [16, 32])
def test_sampling_from_lm_head_tiles_equals_sampling_from_logits(max_num_seqs):
    """Without keep_logits a decode step samples from lm_head's per-tile maxima (model.greedy_partials) and
    writes no logits; with it, from the written logits. Same tokens and exits, graphs and eager, at the batch
    sizes where lm_head runs on our GEMM."""
    model = OuroModel.from_tensors(PRESETS["ouro-1.4b"], random_ouro_tensors(), device="cuda", dtype=torch.bfloat16,
                                   rope_len=MAX_MODEL_LEN)
    assert model.greedy_partials(torch.zeros(max_num_seqs, 2048, device="cuda", dtype=torch.bfloat16)) is not None
    reqs = requests(max_num_seqs + max_num_seqs // 2 + 1)
    for graphs in (True, False):
        _, tiles = run(model, reqs, max_num_seqs, exit_policy="ouro", cuda_graphs=graphs)
        _, logits = run(model, reqs, max_num_seqs, exit_policy="ouro", cuda_graphs=graphs, keep_logits=True)
        assert tiles == logits, f"graphs={graphs}: first difference {first_difference(logits, tiles)}"
