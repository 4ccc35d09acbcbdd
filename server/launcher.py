"""ServerProcess: an lmkv_server child process on loopback (tests, benchmarks, examples)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m lmkv_server HOST PORT ARGS...`` with an admin port, started and waited
    for; ``restart`` reuses both ports (and so any persist dir in ``args``). Clients
    connect through loopback (::1 for an IPv6 HOST, else 127.0.0.1), so HOST must be a
    loopback or a wildcard address."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.args = list(args)
        self.host = host
        self.env = env
        self.log_path = log_path
        self.port = port or free_port()
        self.admin_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def loopback(self) -> str:
        return "[::1]" if ":" in self.host else "127.0.0.1"

    @property
    def url(self) -> str:
        return f"lm://{self.loopback}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        cmd = [
            sys.executable,
            "-m",
            "lmkv_server",
            self.host,
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            *self.args,
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        if self.log_path:
            out.close()  # the child holds its own descriptor
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmkv_server exited with {self.proc.returncode}: {self.log()}")
            try:
                if self.admin("/health")["status"] == "ok":
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"lmkv_server did not start in {timeout}s: {self.log()}")
            time.sleep(0.05)

    def admin(self, path: str) -> Any:
        """GET an admin endpoint; JSON decoded, or text for /metrics."""
        with urllib.request.urlopen(f"http://{self.loopback}:{self.admin_port}{path}", timeout=5) as r:
            body = r.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def stats(self) -> dict[str, Any]:
        return self.admin("/stats")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful: persistence is flushed) and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a crash or the OOM killer."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 30.0) -> ServerProcess:
        self.stop()
        return self.start(timeout)

    def log(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-4000:]
        return "(no log)"

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        if self.alive():
            self.stop()


def child_env(*paths: str | os.PathLike[str]) -> dict[str, str]:
    """The current environment with ``paths`` prepended to PYTHONPATH."""
    env = dict(os.environ)
    parts = [str(p) for p in paths]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
