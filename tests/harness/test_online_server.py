"""The online server (harness/online/server.py) on the tiny model, served by uvicorn on 127.0.0.1.

Streamed tokens equal the engine's own output for the same request; bad requests get a 4xx naming the
field; a client that disconnects mid-stream aborts its request and frees its slot; ``GET /settings`` says what
the served engine runs with (null for an engine without settings()).
"""
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from loopbench.harness import engines
from loopbench.harness.online.server import make_app
from loopbench.runtime.api import EngineConfig, Request
from loopbench.runtime.engine import LoopEngine
from loopbench.runtime.model import OuroModel

EXIT = {"min_loops": 1, "max_loops": 4, "threshold": 0.55}
B = 3


def _engine(model) -> LoopEngine:
    return LoopEngine(model, EngineConfig(max_num_seqs=B, max_model_len=256, kv_layout="alias", prefix_tiles=True,
                                          exit_policy="ouro"))


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return OuroModel.from_tensors(*tiny_ckpt, dtype=torch.float32, rope_len=256)


@pytest.fixture
def server(model):
    """(base url, the served engine) of a uvicorn server in a thread, stopped after the test."""
    import uvicorn

    engine = _engine(model)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(make_app(engine, EXIT), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.02)
    yield url, engine
    srv.should_exit = True
    thread.join(10)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stream(url: str, body: dict) -> tuple[list[int], str]:
    tokens, reason = [], None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice["token_ids"]
            reason = choice["finish_reason"] or reason
    return tokens, reason


def test_stream_equals_the_engines_direct_output(server, model):
    url, _ = server
    for seed, n in ((0, 31), (1, 33), (2, 8)):
        prompt = _prompt(seed, n)
        direct = _engine(model)
        direct.add_request(Request("d", tuple(prompt), max_tokens=12, min_loops=1, max_loops=4,
                                   exit_threshold=0.55))
        want = direct.run()["d"]
        got, reason = _stream(url, {"prompt": prompt, "max_tokens": 12, "ignore_eos": True})
        assert got == list(want.token_ids) and reason == want.finish_reason == "length"
        whole = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12}, timeout=60).json()
        assert whole["choices"][0]["token_ids"] == list(want.token_ids)
        assert whole["usage"] == {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": 4}, 400, "'prompt' must be a non-empty list of token ids"),
    ({"prompt": [], "max_tokens": 4}, 400, "'prompt' must be a non-empty list"),
    ({"prompt": [1, "a"], "max_tokens": 4}, 400, "'prompt' must be a non-empty list"),
    ({"prompt": [1, 2], "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1, got 0"),
    ({"prompt": [1, 2], "max_tokens": 4, "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"prompt": [1, 2], "max_tokens": 4, "temperature": 0.7}, 400, "unsupported field(s) ['temperature']"),
    ({"prompt": [1, 99999], "max_tokens": 4}, 400, "token id 99999 outside [0, 256)"),
    ({"prompt": [1, 2], "max_tokens": 300}, 400, "exceed max_model_len=256"),
])
def test_a_bad_request_gets_a_4xx_naming_the_field(server, body, status, words):
    url, _ = server
    resp = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == status
    assert words in resp.json()["error"]["message"]


def test_a_body_that_is_not_json_gets_422(server):
    url, _ = server
    resp = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 422 and "not JSON" in resp.json()["error"]["message"]


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def test_a_client_disconnect_aborts_the_request_and_frees_its_slot(server):
    url, engine = server
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": _prompt(3, 16), "max_tokens": 200, "stream": True}) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(3)]   # a few tokens: the request is running
        assert all(line.startswith("data: ") for line in got if line)
        assert _health(url)["running"] == 1
    for _ in range(200):                         # the stream was closed after a few of its 200 tokens
        h = _health(url)
        if h["aborted"] == 1 and h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["aborted"] == 1 and h["running"] == 0 and h["free_slots"] == B and h["completed"] == 0
    # the freed slot serves the next request in full
    tokens, reason = _stream(url, {"prompt": _prompt(4, 8), "max_tokens": 5})
    assert len(tokens) == 5 and reason == "length"


def test_settings_report_what_the_served_engine_runs_with(server):
    url, engine = server
    got = httpx.get(url + "/settings", timeout=10).json()
    assert got == {"engine_settings": engines.engine_settings(engine)} == {"engine_settings": engine.settings()}
    assert got["engine_settings"]["kv_layout"] == "alias" and got["engine_settings"]["max_num_seqs"] == B
    assert "engine_settings" not in _health(url)        # health stays the counters


class _WithoutSettings:
    """The served engine with its optional settings() hidden: a third-party engine without it."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        if name == "settings":
            raise AttributeError(name)
        return getattr(self._engine, name)


class _BadSettings(_WithoutSettings):
    def settings(self) -> dict:
        return {"tile_size": [32]}


def test_an_engine_without_settings_reports_null_and_bad_settings_are_refused_before_serving(model):
    async def get_settings(app) -> dict:   # the app in-process (no lifespan: its engine loop never starts)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return (await client.get("/settings")).json()

    assert asyncio.run(get_settings(make_app(_WithoutSettings(_engine(model)), EXIT))) == {"engine_settings": None}
    with pytest.raises(TypeError, match=r"_BadSettings.settings\(\)\['tile_size'\] is \[32\], not a JSON scalar"):
        make_app(_BadSettings(_engine(model)), EXIT)
