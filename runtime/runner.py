"""The model runner: the device side of one engine step.

Holds the resident per-slot device state (hidden state, last token, output tokens, exit-rule state and
bounds; row S is a scratch slot that padding rows read and write), runs the decode core over a
:class:`~.scheduler.StepPlan`'s rows and the full-prompt prefill loop, and samples greedily. It builds
the device inputs of a step from the plan (the descriptor bank) and hands them to the CUDA-graph
manager when graphs are on. It decides nothing: which rows run and where they exit is the plan's.
The decode path never synchronises with the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from loopbench.kernels import exit_rule, step_state
from loopbench.kernels.decode_attention import DTYPES as DECODE_DTYPES
from loopbench.kernels.prefill_attention import DEFAULT_BLOCK_M as PREFILL_BLOCK_M
from loopbench.kernels.prefill_attention import max_prefill_tiles, packed_prefill_attention, prefill_tiles

from .api import AttentionBackendName, EngineConfig, EngineStats, KVLayout
from .attention import get_backend
from .descriptors import PADDING_COLUMNS, DescriptorBanks, to_device_async, unpack_prefill_descriptor
from .exit_policy import NaturalPolicy, ReplayPolicy
from .graphs import CudaGraphs, prefill_bucket_for
from .kv_cache import DepthKVCache
from .model import OuroModel
from .scheduler import PrefillLoop, Running, StepPlan


def prefill_descriptor(loops: Sequence[PrefillLoop], lens: Sequence[int], rows: int,
                       max_num_seqs: int) -> np.ndarray:
    """The host side of a packed prefill loop: one int32 array of ``3 * rows + 3 * num_tiles`` entries,
    the per-row slot, depth and position ([rows] each; rows past the prompts are padding: slot -1,
    depth 1, position 0) followed by the query tiles ([3, num_tiles], kernels/prefill_attention.py) with
    room for any packing of up to ``max_num_seqs`` prompts into ``rows`` rows (a fixed size per bucket)."""
    total = sum(lens)
    meta = np.zeros(3 * rows + 3 * max_prefill_tiles(rows, max_num_seqs, PREFILL_BLOCK_M), dtype=np.int32)
    slot, depth, pos = meta[:rows], meta[rows:2 * rows], meta[2 * rows:3 * rows]
    slot[:total] = np.repeat([loop.slot for loop in loops], lens)
    slot[total:] = -1
    depth[:total] = np.repeat([loop.depth for loop in loops], lens)
    depth[total:] = 1
    pos[:total] = np.concatenate([np.arange(n) for n in lens])
    tiles = meta[3 * rows:].reshape(3, -1)
    tiles[:] = prefill_tiles(lens, block_m=PREFILL_BLOCK_M, num_tiles=tiles.shape[1])
    return meta


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling: logits [N, vocab] -> token ids [N] int64 (on the logits' device, no sync)."""
    return logits.argmax(-1)


@dataclass(frozen=True)
class PagedRopeWrite:
    """model.RopeWriteFn into this runner's paged cache for one launch's rows ([N] int32 slot, depth and
    position), with ``project``: the qkv projection that does the same in its epilogue (kernels/qkv_rope.py)."""
    kv: DepthKVCache
    cos: torch.Tensor
    sin: torch.Tensor
    row_slot: torch.Tensor
    row_depth: torch.Tensor
    row_pos: torch.Tensor
    heads: int

    def __call__(self, layer: int, qkv: torch.Tensor) -> None:
        from loopbench.kernels.kv_write import rope_write_kv_
        rope_write_kv_(qkv, self.cos, self.sin, self.kv.k[layer], self.kv.v[layer], self.kv.block_tables,
                       self.row_slot, self.row_depth, self.row_pos, self.heads)

    def project(self, layer: int, x: torch.Tensor, w_qkv: torch.Tensor, config,
                next_weight: torch.Tensor | None = None) -> torch.Tensor:
        from loopbench.kernels.qkv_rope import qkv_rope_write_kv
        return qkv_rope_write_kv(x, w_qkv, config, self.cos, self.sin, self.kv.k[layer], self.kv.v[layer],
                                 self.kv.block_tables, self.row_slot, self.row_depth, self.row_pos, self.heads,
                                 next_weight=next_weight)


def prefill_beside_decode(config: EngineConfig, device: torch.device) -> bool:
    """Whether an engine's prefill loops run on a stream of their own (``EngineConfig.prefill_stream``): on CUDA
    with the Triton backend only. The torch backend's native fill rewrites one KV cell of slot 0 where no row
    exits (a no-op in stream order, a lost write beside a prefill of slot 0), and it synchronises every layer."""
    return config.prefill_stream and device.type == "cuda" and config.attention_backend == "triton"


