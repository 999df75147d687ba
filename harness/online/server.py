"""A streaming HTTP server around one runtime engine: a starlette ASGI app under uvicorn.

    python -m loopbench.harness.online.server SPEC.json

``SPEC.json`` (written by harness/online/arms.py): ``checkpoint_path``, ``dtype``, ``device`` (a job's
device entry), ``arm_config`` (a plan arm), ``max_num_seqs``, ``max_model_len``, ``policy`` (the natural
exit policy), ``exit`` (min_loops, max_loops, threshold), ``host`` and ``port_file``. The server binds
``host`` on a free port, writes the port number into ``port_file`` once it listens, and serves:

- ``GET /health``: 200 ``{"status": "ok", ...counters}`` (requests accepted, completed, aborted; slots
  running and free);
- ``GET /settings``: 200 ``{"engine_settings": ...}``, what the served engine resolved and runs with
  (harness/engines.py ``engine_settings``: a flat object of JSON scalars, null for an engine without
  ``settings()``), read and checked once when the app is made, before any request (settings do not change
  with a run); the online runner writes it into each raw online record (bundle format 10);
- ``POST /v1/completions``: an OpenAI-style completion over token ids. Body: ``prompt`` (a non-empty
  list of token ids), ``max_tokens`` (int >= 1), optional ``ignore_eos`` (bool; default false, true for
  an engine without EOS), ``stream`` (bool, default false), ``model`` (ignored). Greedy only, so any
  other field is refused. Without ``stream``: one JSON object, ``choices[0].token_ids`` and ``finish_reason``; with it,
  server-sent events ``data: {...}`` with one token id each in ``choices[0].token_ids``, a last event
  with ``finish_reason``, then ``data: [DONE]``. A bad request gets 400 (422 for a body that is not
  JSON) with ``{"error": {"message": ...}}`` naming the bad field; a client that disconnects aborts its
  request, which frees its slot.

One engine-loop thread (harness/online/engine_loop.py) owns the engine; handlers only talk to it.
SIGTERM / SIGINT stop uvicorn gracefully; an engine failure ends the process with status 70.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import numbers
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..engines import engine_settings
from .engine_loop import EngineLoop

FIELDS = {"prompt", "max_tokens", "ignore_eos", "stream", "model"}
DISCONNECT_POLL_S = 0.05


class BadRequest(ValueError):
    """A request body the server refuses; the message names the field."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def parse_body(body, has_eos: bool) -> dict:
    """The checked fields of a completion request body; BadRequest naming the first bad one.
    ``ignore_eos`` defaults to false where the engine has an EOS token (``has_eos``), else to true."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unsupported field(s) {unknown}: this server takes {sorted(FIELDS)} (greedy decoding)")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        raise BadRequest(f"'prompt' must be a non-empty list of token ids (ints), got {prompt!r:.80}")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    for name in ("ignore_eos", "stream"):
        if not isinstance(body.get(name, False), bool):
            raise BadRequest(f"'{name}' must be true or false, got {body[name]!r}")
    return {"prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
            "ignore_eos": body.get("ignore_eos", not has_eos), "stream": body.get("stream", False)}


def make_app(engine, exit_conf: dict, model_name: str = "loopbench") -> Starlette:
    """The ASGI app serving ``engine`` (a ``LoopEngine``); ``exit_conf``: min_loops, max_loops, threshold."""
    from loopbench.runtime.api import Request

    reported = engine_settings(engine)   # refused here, before the server listens, when not JSON scalars
    loop_thread = EngineLoop(engine)
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(app):
        loop_thread.start()
        yield
        loop_thread.stop()

    async def health(request: HTTPRequest) -> JSONResponse:
        c = loop_thread.counters
        return JSONResponse({"status": "ok", "accepted": c.accepted, "rejected": c.rejected,
                             "completed": c.completed, "aborted": c.aborted, "running": c.running,
                             "queued": c.queued, "free_slots": c.free_slots, "steps": c.steps})

    async def settings(request: HTTPRequest) -> JSONResponse:
        return JSONResponse({"engine_settings": reported})

    async def completions(request: HTTPRequest):
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(422, f"the body is not JSON: {exc}")
        try:
            fields = parse_body(body, engine.config.eos_token_id is not None)
            rid = f"cmpl-{next(ids)}"
            req = Request(request_id=rid, prompt_token_ids=tuple(fields["prompt"]), max_tokens=fields["max_tokens"],
                          min_loops=exit_conf["min_loops"], max_loops=exit_conf["max_loops"],
                          exit_threshold=exit_conf["threshold"], ignore_eos=fields["ignore_eos"])
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        events: asyncio.Queue = asyncio.Queue()
        loop_thread.submit(req, events, asyncio.get_running_loop())
        kind, value = await events.get()
        if kind != "accepted":
            return _error(400, value) if kind == "rejected" else _error(500, value)
        created = int(time.time())
        if fields["stream"]:
            return StreamingResponse(_sse(rid, created, model_name, events, loop_thread),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(request, rid, created, model_name, len(fields["prompt"]), events, loop_thread)

    return Starlette(routes=[Route("/health", health, methods=["GET"]),
                             Route("/settings", settings, methods=["GET"]),
                             Route("/v1/completions", completions, methods=["POST"])], lifespan=lifespan)


def _chunk(rid: str, created: int, model: str, token_ids: list[int], finish_reason) -> str:
    return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [{"index": 0, "text": "", "token_ids": token_ids,
                                               "finish_reason": finish_reason}]}) + "\n\n"


async def _sse(rid: str, created: int, model: str, events: asyncio.Queue, loop_thread: EngineLoop):
    """One event per token, then the finish reason and ``[DONE]``; a disconnect (the generator is
    cancelled or closed) aborts the request."""
    done = False
    try:
        while True:
            kind, value = await events.get()
            if kind == "token":
                yield _chunk(rid, created, model, [value], None)
            elif kind == "done":
                done = True
                yield _chunk(rid, created, model, [], value)
                yield "data: [DONE]\n\n"
                return
            else:
                done = True
                yield "data: " + json.dumps({"error": {"message": value}}) + "\n\n"
                return
    finally:
        if not done:
            loop_thread.abort(rid)


async def _whole(request: HTTPRequest, rid: str, created: int, model: str, prompt_len: int,
                 events: asyncio.Queue, loop_thread: EngineLoop) -> JSONResponse:
    """Wait for the whole completion, watching for the client going away (then abort)."""
    tokens: list[int] = []
    while True:
        try:
            kind, value = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                loop_thread.abort(rid)
                return _error(499, "client disconnected")
            continue
        if kind == "token":
            tokens.append(value)
        elif kind == "done":
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": value}],
                                 "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(tokens),
                                           "total_tokens": prompt_len + len(tokens)}})
        else:
            return _error(500, value)


# ------------------------------------------------------------------------------------- the process

def build_engine(spec: dict):
    """The engine a server spec describes: the checkpoint on the spec's device, the arm's natural-policy engine."""
    from .. import engines, machine
    from ..records import ArmSpec
    from ..session import load_model

    engines.check_sources(spec.get("engine_sources", {}))   # the planned versions: each run's server imports afresh
    device = machine.child_device("server", spec["device"])
    model = load_model(spec["checkpoint_path"], spec["dtype"], device, spec["max_model_len"])
    arm = ArmSpec.from_plain(spec["arm_config"])
    cfg = arm.engine_config(spec["max_num_seqs"], spec["max_model_len"], spec["policy"])
    return engines.build_engine(arm.engine, model, cfg)


def serve(spec: dict) -> int:
    """Bind ``spec['host']`` on a free port, write it to ``spec['port_file']``, serve until SIGTERM."""
    import uvicorn

    app = make_app(build_engine(spec), spec["exit"])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((spec.get("host", "127.0.0.1"), 0))
    port = sock.getsockname()[1]
    tmp = Path(spec["port_file"] + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(spec["port_file"])    # the port file appears whole
    print(f"serving on http://{spec.get('host', '127.0.0.1')}:{port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                            lifespan="on")
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler it found: exit 0 there
    signal.signal(signal.SIGTERM, _stopped)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _stopped(signum, frame) -> None:
    print(f"stopped on {signal.Signals(signum).name} after a graceful shutdown", flush=True)
    raise SystemExit(0)


def _die_with_parent() -> None:
    """Linux: the kernel SIGTERMs this server when the session that started it dies (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    if len(argv) != 1:
        print("usage: python -m loopbench.harness.online.server SPEC.json", file=sys.stderr)
        return 2
    return serve(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())
