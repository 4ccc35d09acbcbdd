"""Import setup shared by all tests.

Installed (``pip install -e .[test]``), ``lmkv`` and ``lmkv_server`` import as they are.
From a bare checkout, this conftest puts the repo root first on sys.path and, if
``lmkv_server`` does not resolve to this checkout's ``server/`` folder, a directory with a
symlink ``lmkv_server -> server`` too; child processes get the same through PYTHONPATH.
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _import_paths() -> list[str]:
    paths = [str(REPO)]
    sys.path.insert(0, str(REPO))
    try:
        module = importlib.import_module("lmkv_server")
        if Path(module.__file__).resolve().parent == REPO / "server":
            return paths
        for name in [m for m in sys.modules if m.split(".")[0] == "lmkv_server"]:
            del sys.modules[name]  # some other checkout's copy
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="lmkv-shim-"))
    atexit.register(shutil.rmtree, shim, ignore_errors=True)
    (shim / "lmkv_server").symlink_to(REPO / "server")
    sys.path.insert(0, str(shim))
    return [str(shim), *paths]


IMPORT_PATHS = _import_paths()


@pytest.fixture(scope="session")
def server_env() -> dict[str, str]:
    """Environment for child processes (lmkv_server, scripts) that import this checkout."""
    from lmkv_server.launcher import child_env

    return child_env(*IMPORT_PATHS)


@pytest.fixture
def spawn_server(server_env, tmp_path):
    """``spawn_server(*args)`` starts an lmkv_server; every one is stopped at teardown."""
    from lmkv_server.launcher import ServerProcess

    started: list[ServerProcess] = []

    def spawn(*args: str, port: int | None = None, host: str = "127.0.0.1") -> ServerProcess:
        log = tmp_path / f"server-{len(started)}.log"
        server = ServerProcess(*args, env=server_env, log_path=log, port=port, host=host)
        started.append(server)
        return server.start()

    yield spawn
    for server in started:
        server.stop()
