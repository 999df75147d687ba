"""The looped runtime: a loop-level continuously batched engine over depth-aware paged KV.

Each :meth:`LoopEngine.step` runs ONE loop of the recurrent core for every resident row: rows at
different depths share one vectorised model call (Continuous Depth Batching, arXiv 2608.09444). A row
that exits goes through ``lm_head`` and greedy sampling; its next token restarts at depth 1. Prompts
are prefilled one full-depth loop per step (every loop runs for a prompt, BRIEF section 1), all prefilling
requests of a step packed into one launch sequence whatever their depths, so a request can be aborted
mid-prefill. A finished or aborted request frees its slot and blocks and the FIFO queue
refills the slot.

A step is plan -> run -> apply: the :class:`~.scheduler.Scheduler` decides on the host (a frozen
``StepPlan``), the :class:`~.runner.Runner` does the device work, and the engine applies the result to
the requests' host state and collects outputs. The engine knows token ids only: no tokenizer, no
Hydra, no timing. It runs on ``cpu`` or ``cuda`` alike. Resident per-slot state stays on the device;
the host keeps only positions, depths and counts. Nothing in a step waits for the device: host
decisions reach it through pinned async uploads, and the host plans step N+1 while the GPU runs step N.
Under ``replay`` and ``fixed`` the host knows every exit in advance; under ``ouro_delayed`` it learns a
step's exits from the previous step's gate, read back asynchronously; only ``ouro`` (and EOS detection)
reads the step just launched.
"""
from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from .api import EngineConfig, EngineStats, Request, RequestOutput, Setting, setting_value
from .descriptors import to_device_async
from .exit_policy import make_policy
from .kv_cache import DepthKVCache
from .model import OuroModel
from .runner import Runner
from .schedule import Schedule
from .scheduler import PrefillLoop, Running, Scheduler, StepPlan

__all__ = ["EngineConfig", "EngineStats", "LoopEngine", "Request", "RequestOutput"]


def _top2(logits: torch.Tensor) -> list[list[float]]:
    """The two largest logits of each row of [N, vocab] as host floats [N][2] (a sync)."""
    return logits.float().topk(2, dim=-1).values.double().tolist()


