"""The server as a separate process: start it on 127.0.0.1 with a free port, wait for health, stop it.

:class:`ServerProcess` runs ``python -m loopbench.harness.online.server SPEC.json`` with its output in a
log file; ``start`` returns once ``GET /health`` answers 200, and raises :class:`ServerFailed` with the
log's last lines when the process exits first or health does not come within ``health_timeout_s``.
``stop`` sends SIGTERM (uvicorn shuts down gracefully), then SIGKILL after ``grace_s``; ``check``
raises ServerFailed (with the log tail) when the server died on its own, e.g. after an engine failure.
``engine_settings`` reads what the served engine resolved and runs with (``GET /settings``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..exit_status import exit_status_text

LOG_TAIL_LINES = 20


class ServerFailed(RuntimeError):
    """The server process crashed or never became healthy; the message ends with its log's tail."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    text = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else ["(no log)"]
    return "\n".join("    " + line for line in text)


class ServerProcess:
    """One server child; ``spec`` is the server spec (harness/online/server.py) without ``port_file``."""

    def __init__(self, spec: dict, log_path: Path, health_timeout_s: float = 120.0, grace_s: float = 10.0):
        self.spec, self.log_path = dict(spec), Path(log_path)
        self.health_timeout_s, self.grace_s = health_timeout_s, grace_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.exit_code: int | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="loopbench-server-")

    def start(self) -> str:
        """Start the child and wait until it is healthy; returns its base URL. Whatever ends the wait (the child's
        exit, the health timeout, a Ctrl-C or a stop raised in it) stops the child and removes its temporary files
        first: the child runs in a session of its own, so no signal to ours reaches it."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        import httpx

        port_file = Path(self._tmp.name) / "port"
        spec_file = Path(self._tmp.name) / "spec.json"
        spec_file.write_text(json.dumps({**self.spec, "port_file": str(port_file)}))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "loopbench.harness.online.server", str(spec_file)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.health_timeout_s
        while time.monotonic() < deadline:
            self.check("before it was healthy")
            if port_file.is_file():
                self.url = f"http://{self.spec.get('host', '127.0.0.1')}:{port_file.read_text().strip()}"
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise ServerFailed(f"the server was not healthy within {self.health_timeout_s:g} s; last lines of "
                           f"{self.log_path}:\n{log_tail(self.log_path)}")

    def check(self, when: str = "during the run") -> None:
        """ServerFailed, with the log tail, when the child has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            self.exit_code = self.proc.returncode
            status = exit_status_text({"exit_code": self.exit_code})
            raise ServerFailed(f"the server ended {when}, {status}; last lines of {self.log_path}:\n"
                               f"{log_tail(self.log_path)}")

    def health(self) -> dict | None:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=5.0).json()
        except (httpx.HTTPError, ValueError, TypeError):
            return None

    def engine_settings(self) -> dict | None:
        """What the served engine resolved and runs with (``GET /settings``: a flat dict of JSON scalars, None for
        an engine without ``settings()``); ServerFailed, with the log tail, when the server does not say, since
        None would claim an engine without settings."""
        import httpx

        try:
            return httpx.get(self.url + "/settings", timeout=5.0).raise_for_status().json()["engine_settings"]
        except (httpx.HTTPError, ValueError, TypeError, KeyError) as exc:
            raise ServerFailed(f"the server did not report its engine settings ({type(exc).__name__}: {exc}); last "
                               f"lines of {self.log_path}:\n{log_tail(self.log_path)}") from None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit status as harness/exit_status.py records one
        (negative: killed by that signal; None: never started)."""
        if self.proc is None:
            self._tmp.cleanup()
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self._tmp.cleanup()
        return self.exit_code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
