"""The one thread that owns the runtime engine behind the HTTP server.

The engine is not thread-safe and its step loop must not wait on the network, so exactly one thread
touches it: HTTP handlers (on the asyncio loop of uvicorn) hand it commands through a queue (``submit``,
``abort``), and it hands each request's events back to that asyncio loop with ``call_soon_threadsafe``.
Between commands it steps the engine while any request is unfinished and, after each step, sends every
request the tokens it gained (one event per token) and its end.

Events, in a request's own ``asyncio.Queue``: ``("accepted", None)`` once the engine queued it (or
``("rejected", message)`` when the engine refused it: a token id outside the vocabulary, a prompt too
long...), then ``("token", token_id)`` per output token, then ``("done", finish_reason)``; on an engine
failure every live request gets ``("error", message)`` and the process exits with status 70 (a crashed
server: its arm fails with the log's tail).

It knows the ``LoopEngine`` surface (``add_request``, ``abort``, ``step``, ``has_unfinished``,
``outputs``, ``reset_run``) and reads a running request's tokens so far from the runner's output buffer
(``runner.out_tokens[slot, :n_out]``), the only way the engine exposes tokens before a request ends.
"""
from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field

ENGINE_FAILED_EXIT = 70   # the server's exit status after an engine failure (EX_SOFTWARE)


@dataclass
class _Live:
    """A request the engine holds: where its events go and how many tokens it was sent."""

    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    sent: int = 0

    def post(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class LoopCounters:
    """What ``/health`` reports (requests since the server started)."""

    accepted: int = 0
    rejected: int = 0
    completed: int = 0
    aborted: int = 0
    steps: int = 0
    running: int = 0
    queued: int = 0
    free_slots: int = 0
    extra: dict = field(default_factory=dict)


class EngineLoop:
    """Owns ``engine`` on its own thread; ``submit``/``abort`` may be called from any thread."""

    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.counters = LoopCounters(free_slots=engine.config.max_num_seqs)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout_s)

    def submit(self, request, events: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> None:
        """Queue a runtime ``Request``; its events go to ``events`` on ``loop``."""
        self._commands.put(("add", request, _Live(events, loop)))

    def abort(self, request_id: str) -> None:
        """Abort a request (the client went away); its slot and KV blocks are freed. Unknown ids: no-op."""
        self._commands.put(("abort", request_id, None))

    # ------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self.engine.step()
                    self.counters.steps += 1
                    self._emit()
                elif not self._live:
                    self.engine.reset_run()   # drained: forget finished requests (bounded memory)
                self._count()
        except Exception as exc:   # an engine failure: every client hears it, then the server dies
            traceback.print_exc()
            for live in self._live.values():
                live.post("error", f"engine failed: {type(exc).__name__}: {exc}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ENGINE_FAILED_EXIT)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg, live: _Live | None) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except (ValueError, TypeError) as exc:
                self.counters.rejected += 1
                live.post("rejected", str(exc))
                return
            self.counters.accepted += 1
            self._live[arg.request_id] = live
            live.post("accepted", None)
        elif kind == "abort" and arg in self._live:
            self._live.pop(arg)
            try:
                self.engine.abort(arg)
            except ValueError:   # it finished in the step before: nothing left to free
                return
            self.counters.aborted += 1

    def _emit(self) -> None:
        """Send every live request its new tokens; end those that finished (one host read per step)."""
        sched = self.engine.scheduler
        queued = {q.request_id for q in sched.queue}
        finished, grown = [], []
        for rid, live in self._live.items():
            run = sched.running(rid)
            if run is not None and run.n_out > live.sent:
                grown.append((live, run))
            elif run is None and rid not in queued:
                finished.append(rid)
        if grown:   # [len(grown), max_model_len] int64 rows: one device read for the whole step
            rows = self.engine.runner.out_tokens[[run.slot for _, run in grown]].tolist()
            for (live, run), row in zip(grown, rows):
                for tok in row[live.sent:run.n_out]:
                    live.post("token", int(tok))
                live.sent = run.n_out
        if not finished:
            return
        outs = self.engine.outputs()
        for rid in finished:
            live, out = self._live.pop(rid), outs[rid]
            for tok in out.token_ids[live.sent:]:
                live.post("token", int(tok))
            live.post("done", out.finish_reason)
            self.counters.completed += 1

    def _count(self) -> None:
        sched = self.engine.scheduler
        c = self.counters
        c.running = sum(r is not None for r in sched.slots)
        c.queued = len(sched.queue)
        c.free_slots = len(sched.slots) - c.running
