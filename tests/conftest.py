"""Fixtures shared by all tests. The package is installed (``pip install -e .[test]``), so
``lmkv``, ``lmkv_engines``, ``lmkv_server`` and ``lmkv_cuda`` import as they are; the repo
root is put first on sys.path (and PYTHONPATH of child processes) for ``tests.*`` helpers,
and the interpreter's bin directory first on PATH, so that the environment's programs
(``lmkv_server``, ``mooncake_master``) are found when pytest runs as ``.venv/bin/python -m
pytest`` without the environment activated (as ``make test`` does)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
_BIN = str(Path(sys.executable).parent)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory) -> Path:
    """Where tests build their models (kept across tests in one session)."""
    root = os.environ.get("LMKV_TEST_CACHE_DIR")
    return Path(root) if root else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_dir) -> Path:
    """A small random Llama (GQA 2:1, head_dim 64) with the demo tokenizer."""
    from lmkv_engines.minimal.demo_model import DemoGeometry, ensure_demo_model

    geometry = DemoGeometry(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=64, max_position_embeddings=4096)
    return ensure_demo_model(geometry, cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def server_env() -> dict[str, str]:
    """Environment for child processes (lmkv_server, scripts) that import this checkout."""
    from lmkv_server.launcher import child_env

    return child_env(REPO)


@pytest.fixture
def spawn_server(server_env, tmp_path):
    """``spawn_server(*args)`` starts an lmkv_server; every one is stopped at teardown."""
    from lmkv_server.launcher import ServerProcess

    started: list = []

    def spawn(*args: str, port: int | None = None, host: str = "127.0.0.1"):
        log = tmp_path / f"server-{len(started)}.log"
        server = ServerProcess(*args, env=server_env, log_path=log, port=port, host=host)
        started.append(server)
        return server.start()

    yield spawn
    for server in started:
        server.stop()


LMCACHE_VENV = Path(os.environ.get("LMKV_LMCACHE_VENV", REPO / ".venv-lmcache"))


@pytest.fixture(scope="session")
def venv() -> Path:
    """LMCache 0.5.6's venv (scripts/setup_lmcache_venv.sh); tests that need it skip without it."""
    if not (LMCACHE_VENV / "bin" / "lmcache_server").exists():
        pytest.skip(f"no LMCache venv at {LMCACHE_VENV}: run scripts/setup_lmcache_venv.sh")
    return LMCACHE_VENV


@pytest.fixture(scope="module")
def lmcache_server(venv, tmp_path_factory):
    """LMCache's own lmcache_server on a free loopback port: its lm:// URL."""
    import socket
    import subprocess
    import time

    from lmkv_server.launcher import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("lmcache") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "lmcache_server"), "127.0.0.1", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "lmcache_server did not start"
            time.sleep(0.2)
    yield f"lm://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
def emu():
    """The CPU emulator launcher: the real cuda/*.cu built with g++ (cached by content hash)."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the CUDA kernels for the CPU emulator")
    from lmkv_cuda.emu import EmuLauncher

    return EmuLauncher()
