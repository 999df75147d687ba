"""The looped runtime: a loop-level continuously batched engine over depth-aware paged KV.

Each :meth:`LoopEngine.step` runs ONE loop of the recurrent core for every resident row: rows at
different depths share one vectorised model call (Continuous Depth Batching, arXiv 2608.09444). A row
that exits goes through ``lm_head`` and greedy sampling; its next token restarts at depth 1. Prompts
are prefilled one full-depth loop per step (every loop runs for a prompt, BRIEF section 1), so a request
can be aborted mid-prefill. A finished or aborted request frees its slot and blocks and the FIFO queue
refills the slot.

The engine knows token ids only: no tokenizer, no Hydra, no timing. It runs on ``cpu`` or ``cuda``
alike. Resident per-slot state (hidden state, last token, output tokens, exit-rule state, block
tables, exit map) stays on the device; the host keeps only positions, depths and counts. Under the
``replay`` policy the host knows every exit in advance and never reads device values inside a step;
natural policies read the exit flags once per step.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from loopbench.kernels.prefill_attention import prefill_attention

from .api import EngineConfig, EngineStats, Request, RequestOutput
from .attention import get_backend
from .exit_policy import exit_step
from .graphs import GraphCache, bucket_for
from .kv_cache import DepthKVCache, OutOfBlocksError
from .model import OuroModel
from .schedule import Schedule, ScheduledRequest, prompt_sha256


@dataclass
class _Running:
    """Host-side state of a resident request."""

    req: Request
    slot: int
    entry: ScheduledRequest | None
    phase: str = "prefill"
    depth: int = 1                    # the loop this request runs next
    pos: int = 0                      # decode: position of the token being computed
    n_out: int = 0
    exit_depths: list[int] = field(default_factory=list)
    host_tokens: list[int] = field(default_factory=list)   # only filled when EOS must be detected
    first_alias: dict[int, int] = field(default_factory=dict)  # depth -> first position with e_p < depth
    prefill_x: torch.Tensor | None = None


class LoopEngine:
    """Continuously batched looped decoding over ``max_num_seqs`` resident slots."""

    def __init__(self, model: OuroModel, config: EngineConfig):
        self.model, self.config = model, config
        cfg, dev = model.cfg, model.device
        self.num_planes = cfg.total_ut_steps
        positions = min(cfg.max_position_embeddings, model.cos.shape[0])
        if config.max_model_len > positions:
            raise ValueError(f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                             f"{positions} rotary positions (max_position_embeddings="
                             f"{cfg.max_position_embeddings}, rope_len={model.cos.shape[0]})")
        self.backend = get_backend(config.attention_backend)
        S = config.max_num_seqs
        max_blocks = -(-config.max_model_len // config.block_size)
        num_blocks = config.num_blocks or S * self.num_planes * max_blocks + 1
        self.kv = DepthKVCache(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.head_dim, num_planes=self.num_planes, max_num_seqs=S,
                               max_model_len=config.max_model_len, block_size=config.block_size,
                               num_blocks=num_blocks, device=dev, dtype=model.dtype, poison=config.poison_kv)
        acc = model.rope_dtype
        # Resident per-slot state; row S is a scratch slot that padding rows of a bucket read and write.
        self.hidden = torch.zeros((S + 1, cfg.hidden_size), device=dev, dtype=model.dtype)
        self.last_token = torch.zeros(S + 1, dtype=torch.long, device=dev)
        self.out_tokens = torch.zeros((S + 1, config.max_model_len), dtype=torch.long, device=dev)
        self.n_out = torch.zeros(S + 1, dtype=torch.long, device=dev)
        self.survival = torch.ones(S + 1, dtype=acc, device=dev)
        self.triggered = torch.zeros(S + 1, dtype=torch.bool, device=dev)
        self.min_loops = torch.ones(S + 1, dtype=torch.int32, device=dev)
        self.max_loops = torch.ones(S + 1, dtype=torch.int32, device=dev)
        self.threshold = torch.ones(S + 1, dtype=acc, device=dev)
        self.stats = EngineStats(rows_per_depth=[0] * self.num_planes)
        self.banks = DescriptorBanks(S, dev, config.descriptor_mode)
        self._graphs = self._prefill_graphs = None
        if config.cuda_graphs:
            if dev.type != "cuda":
                raise ValueError(f"cuda_graphs=True needs a CUDA model, got device {dev}")
            if config.attention_backend != "triton":
                raise ValueError("cuda_graphs=True needs attention_backend='triton' (the torch backend syncs)")
            self._graphs = GraphCache(self._core, config.graph_cache_size, self.stats.decode_graphs)
            self._prefill_graphs = GraphCache(self._prefill_core, config.graph_cache_size, self.stats.prefill_graphs,
                                              name="prefill")
            self._static_desc: dict[int, torch.Tensor] = {}
            self._static_prefill: dict[int, tuple] = {}
        self._queue: list[Request] = []
        self._ids: set[str] = set()
        self._slots: list[_Running | None] = [None] * S
        self._finished: dict[str, tuple[Request, object, list[int], str]] = {}
        self._admitted: list[str] = []
        self._aborted = False
        self._trace = hashlib.sha256()
        self.logits_log: dict[str, list[torch.Tensor]] = {}   # filled only with keep_logits

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, req: Request) -> None:
        """Queue a request (FIFO). ValueError names the offending field."""
        cfg = self.model.cfg
        if req.request_id in self._ids:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r}: empty prompt")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"request {req.request_id!r}: token id {bad[0]} outside [0, {cfg.vocab_size})")
        if not 1 <= req.min_loops <= req.max_loops <= self.num_planes:
            raise ValueError(f"request {req.request_id!r}: need 1 <= min_loops ({req.min_loops}) <= max_loops "
                             f"({req.max_loops}) <= total_ut_steps ({self.num_planes})")
        need = len(req.prompt_token_ids) + req.max_tokens - 1
        if need > self.config.max_model_len:
            raise ValueError(f"request {req.request_id!r}: prompt + max_tokens - 1 = {need} positions exceed "
                             f"max_model_len={self.config.max_model_len}")
        if not req.ignore_eos and self.config.eos_token_id is None and self.config.exit_policy != "replay":
            raise ValueError(f"request {req.request_id!r}: ignore_eos=False needs EngineConfig.eos_token_id")
        if self.config.schedule is not None:
            self.config.schedule.check_fits(req)
        self._ids.add(req.request_id)
        self._queue.append(req)

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its slot and blocks are reused safely (stream order)."""
        for i, r in enumerate(self._queue):
            if r.request_id == request_id:
                del self._queue[i]
                self._finished[request_id] = (r, None, [], "abort")
                self._aborted = True
                return
        for run in self._slots:
            if run is not None and run.req.request_id == request_id:
                self._aborted = True
                self._finish(run, "abort")
                return
        raise ValueError(f"unknown or finished request {request_id!r}")

    def reset_run(self) -> None:
        """Forget finished requests so the same request ids can run again on this engine (the measured
        run after the warmup). Device buffers, KV allocations, graphs and cumulative stats are kept."""
        if self.has_unfinished():
            raise RuntimeError("reset_run needs a drained engine")
        self._ids.clear()
        self._finished.clear()
        self._admitted.clear()
        self.logits_log.clear()
        self._aborted = False
        self._trace = hashlib.sha256()

    def has_unfinished(self) -> bool:
        return bool(self._queue) or any(r is not None for r in self._slots)

    # --------------------------------------------------------------------------------------- steps
    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; returns all outputs (one host sync at the end)."""
        while self.has_unfinished():
            self.step()
        return self.outputs()

    def step(self) -> None:
        """One engine step: grow KV for decode rows, admit, one prefill loop per prefilling request,
        one recurrent-core loop for all decode rows. Raises OutOfBlocksError before doing any work
        when the pool cannot hold the running requests' next positions."""
        decode_rows = [r for r in self._slots if r is not None and r.phase == "decode"]
        growing = [r for r in decode_rows if r.depth == 1]
        need = sum(self.kv.new_blocks_needed(r.slot, r.pos + 1) for r in growing)
        if need > self.kv.allocator.num_free:
            raise OutOfBlocksError(
                f"the running requests {[r.req.request_id for r in growing]} need {need} more KV blocks, "
                f"{self.kv.allocator.num_free} of {self.kv.allocator.num_blocks} are free: raise "
                f"EngineConfig.num_blocks or lower max_num_seqs")
        for r in growing:
            self.kv.ensure_capacity(r.slot, r.pos + 1)
        self._admit()
        live = [r for r in self._slots if r is not None]
        for r in live:
            if r.phase == "prefill":
                self._prefill_loop(r)
        if decode_rows:
            self._decode_loop(decode_rows)
        self.stats.steps += 1
        self.stats.peak_kv_blocks = self.kv.allocator.peak_used

    def _admit(self) -> None:
        for slot in range(self.config.max_num_seqs):
            if not self._queue:
                return
            if self._slots[slot] is None:
                req = self._queue[0]
                T = len(req.prompt_token_ids)
                need = self.kv.blocks_for(T) * req.max_loops
                if need > self.kv.allocator.num_free:
                    if any(r is not None for r in self._slots):
                        return              # FIFO: wait until a running request frees blocks
                    raise OutOfBlocksError(
                        f"request {req.request_id!r} needs {need} KV blocks for its {T}-token prompt, the pool "
                        f"has {self.kv.allocator.num_free} free of {self.kv.allocator.num_blocks}: raise "
                        f"EngineConfig.num_blocks")
                self._queue.pop(0)
                entry = self.config.schedule.check_fits(req) if self.config.schedule else None
                run = _Running(req=req, slot=slot, entry=entry)
                self.kv.open_slot(slot, req.max_loops, T, prompt_exit_depth=req.max_loops)
                ids = torch.tensor(req.prompt_token_ids, dtype=torch.long).to(self.model.device)
                self.min_loops[slot], self.max_loops[slot] = req.min_loops, req.max_loops
                self.threshold[slot] = req.exit_threshold
                run.prefill_x = self.model.embed[ids]
                self._slots[slot] = run
                self._admitted.append(req.request_id)
                self.stats.prefill_tokens += T
                self._trace.update(f"A{slot}:{req.request_id!r};".encode())

    def _prefill_loop(self, run: _Running) -> None:
        """One full-depth loop over the whole prompt at depth ``run.depth``; KV into that plane."""
        T, d, dev = len(run.req.prompt_token_ids), run.depth, self.model.device
        if self._prefill_graphs is None:
            positions = torch.arange(T, device=dev, dtype=torch.int32)
            row_slot = torch.full((T,), run.slot, dtype=torch.int32, device=dev)
            row_depth = torch.full((T,), d, dtype=torch.int32, device=dev)
            run.prefill_x = self._prefill_core(run.prefill_x, row_slot, row_depth, positions)[0]
        else:
            static = self._static_prefill.get(T)
            if static is None:
                static = (torch.empty_like(run.prefill_x), torch.empty(T, dtype=torch.int32, device=dev),
                          torch.empty(T, dtype=torch.int32, device=dev),
                          torch.arange(T, device=dev, dtype=torch.int32))
                self._static_prefill[T] = static
            x_in = run.prefill_x

            def publish():
                static[0].copy_(x_in)
                static[1].fill_(run.slot)
                static[2].fill_(d)

            run.prefill_x = self._prefill_graphs.run(T, static, publish, warm_inputs=publish)[0].clone()
        self.stats.prefill_rows += T
        self._trace.update(f"P{run.slot}:{d};".encode())
        if d < run.req.max_loops:
            run.depth += 1
            return
        logits = self.model.logits(run.prefill_x[-1:])
        self._keep_logits([run], logits)
        token = logits.argmax(-1)                                           # [1]
        self.last_token[run.slot] = token[0]
        self.out_tokens[run.slot, 0] = token[0]
        self.n_out[run.slot] = 1
        run.prefill_x = None
        run.exit_depths.append(d)
        run.n_out, run.phase, run.depth, run.pos = 1, "decode", 1, T
        if self._needs_host_tokens(run):
            run.host_tokens.append(int(token[0]))
        self._after_token(run)

    def _prefill_core(self, x, row_slot, row_depth, positions):
        """One full-depth loop over a prompt: x [T, hidden]; [T] int32 slot/depth/positions.
        Writes the prompt's K/V into the depth's plane; returns (x_out [T, hidden],)."""
        kv, be = self.kv, self.backend

        def attend(layer, q, k, v):
            be.write_kv(kv.k[layer], kv.v[layer], k, v, kv.block_tables, row_slot, row_depth, positions)
            return prefill_attention(q, k, v)

        return (self.model.run_loop(x, positions, attend)[0],)

    def _decode_loop(self, rows: list[_Running]) -> None:
        """Write the step descriptor, run one resident loop (graph or eager), update host state."""
        cfg, n = self.config, len(rows)
        replay = cfg.exit_policy == "replay"
        forced = [r.depth == r.entry.exit_depths[r.n_out] for r in rows] if replay else [False] * n
        bucket = n if self._graphs is None else bucket_for(n, cfg.max_num_seqs)
        bank = self.banks.acquire(bucket)
        host = bank.numpy()                  # one vectorised write into the (pinned) bank, not 5n setitems
        host[:, :n] = np.array([(r.slot, r.depth, r.pos, min(r.first_alias.get(r.depth, r.pos + 1), r.pos + 1),
                                 f) for r, f in zip(rows, forced)], dtype=np.int32).T
        if self._graphs is None:
            exit_flags, tok, logits = self._core(*self.banks.publish(bank))
        else:
            host[:, n:] = np.array(PADDING_ROW, dtype=np.int32)[:, None]
            static = self._static_desc.get(bucket)
            if static is None:
                static = self._static_desc[bucket] = torch.empty((DESC_ROWS, bucket), dtype=torch.int32,
                                                                  device=self.model.device)
            exit_flags, tok, logits = self._graphs.run(
                bucket, tuple(static), publish=lambda: self.banks.publish(bank, into=static),
                warm_inputs=lambda: static.copy_(torch.tensor(PADDING_ROW, dtype=torch.int32)[:, None]))
        for r in rows:
            self.stats.rows_per_depth[r.depth - 1] += 1
        self.stats.decode_steps += 1
        self._trace.update(("D" + ",".join(f"{r.slot}:{r.depth}:{r.pos}" for r in rows) + ";").encode())

        exits = forced if replay else exit_flags[:n].tolist()       # natural policies read the gate
        ex = [i for i, e in enumerate(exits) if e]
        exr = [rows[i] for i in ex]
        host_tokens = any(self._needs_host_tokens(r) for r in exr)
        if ex and (cfg.keep_logits or host_tokens):
            idx = torch.tensor(ex, dtype=torch.long, device=self.model.device)
            self._keep_logits(exr, logits[idx])
            if host_tokens:
                for r, t in zip(exr, tok[idx].tolist()):
                    r.host_tokens.append(t)
        for i, r in enumerate(rows):
            if exits[i]:
                r.exit_depths.append(r.depth)
                r.n_out += 1
                self.stats.decode_tokens += 1
                for d in range(r.depth + 1, r.req.max_loops + 1):
                    r.first_alias.setdefault(d, r.pos)
                r.pos, r.depth = r.pos + 1, 1
                self._after_token(r)
            else:
                if r.depth >= r.req.max_loops:
                    raise RuntimeError(f"request {r.req.request_id!r} ran past max_loops={r.req.max_loops}")
                r.depth += 1

    def _core(self, row_slot, row_depth, row_pos, row_fa, row_forced):
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
        if cfg.exit_policy == "replay":
            exit_now, s, trig = row_forced > 0, s_prev * (1.0 - hazard), t_prev
        else:
            exit_now, s, trig = exit_step(cfg.exit_policy, hazard, row_depth, s_prev, t_prev,
                                          self.min_loops[sl], self.max_loops[sl], self.threshold[sl])
        exit_now = exit_now & valid
        logits = self.model.logits(x_out)
        tok = logits.argmax(-1)
        self.hidden.index_copy_(0, sl, x_out)
        self.survival.index_copy_(0, sl, s)
        self.triggered.index_copy_(0, sl, trig)
        n = self.n_out[sl]
        self.out_tokens[sl, n] = torch.where(exit_now, tok, self.out_tokens[sl, n])
        self.last_token.index_copy_(0, sl, torch.where(exit_now, tok, self.last_token[sl]))
        self.n_out.index_copy_(0, sl, n + exit_now.long())
        exit_slot = torch.where(exit_now, row_slot, -1).to(torch.int32)
        if cfg.kv_layout == "alias":
            be.publish_exits(kv.exit_map, exit_slot, row_pos, row_depth)
        else:
            be.native_fill(kv.k, kv.v, kv.block_tables, exit_slot, row_pos, row_depth,
                           self.max_loops[sl])
        return exit_now, tok, logits

    def _keep_logits(self, runs: list[_Running], logits: torch.Tensor) -> None:
        if self.config.keep_logits:
            for r, row in zip(runs, logits):
                self.logits_log.setdefault(r.req.request_id, []).append(row.detach().clone())

    def _needs_host_tokens(self, run: _Running) -> bool:
        return not run.req.ignore_eos and self.config.exit_policy != "replay"

    def _after_token(self, run: _Running) -> None:
        if run.n_out >= run.req.max_tokens:
            self._finish(run, "length")
        elif self._needs_host_tokens(run) and run.host_tokens[-1] == self.config.eos_token_id:
            self._finish(run, "stop")
        elif run.entry is not None and run.n_out >= len(run.entry.exit_depths):
            self._finish(run, "stop")     # the natural run stopped here (EOS) and the replay follows it

    def _finish(self, run: _Running, reason: str) -> None:
        tokens = self.out_tokens[run.slot, :run.n_out]
        if tokens.is_cuda:
            host = torch.empty(run.n_out, dtype=torch.long, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
        else:
            host = tokens.clone()
        self._finished[run.req.request_id] = (run.req, host, list(run.exit_depths), reason)
        self.kv.close_slot(run.slot)
        self._slots[run.slot] = None

    # -------------------------------------------------------------------------------------- results
    def outputs(self) -> dict[str, RequestOutput]:
        """Outputs of every finished request (synchronises the device once)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        out = {}
        for rid, (req, host, exits, reason) in self._finished.items():
            toks = tuple(host.tolist()) if host is not None else ()
            out[rid] = RequestOutput(rid, toks, tuple(exits), reason)
        return out

    @property
    def trace_sha256(self) -> str:
        """Hash of the admission and row trace so far (which rows ran, at which depth, in which order)."""
        return self._trace.copy().hexdigest()

    def capture_schedule(self) -> Schedule:
        """Freeze this engine's finished natural run as a :class:`Schedule`."""
        if self.has_unfinished():
            raise RuntimeError("capture_schedule needs a drained engine")
        if self._aborted:
            raise RuntimeError("a run with aborted requests cannot be frozen as a schedule")
        outs = self.outputs()
        reqs = []
        for rid in self._admitted:
            req = self._finished[rid][0]
            o = outs[rid]
            reqs.append(ScheduledRequest(request_id=rid, prompt_sha256=prompt_sha256(req.prompt_token_ids),
                            prompt_len=len(req.prompt_token_ids), max_tokens=req.max_tokens,
                            min_loops=req.min_loops, max_loops=req.max_loops, exit_threshold=req.exit_threshold,
                            token_ids=o.token_ids, exit_depths=o.exit_depths))
        return Schedule(version=Schedule.FORMAT_VERSION, max_num_seqs=self.config.max_num_seqs,
                        admission_order=tuple(self._admitted), requests=tuple(reqs),
                        num_steps=self.stats.steps, trace_sha256=self.trace_sha256)


DESC_ROWS = 5                      # slot, depth, position, first-alias, forced exit
PADDING_ROW = (-1, 1, 0, 1, 0)     # a padding row: scratch slot, depth 1, position 0, no exit


class DescriptorBanks:
    """A ring of host descriptor banks ([DESC_ROWS, max_num_seqs] int32: slot, depth, position, first-alias, forced exit).

    On CUDA the banks are pinned; a bank is rewritten only after the GPU has finished reading it (an
    event recorded after its read, waited on before reuse), so the host can run ahead of the GPU
    without a device-wide sync. ``h2d`` moves a bank with an async copy engine transfer; ``mapped``
    has a device kernel read the pinned bank directly (zero-copy through unified addressing).
    """

    def __init__(self, max_num_seqs: int, device: torch.device, mode: str, num_banks: int = 4):
        self.device, self.mode = device, mode
        cuda = device.type == "cuda"
        self.banks = [torch.zeros(DESC_ROWS * max_num_seqs, dtype=torch.int32, pin_memory=cuda)
                      for _ in range(num_banks)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(num_banks)]
        self.pending = [False] * num_banks
        self.i = -1
        self.waits = 0          # times the host found a bank still in use by the GPU

    def acquire(self, cols: int) -> torch.Tensor:
        """Next bank as a contiguous [DESC_ROWS, cols] view, once the GPU no longer reads it."""
        self.i = (self.i + 1) % len(self.banks)
        if self.pending[self.i]:
            if not self.events[self.i].query():
                self.waits += 1
                self.events[self.i].synchronize()
            self.pending[self.i] = False
        return self.banks[self.i][:DESC_ROWS * cols].view(DESC_ROWS, cols)

    def publish(self, src: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Make the bank view ``src`` [DESC_ROWS, n] visible on the device (into ``into`` if given)."""
        n = src.shape[1]
        if self.device.type != "cuda":
            return src.clone() if into is None else into.copy_(src)
        dst = into if into is not None else torch.empty((DESC_ROWS, n), dtype=torch.int32, device=self.device)
        if self.mode == "mapped":
            from loopbench.kernels.descriptor import copy_mapped
            copy_mapped(src, dst)
        else:
            dst.copy_(src, non_blocking=True)
        self.events[self.i].record()
        self.pending[self.i] = True
        return dst
