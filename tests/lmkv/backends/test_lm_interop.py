"""Interop with LMCache 0.5.6 in both directions (needs .venv-lmcache, see
scripts/setup_lmcache_venv.sh; skipped without it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from lmkv.backends import lm_wire as wire
from lmkv.backends.lm import LMBackend

pytestmark = pytest.mark.interop

CLIENT_SCRIPT = Path(__file__).parent / "scripts" / "lmcache_client.py"
# LMCache's server parses keys: model@world_size@worker_id@chunk_hash_hex@dtype
KEY = "meta-llama/Llama-3.1-8B-Instruct@2@1@-1a2b3c4d5e6f7081@bfloat16"


def run_reference_client(venv: Path, url: str) -> dict:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(
        [str(venv / "bin" / "python"), str(CLIENT_SCRIPT), port],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lmkv_client_against_lmcache_server(lmcache_server):
    backend = LMBackend(lmcache_server, timeout=10)
    values = {f"{KEY}@{i}": os.urandom(n) for i, n in enumerate([1, 4096, 4 << 20])}
    values[KEY] = os.urandom(33)
    backend.put(list(values.items()))
    assert backend.get(list(values)) == list(values.values())
    assert backend.contains([KEY, KEY.replace("-1a", "-2b")]) == [True, False]
    assert backend.get([KEY.replace("-1a", "-2b")]) == [None]
    backend.put([(KEY, b"overwritten")])
    assert backend.get([KEY]) == [b"overwritten"]
    assert backend.health()
    backend.close()


def test_lmcache_client_against_lmkv_server(venv, spawn_server):
    server = spawn_server("--max-memory", "64MiB")
    result = run_reference_client(venv, server.url)
    assert result == {
        "exists_before": False,
        "exists_after": True,
        "equal": True,
        "shape": [2, 2, 16, 16],
        "dtype": "torch.bfloat16",
        "fmt": 1,
    }
    # what the reference client stored, as our server holds it: KV_2LTD bf16 [2, L, T, H*D]
    key = b"interop-model@1@0@-1a2b3c4d5e6f7081@bfloat16"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(wire.pack_request(wire.Command.GET, key))
        header = wire.unpack_response(sock.recv(wire.RESPONSE_SIZE, socket.MSG_WAITALL))
    assert header == wire.ResponseHeader(200, 2048, 1, 3, (2, 2, 16, 16), 0)


def test_reference_client_against_reference_server(venv, lmcache_server):
    """Control: the script gives the same answer against LMCache's own server."""
    result = run_reference_client(venv, lmcache_server)
    assert result["exists_after"] and result["equal"] and result["fmt"] == 1