class Runner:
    """Device state and device work of a :class:`~.engine.LoopEngine` (one instance per engine)."""

    def __init__(self, model: OuroModel, config: EngineConfig, kv: DepthKVCache,
                 policy: NaturalPolicy | ReplayPolicy, stats: EngineStats):
        self.model, self.config, self.kv, self.policy = model, config, kv, policy
        cfg, dev, S, acc = model.cfg, model.device, config.max_num_seqs, model.rope_dtype
        self.backend = get_backend(config.attention_backend)
        if config.attention_backend == AttentionBackendName.TRITON and model.dtype not in DECODE_DTYPES:
            # else the first decode step would fail, after every prefill loop
            raise ValueError(f"attention_backend='triton' needs a float32, bfloat16 or float16 model, got "
                             f"{model.dtype} (use attention_backend='torch')")
        # RoPE and the KV write in one launch per layer where both are Triton kernels (the fused loop).
        self.fused_kv_write = model.fused and config.attention_backend == "triton"
        # The slot state around each loop in one Triton launch per side where the loop runs on Triton kernels
        # (kernels/step_state.py), else the same moves in torch (its *_ref functions).
        self._gather_rows, self._apply_rows = ((step_state.gather_rows, step_state.apply_rows) if self.fused_kv_write
                                               else (step_state.gather_rows_ref, step_state.apply_rows_ref))
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
        # EngineConfig.prefill_stream: the stream prefill loops run on, and whether one has run since the last join.
        self._prefill_stream = torch.cuda.Stream(dev) if prefill_beside_decode(config, dev) else None
        self._prefill_pending = False
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
    def stage(self, admitted: Sequence[Running]) -> None:
        """Put a step's host decisions on the device before its work: the KV block-table entries assigned
        since the last step, and each admitted request's exit bounds and embedded prompt [T, hidden].
        One pinned async upload each, never a pageable copy (that would block the host until the GPU
        drained its queue)."""
        self.kv.flush_tables()
        if not admitted:
            return
        dev, reqs = self.model.device, [r.req for r in admitted]
        lens = [len(r.prompt_token_ids) for r in reqs]
        ints = np.concatenate([[r.slot for r in admitted], [r.min_loops for r in reqs],
                               [r.max_loops for r in reqs], *[r.prompt_token_ids for r in reqs]]).astype(np.int64)
        up, a = to_device_async(ints, dev), len(reqs)
        slots = up[:a]
        self.min_loops[slots] = up[a:2 * a].to(torch.int32)
        self.max_loops[slots] = up[2 * a:3 * a].to(torch.int32)
        threshold = np.array([r.exit_threshold for r in reqs], dtype=np.float64)
        self.threshold[slots] = to_device_async(threshold, dev).to(self.threshold.dtype)
        prompts = self.model.embed[up[3 * a:]]                                     # [sum T, hidden]
        for run, x in zip(admitted, prompts.split(lens)):
            self._prefill_x[run.slot] = x

    def release(self, slot: int) -> None:
        """Forget a finished or aborted request's prompt activations (if it was still prefilling)."""
        self._prefill_x.pop(slot, None)

    def prefill(self, loops: Sequence[PrefillLoop]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """One full-depth loop for every prefilling request, packed into one launch sequence: their prompts
        back to back, each causal within itself (no attention across requests), K/V into each request's
        plane of ``loop.depth``. Requests on their final loop sample their first output token into their
        slots; returns (indices of those loops in ``loops``, logits [F, vocab], tokens [F] int64) on the
        device, or None when no loop was final.

        With ``EngineConfig.prefill_stream`` the work is queued on the prefill stream after everything queued
        so far on the current one; the current stream reads its results only after :meth:`join_prefill`."""
        side = self._prefill_stream
        if not self.prefill_on_own_stream:
            return self._prefill(loops)
        side.wait_stream(torch.cuda.current_stream(side.device))
        for loop in loops:      # the caching allocator must not hand a prompt's memory to the current stream
            self._prefill_x[loop.slot].record_stream(side)      # while the prefill stream still reads it
        self._prefill_pending = True
        with torch.cuda.stream(side):
            return self._prefill(loops)

    @property
    def prefill_on_own_stream(self) -> bool:
        """Whether :meth:`prefill` queues its loop on the prefill stream now: :func:`prefill_beside_decode` gave
        this runner one, and the model's ``norm_in_gemm`` and ring (``ring_on``) are off. The norm step inside o_proj
        / down (kernels/gemm_norm.py) and the persistent layer half (kernels/mlp_ring.py) count arrivals in one
        buffer per model and need every program resident: two such launches at once would corrupt and deadlock.
        Read at every prefill (the switch may change)."""
        return self._prefill_stream is not None and not self.model.norm_in_gemm and not self.model.ring_on()

    def join_prefill(self) -> None:
        """Make the current stream wait for the prefill loops queued on the prefill stream (no host sync); a
        no-op without ``EngineConfig.prefill_stream`` or when none is pending."""
        if self._prefill_pending:
            torch.cuda.current_stream(self._prefill_stream.device).wait_stream(self._prefill_stream)
            self._prefill_pending = False

    def _prefill(self, loops: Sequence[PrefillLoop]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        xs = [self._prefill_x[loop.slot] for loop in loops]
        lens = [x.shape[0] for x in xs]
        total = sum(lens)
        rows = self.prefill_rows(total)
        meta = prefill_descriptor(loops, lens, rows, self.config.max_num_seqs)
        if self.graphs is None:
            up = to_device_async(meta, self.model.device)
            x = torch.cat(xs + [xs[0].new_zeros((rows - total, xs[0].shape[1]))]) if rows > total else torch.cat(xs)
            out = self.prefill_core(x, *unpack_prefill_descriptor(up, rows))[0][:total]
        else:
            out = self.graphs.run_prefill(xs, meta, rows)[:total].clone()
        finals, last_rows = [], []
        for i, (loop, x) in enumerate(zip(loops, out.split(lens))):
            if loop.final:
                finals.append(i)
                last_rows.append(sum(lens[:i + 1]) - 1)
                del self._prefill_x[loop.slot]
            else:
                self._prefill_x[loop.slot] = x
        if not finals:
            return None
        f = len(finals)
        # lm_head on max_num_seqs rows whatever F is (the last final row repeated): one matmul shape.
        pad = self.config.max_num_seqs - f if self.config.batch_invariant else 0
        picks = np.array([last_rows + last_rows[-1:] * pad, [loops[i].slot for i in finals] + [-1] * pad],
                         dtype=np.int64)
        idx = to_device_async(picks, self.model.device)
        logits = self.model.logits(out[idx[0]])[:f]
        token = sample_greedy(logits)                                         # [F]
        slots = idx[1, :f]
        self.last_token[slots] = token
        self.out_tokens[slots, 0] = token
        self.n_out.index_fill_(0, slots, 1)           # a Python scalar via setitem would be a synchronising copy
        return finals, logits, token

    def prefill_rows(self, total: int) -> int:
        """Rows a packed prefill loop of ``total`` prompt rows runs on (graph or eager: the same shape). A
        batch-invariant engine whose prefill projections run as cuBLAS calls pads to whole calls of
        ``prefill_call_rows``; with the model's ``prefill_gemm`` (one launch each, a row's bits independent of
        the row count) it pads like any engine: to a graph bucket, or not at all when eager."""
        if self.config.batch_invariant and not self.model.prefill_gemm_on():
            return prefill_bucket_for(total, self.config.prefill_call_rows)
        return prefill_bucket_for(total) if self.graphs is not None else total

    def decode_rows(self, n: int) -> int:
        """Rows a decode step of n live rows runs on (graph or eager): max_num_seqs when batch-invariant,
        else its padded bucket (graphs) or n itself (eager)."""
        if self.config.batch_invariant:
            return self.config.max_num_seqs
        return self.graphs.bucket(n) if self.graphs is not None else n

    def prefill_core(self, x, row_slot, row_depth, positions, tiles):
        """One full-depth loop over packed prompts: x [T, hidden]; [T] int32 slot/depth/position per row
        (padding rows: slot -1); tiles [3, num_tiles] int32 query tiles (kernels/prefill_attention.py).
        Writes each row's K/V into its request's plane; returns (x_out [T, hidden],)."""
        kv, be, fused = self.kv, self.backend, self.fused_kv_write

        def attend(layer, q, k, v):
            if not fused:
                be.write_kv(kv.k[layer], kv.v[layer], k, v, kv.block_tables, row_slot, row_depth, positions)
            return packed_prefill_attention(q, k, v, tiles, block_m=PREFILL_BLOCK_M)

        gemm_rows = self.config.prefill_call_rows if self.config.batch_invariant else None
        rope_write = self._rope_write(row_slot, row_depth, positions) if fused else None
        return (self.model.run_loop(x, positions, attend, gemm_rows=gemm_rows, rope_write=rope_write)[0],)

    def _rope_write(self, row_slot, row_depth, row_pos) -> PagedRopeWrite:
        """The fused RoPE + KV write of one launch's rows (model.RopeWriteFn), Triton backend only."""
        return PagedRopeWrite(self.kv, self.model.cos, self.model.sin, row_slot, row_depth, row_pos,
                              self.model.cfg.num_attention_heads)

    # ------------------------------------------------------------------------------------- decode
    def decode(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One resident loop for the plan's decode rows (graph or eager; no host sync).
        Returns (exit [n] bool, token [n] int64, logits [n, vocab] or None (:meth:`decode_core`), triggered [n]
        bool) on the device."""
        n = len(plan.decode)
        bank = self.banks.acquire(self.decode_rows(n))
        host = bank.numpy()
        host[:, :n] = plan.rows.T           # one vectorised write into the (pinned) bank, not 5n setitems
        if self.graphs is not None:
            return self.graphs.run_decode(bank, host, n)
        host[:, n:] = PADDING_COLUMNS
        outs = self.decode_core(*self.banks.publish(bank))
        return outs if n == host.shape[1] else tuple(None if o is None else o[:n] for o in outs)

    def decode_core(self, row_slot, row_depth, row_pos, row_fa, row_forced):
        """One resident decode step for N rows, entirely on the device (no host sync; graph-capturable).

        Inputs: [N] int32 descriptor rows (slot, depth, position, first-alias, forced exit). Runs one
        recurrent-core loop, applies the exit rule (or the forced exits of ``replay``), samples greedy
        tokens for all rows and, for the exiting ones, updates the resident last token, output tokens and
        count, and publishes the exit (alias) or fills the skipped planes (native). Rows with slot < 0 are
        padding: they read and write only the scratch slot S and skip every KV write.
        Returns (exit [N] bool, token [N] int64, logits [N, vocab] or None (None where the step sampled from
        ``model.greedy_partials``: no keep_logits or trace_loops, the Triton backend, and lm_head on our GEMM
        with ``model.greedy_tiles``), triggered [N] bool: the delayed exit
        test held at this loop or an earlier one of the token, what ``ouro_delayed`` consumes next loop).
        """
        kv, be, cfg = self.kv, self.backend, self.config
        sl, x, s_prev, t_prev = self._gather_rows(row_slot, row_depth, self.last_token, self.model.embed,
                                                  self.hidden, self.survival, self.triggered)
        fused = self.fused_kv_write

        def attend(layer, q, k, v):
            if not fused:
                be.write_kv(kv.k[layer], kv.v[layer], k, v, kv.block_tables, row_slot, row_depth, row_pos)
            return be.decode_attention(q, kv.k[layer], kv.v[layer], kv.block_tables, row_slot, row_depth,
                                       row_pos, kv.exit_map, row_fa, layout=cfg.kv_layout,
                                       prefix_tiles=cfg.prefix_tiles, tile_size=cfg.tile_size)

        rope_write = self._rope_write(row_slot, row_depth, row_pos) if fused else None
        x_out, hazard = self.model.run_loop(x, row_pos, attend, rope_write=rope_write)
        exit_now, s, trig, row_max = self._exit_rule(hazard, row_depth, s_prev, t_prev, row_forced, sl)
        # The logits are written only when the engine reads them; else lm_head keeps each tile's maximum and
        # the apply kernel samples from those (the same token, bitwise; model.greedy_partials).
        # Only with the Triton slot-state kernels: their argmax counts NaN as +inf, as the tiles do, while the torch
        # path's torch.argmax takes the first NaN.
        head = None if cfg.keep_logits or cfg.trace_loops or not fused else self.model.greedy_partials(x_out)
        logits = self.model.logits(x_out) if head is None else None
        exit_now, exit_slot, tok = self._apply_rows(exit_now, logits if head is None else head, x_out, s, trig, sl,
                                                    row_slot, self.hidden, self.survival, self.triggered,
                                                    self.out_tokens, self.n_out, self.last_token)
        if cfg.kv_layout == KVLayout.ALIAS:
            be.publish_exits(kv.exit_map, exit_slot, row_pos, row_depth)
        else:
            be.native_fill(kv.k, kv.v, kv.block_tables, exit_slot, row_pos, row_depth, row_max)
        return exit_now, tok, logits, trig

    def _exit_rule(self, hazard, depth, s_prev, t_prev, forced, sl):
        """The policy's exit rule for the step's rows, and each row's max_loops (which the native fill reads): one
        launch (kernels/exit_rule.py, bitwise the policy's torch step) where the loop runs on Triton kernels, else
        the policy's ``device_step``. Returns (exit_now, S_r, triggered, max_loops) [N] each."""
        if self.fused_kv_write:
            return exit_rule.exit_rule(self.policy.name, hazard, depth, s_prev, t_prev, forced, sl, self.min_loops,
                                       self.max_loops, self.threshold)
        return (*self.policy.device_step(hazard, depth, s_prev, t_prev, forced, self, sl), self.max_loops[sl])

    def host_tokens(self, slot: int, n: int) -> torch.Tensor:
        """The slot's first n output tokens [n] int64 on the host; on CUDA an async copy into pinned memory
        (read it only after a device synchronisation)."""
        self.join_prefill()         # the slot's first token may come from a prefill loop still on its stream
        tokens = self.out_tokens[slot, :n]
        if tokens.is_cuda:
            host = torch.empty(n, dtype=torch.long, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            return host
        return tokens.clone()