class LoopEngine:
    """Continuously batched looped decoding over ``max_num_seqs`` resident slots."""

    def __init__(self, model: OuroModel, config: EngineConfig):
        if not isinstance(model, OuroModel):
            raise TypeError(f"LoopEngine needs an OuroModel, got {type(model).__name__} {model!r}")
        if not isinstance(config, EngineConfig):
            raise TypeError(f"LoopEngine needs an EngineConfig, got {type(config).__name__} {config!r}")
        self.model, self.config = model, config
        cfg = model.cfg
        self.num_planes = cfg.total_ut_steps
        positions = min(cfg.max_position_embeddings, model.cos.shape[0])
        if config.max_model_len > positions:
            raise ValueError(f"EngineConfig.max_model_len={config.max_model_len} exceeds the model's "
                             f"{positions} rotary positions (max_position_embeddings="
                             f"{cfg.max_position_embeddings}, rope_len={model.cos.shape[0]})")
        if config.eos_token_id is not None and config.eos_token_id >= cfg.vocab_size:
            raise ValueError(f"EngineConfig.eos_token_id={config.eos_token_id} is outside the model's vocabulary "
                             f"[0, {cfg.vocab_size}): no request would ever stop at it")
        S = config.max_num_seqs
        max_blocks = -(-config.max_model_len // config.block_size)
        num_blocks = config.num_blocks or S * self.num_planes * max_blocks + 1
        self.kv = DepthKVCache(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.head_dim, num_planes=self.num_planes, max_num_seqs=S,
                               max_model_len=config.max_model_len, block_size=config.block_size,
                               num_blocks=num_blocks, device=model.device, dtype=model.dtype,
                               poison=config.poison_kv)
        self.stats = EngineStats(rows_per_depth=[0] * self.num_planes)
        self.policy = make_policy(config.exit_policy, config.schedule, config.eos_token_id, S)
        self.scheduler = Scheduler(config, self.kv, self.policy, vocab_size=cfg.vocab_size,
                                   num_planes=self.num_planes)
        self.runner = Runner(model, config, self.kv, self.policy, self.stats)
        self._finished: dict[str, tuple[Request, torch.Tensor | None, list[int], str]] = {}
        self._aborted = False
        self._run_start_step = 0        # stats.steps when the current run began (stats are cumulative)
        self.logits_log: dict[str, list[torch.Tensor]] = {}   # filled only with keep_logits
        # filled only with trace_loops: request id -> {"survival": per output token the S_r of each loop
        # it ran ([] for the first token: prefill runs every loop, no gate decides), "top2": per output
        # token the two largest logits it was sampled from}
        self.loop_trace: dict[str, dict[str, list[list[float]]]] = {}
        # An object with start() / stop(), called around each decode loop's device work (the harness's
        # roofline timer, harness/loop_timing.py); it must not synchronise. None: nothing is called.
        self.decode_timer = None

    # ----------------------------------------------------------------------------------- requests
    def add_request(self, req: Request) -> None:
        """Queue a request (FIFO). ValueError names the offending field."""
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its slot and blocks are reused safely (stream order)."""
        req = self.scheduler.take_queued(request_id)
        if req is not None:
            self._finished[request_id] = (req, None, [], "abort")
            self._aborted = True
            return
        run = self.scheduler.running(request_id)
        if run is None:
            raise ValueError(f"unknown or finished request {request_id!r}")
        self._aborted = True
        self._finish(run, "abort")

    def reset_run(self) -> None:
        """Forget finished requests so the same request ids can run again on this engine (the measured
        run after the warmup). Device buffers, KV allocations, graphs and cumulative stats are kept."""
        if self.has_unfinished():
            raise RuntimeError("reset_run needs a drained engine")
        self.scheduler.reset_run()
        self._finished.clear()
        self.logits_log.clear()
        self.loop_trace.clear()
        self._aborted = False
        self._run_start_step = self.stats.steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------- steps
    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; returns all outputs (one host sync at the end)."""
        while self.has_unfinished():
            self.step()
        return self.outputs()

    def step(self) -> None:
        """One engine step: grow KV for decode rows, admit, one packed prefill loop for every prefilling
        request, one recurrent-core loop for all decode rows. Raises OutOfBlocksError before doing any work
        when the pool cannot hold the running requests' next positions."""
        plan = self.scheduler.schedule()                      # plan: host decisions only
        self.runner.stage(plan.admitted)                      # run: async uploads, then launches
        for run in plan.admitted:
            self.stats.prefill_tokens += len(run.req.prompt_token_ids)
        if plan.prefill:
            self._apply_prefill(plan.prefill, self.runner.prefill(plan.prefill))
        if plan.decode:
            timer = self.decode_timer
            if timer is not None:
                timer.start()
            out = self.runner.decode(plan)
            if timer is not None:
                timer.stop()
            self._apply_decode(plan, out)
        self.runner.join_prefill()          # EngineConfig.prefill_stream: the next step sees this step's prefill
        self.stats.steps += 1
        self.stats.peak_kv_blocks = self.kv.allocator.peak_used

    def _apply_prefill(self, loops: tuple[PrefillLoop, ...],
                       first: tuple[list[int], torch.Tensor, torch.Tensor] | None) -> None:
        """After a packed prefill loop: each request goes one loop deeper, or (its final loop) takes its
        first token and enters the decode phase."""
        runs = [self.scheduler.slots[loop.slot] for loop in loops]
        finals, logits, tokens = first if first is not None else ([], None, None)
        for run in runs:
            self.stats.prefill_rows += len(run.req.prompt_token_ids)
        for i, run in enumerate(runs):
            if i not in finals:
                run.depth += 1
        if not finals:
            return
        done = [runs[i] for i in finals]
        host = any(self.policy.needs_host_tokens(r.req) for r in done)
        if self.config.keep_logits or self.config.trace_loops or host:
            self.runner.join_prefill()      # these read the logits or tokens on this stream (or the host) now
        self._keep_logits(done, logits)
        if self.config.trace_loops:
            for run, top in zip(done, _top2(logits)):
                self.loop_trace[run.req.request_id] = {"survival": [[]], "top2": [top]}
        for j, run in enumerate(done):
            T = len(run.req.prompt_token_ids)
            run.exit_depths.append(loops[finals[j]].depth)
            run.n_out, run.phase, run.depth, run.pos = 1, "decode", 1, T
            if host and self.policy.needs_host_tokens(run.req):
                run.host_tokens.append(int(tokens[j]))        # EOS must be seen: a sync, only then
            self._after_token(run)

    def _apply_decode(self, plan: StepPlan, out: tuple[torch.Tensor, ...]) -> None:
        """After a decode loop: exiting rows take their token and restart at depth 1, the rest go deeper."""
        exit_flags, tok, logits, triggered = out
        rows = plan.decode
        for r in rows:
            self.stats.rows_per_depth[r.depth - 1] += 1
        self.stats.decode_steps += 1
        exits = self.policy.exits_after_step(plan, exit_flags, triggered)   # natural policies: the gate
        if self.config.trace_loops:
            self._trace_decode(rows, exits, logits)
        ex = [i for i, e in enumerate(exits) if e]
        exr = [rows[i] for i in ex]
        host_tokens = any(self.policy.needs_host_tokens(r.req) for r in exr)
        if ex and (self.config.keep_logits or host_tokens):
            idx = to_device_async(np.array(ex, dtype=np.int64), self.model.device)
            if self.config.keep_logits:
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

    def _trace_decode(self, rows: list[Running], exits: list[bool], logits: torch.Tensor) -> None:
        """``trace_loops``: append each row's S_r after this loop, and the top-2 logits of exiting rows
        (one device read per step; rows still hold the depth they just ran)."""
        slots = to_device_async(np.array([r.slot for r in rows], dtype=np.int64), self.model.device)
        survival = self.runner.survival[slots].double().tolist()
        for r, s, e, top in zip(rows, survival, exits, _top2(logits)):
            trace = self.loop_trace[r.req.request_id]
            if r.depth == 1:
                trace["survival"].append([])
            trace["survival"][-1].append(s)
            if e:
                trace["top2"].append(top)

    def _keep_logits(self, runs: list[Running], logits: torch.Tensor) -> None:
        if self.config.keep_logits:
            for r, row in zip(runs, logits):
                self.logits_log.setdefault(r.req.request_id, []).append(row.detach().clone())

    def _after_token(self, run: Running) -> None:
        if run.n_out >= run.req.max_tokens:
            self._finish(run, "length")
        elif self.policy.stops(run):       # EOS (natural), or the end of the schedule's entry (replay)
            self._finish(run, "stop")

    def _finish(self, run: Running, reason: str) -> None:
        host = self.runner.host_tokens(run.slot, run.n_out)
        self._finished[run.req.request_id] = (run.req, host, list(run.exit_depths), reason)
        self.scheduler.free(run)
        self.runner.release(run.slot)

    # -------------------------------------------------------------------------------------- results
    def outputs(self) -> dict[str, RequestOutput]:
        """Outputs of every finished request (synchronises the device once)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.policy.drain()
        out = {}
        for rid, (req, host, exits, reason) in self._finished.items():
            toks = tuple(host.tolist()) if host is not None else ()
            out[rid] = RequestOutput(rid, toks, tuple(exits), reason)
        return out

    def settings(self) -> dict[str, Setting]:
        """What this engine resolved and runs with, as a flat dict of JSON scalars (runtime/api.py
        ``setting_value``; the harness records it beside each measured run, a raw record's ``engine_settings``):

        - every :class:`EngineConfig` field by its name but ``schedule`` (the value given or its default, as the
          field's comment says: ``num_blocks`` None, ``prefill_gemm_rows`` None where nothing was given);
        - ``schedule_sha256``: ``Schedule.sha256`` of the replayed schedule (sha256 of its ``to_json()``, the
          bytes of a bundle's frozen reference), None without one;
        - ``prefill_call_rows``: rows of each batch-invariant prefill projection call
          (``EngineConfig.prefill_call_rows``); ``kv_num_blocks``: KV blocks in the pool, block 0 reserved
          (``num_blocks``, or as resolved from ``max_num_seqs``, the planes and ``max_model_len``);
        - ``prefill_on_own_stream``: a step's prefill loop runs on its own CUDA stream beside the decode loop
          (``Runner.prefill_on_own_stream``: ``prefill_stream``, CUDA, the Triton backend, and the model's
          ``norm_in_gemm`` off), as resolved now;
        - ``fused_kv_write``: RoPE and the KV write run in one launch per layer (a fused model, the Triton backend);
        - ``model_<key>`` for each key of the model's :meth:`OuroModel.settings` (its device, dtype and switches).
        """
        cfg = self.config
        out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "schedule"}
        out.update(schedule_sha256=None if cfg.schedule is None else cfg.schedule.sha256,
                   prefill_call_rows=cfg.prefill_call_rows, kv_num_blocks=self.kv.allocator.num_blocks,
                   prefill_on_own_stream=self.runner.prefill_on_own_stream, fused_kv_write=self.runner.fused_kv_write)
        out.update({f"model_{k}": v for k, v in self.model.settings().items()})
        return {k: setting_value(k, v) for k, v in out.items()}

    @property
    def trace_sha256(self) -> str:
        """Hash of the admission and row trace so far (which rows ran, at which depth, in which order)."""
        return self.scheduler.trace_sha256

    def capture_schedule(self) -> Schedule:
        """Freeze this engine's finished natural run as a :class:`Schedule`."""
        if self.has_unfinished():
            raise RuntimeError("capture_schedule needs a drained engine")
        if self._aborted:
            raise RuntimeError("a run with aborted requests cannot be frozen as a schedule")
        outs = self.outputs()
        runs = [(self._finished[rid][0], outs[rid]) for rid in self.scheduler.admission_order]
        return Schedule.from_run(runs, max_num_seqs=self.config.max_num_seqs,
                                 num_steps=self.stats.steps - self._run_start_step,
                                 trace_sha256=self.trace_sha256)
