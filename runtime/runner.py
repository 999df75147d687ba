"""The model runner: the device side of one engine step.

Holds the resident per-slot device state (hidden state, last token, output tokens, exit-rule state and
bounds; row S is a scratch slot that padding rows read and write), runs the decode core over a
:class:`~.scheduler.StepPlan`'s rows and the full-prompt prefill loop, and samples greedily. It builds
the device inputs of a step from the plan (the descriptor bank) and hands them to the CUDA-graph
manager when graphs are on. It decides nothing: which rows run and where they exit is the plan's.
The decode path never synchronises with the host.
"""
from __future__ import annotations

import torch

from loopbench.kernels.prefill_attention import prefill_attention

from .api import EngineConfig, EngineStats, KVLayout, Request
from .attention import get_backend
from .descriptors import DescriptorBanks
from .exit_policy import NaturalPolicy, ReplayPolicy
from .graphs import CudaGraphs
from .kv_cache import DepthKVCache
from .model import OuroModel
from .scheduler import PrefillLoop, StepPlan


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: logits [N, vocab] -> token ids [N] int64 (on the logits' device, no sync)."""
    return logits.argmax(-1)


class Runner:
    """Device state and device work of a :class:`~.engine.LoopEngine` (one instance per engine)."""

    def __init__(self, model: OuroModel, config: EngineConfig, kv: DepthKVCache,
                 policy: NaturalPolicy | ReplayPolicy, stats: EngineStats):
        self.model, self.config, self.kv, self.policy = model, config, kv, policy
        cfg, dev, S, acc = model.cfg, model.device, config.max_num_seqs, model.rope_dtype
        self.backend = get_backend(config.attention_backend)
        self.hidden = torch.zeros((S + 1, cfg.hidden_size), device=dev, dtype=model.dtype)
        self.last_token = torch.zeros(S + 1, dtype=torch.long, device=dev)
        self.out_tokens = torch.zeros((S + 1, config.max_model_len), dtype=torch.long, device=dev)
        self.n_out = torch.zeros(S + 1, dtype=torch.long, device=dev)
        self.survival = torch.ones(S + 1, dtype=acc, device=dev)
        self.triggered = torch.zeros(S + 1, dtype=torch.bool, device=dev)
        self.min_loops = torch.ones(S + 1, dtype=torch.int32, device=dev)
        self.max_loops = torch.ones(S + 1, dtype=torch.int32, device=dev)
        self.threshold = torch.ones(S + 1, dtype=acc, device=dev)
        self.banks = DescriptorBanks(S, dev, config.descriptor_mode)
        self._prefill_x: dict[int, torch.Tensor] = {}     # slot -> prompt activations [T, hidden] between loops
        self.graphs: CudaGraphs | None = None
        if config.cuda_graphs:
            if dev.type != "cuda":
                raise ValueError(f"cuda_graphs=True needs a CUDA model, got device {dev}")
            if config.attention_backend != "triton":
                raise ValueError("cuda_graphs=True needs attention_backend='triton' (the torch backend syncs)")
            self.graphs = CudaGraphs(self.decode_core, self.prefill_core, max_num_seqs=S,
                                     capacity=config.graph_cache_size, decode_counters=stats.decode_graphs,
                                     prefill_counters=stats.prefill_graphs, banks=self.banks, device=dev)

    # ------------------------------------------------------------------------------------ prefill
    def admit(self, slot: int, req: Request) -> None:
        """Stage an admitted request: its exit bounds into the slot, its prompt embedded [T, hidden]."""
        ids = torch.tensor(req.prompt_token_ids, dtype=torch.long).to(self.model.device)
        self.min_loops[slot], self.max_loops[slot] = req.min_loops, req.max_loops
        self.threshold[slot] = req.exit_threshold
        self._prefill_x[slot] = self.model.embed[ids]

    def release(self, slot: int) -> None:
        """Forget a finished or aborted request's prompt activations (if it was still prefilling)."""
        self._prefill_x.pop(slot, None)

    def prefill(self, loop: PrefillLoop) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One full-depth loop over the slot's prompt at ``loop.depth``; KV into that plane. The final loop
        samples the first output token into the slot and returns (logits [1, vocab], token [1] int64)."""
        x, slot, dev = self._prefill_x[loop.slot], loop.slot, self.model.device
        if self.graphs is None:
            T = x.shape[0]
            positions = torch.arange(T, device=dev, dtype=torch.int32)
            row_slot = torch.full((T,), slot, dtype=torch.int32, device=dev)
            row_depth = torch.full((T,), loop.depth, dtype=torch.int32, device=dev)
            x = self.prefill_core(x, row_slot, row_depth, positions)[0]
        else:
            x = self.graphs.run_prefill(x, slot, loop.depth)
        if not loop.final:
            self._prefill_x[slot] = x
            return None
        del self._prefill_x[slot]
        logits = self.model.logits(x[-1:])
        token = sample_greedy(logits)                                       # [1]
        self.last_token[slot] = token[0]
        self.out_tokens[slot, 0] = token[0]
        self.n_out[slot] = 1
        return logits, token

    def prefill_core(self, x, row_slot, row_depth, positions):
        """One full-depth loop over a prompt: x [T, hidden]; [T] int32 slot/depth/positions.
        Writes the prompt's K/V into the depth's plane; returns (x_out [T, hidden],)."""
        kv, be = self.kv, self.backend

        def attend(layer, q, k, v):
            be.write_kv(kv.k[layer], kv.v[layer], k, v, kv.block_tables, row_slot, row_depth, positions)
            return prefill_attention(q, k, v)

        return (self.model.run_loop(x, positions, attend)[0],)

    # ------------------------------------------------------------------------------------- decode
    def decode(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One resident loop for the plan's decode rows (graph or eager; no host sync).
        Returns (exit [n] bool, token [n] int64, logits [n, vocab]) on the device."""
        n = len(plan.decode)
        bucket = n if self.graphs is None else self.graphs.bucket(n)
        bank = self.banks.acquire(bucket)
        host = bank.numpy()
        host[:, :n] = plan.rows.T           # one vectorised write into the (pinned) bank, not 5n setitems
        if self.graphs is None:
            return self.decode_core(*self.banks.publish(bank))
        return self.graphs.run_decode(bank, host, n)

    def decode_core(self, row_slot, row_depth, row_pos, row_fa, row_forced):
        """One resident decode step for N rows, entirely on the device (no host sync; graph-capturable).

        Inputs: [N] int32 descriptor rows (slot, depth, position, first-alias, forced exit). Runs one
        recurrent-core loop, applies the exit rule (or the forced exits of ``replay``), samples greedy
        tokens for all rows and, for the exiting ones, updates the resident last token, output tokens and
        count, and publishes the exit (alias) or fills the skipped planes (native). Rows with slot < 0 are
        padding: they read and write only the scratch slot S and skip every KV write.
        Returns (exit [N] bool, token [N] int64, logits [N, vocab]).
        """
        kv, be, cfg = self.kv, self.backend, self.config
        valid = row_slot >= 0
        sl = torch.where(valid, row_slot, cfg.max_num_seqs).long()
        first = row_depth == 1
        x = torch.where(first[:, None], self.model.embed[self.last_token[sl]], self.hidden[sl])

        def attend(layer, q, k, v):
            be.write_kv(kv.k[layer], kv.v[layer], k, v, kv.block_tables, row_slot, row_depth, row_pos)
            return be.decode_attention(q, kv.k[layer], kv.v[layer], kv.block_tables, row_slot, row_depth,
                                       row_pos, kv.exit_map, row_fa, layout=cfg.kv_layout,
                                       prefix_tiles=cfg.prefix_tiles, tile_size=cfg.tile_size)

        x_out, hazard = self.model.run_loop(x, row_pos, attend)
        s_prev = torch.where(first, torch.ones_like(hazard), self.survival[sl])
        t_prev = self.triggered[sl] & ~first
        exit_now, s, trig = self.policy.device_step(hazard, row_depth, s_prev, t_prev, row_forced, self, sl)
        exit_now = exit_now & valid
        logits = self.model.logits(x_out)
        tok = sample_greedy(logits)
        self.hidden.index_copy_(0, sl, x_out)
        self.survival.index_copy_(0, sl, s)
        self.triggered.index_copy_(0, sl, trig)
        n = self.n_out[sl]
        self.out_tokens[sl, n] = torch.where(exit_now, tok, self.out_tokens[sl, n])
        self.last_token.index_copy_(0, sl, torch.where(exit_now, tok, self.last_token[sl]))
        self.n_out.index_copy_(0, sl, n + exit_now.long())
        exit_slot = torch.where(exit_now, row_slot, -1).to(torch.int32)
        if cfg.kv_layout == KVLayout.ALIAS:
            be.publish_exits(kv.exit_map, exit_slot, row_pos, row_depth)
        else:
            be.native_fill(kv.k, kv.v, kv.block_tables, exit_slot, row_pos, row_depth, self.max_loops[sl])
        return exit_now, tok, logits

    def host_tokens(self, slot: int, n: int) -> torch.Tensor:
        """The slot's first n output tokens [n] int64 on the host; on CUDA an async copy into pinned memory
        (read it only after a device synchronisation)."""
        tokens = self.out_tokens[slot, :n]
        if tokens.is_cuda:
            host = torch.empty(n, dtype=torch.long, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            return host
        return tokens.clone()
