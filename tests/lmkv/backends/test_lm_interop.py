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
from lmkv.keys import KeyScope
from lmkv.layout import KVLayout

pytestmark = pytest.mark.interop

CLIENT_SCRIPT = Path(__file__).parent / "scripts" / "lmcache_client.py"
# LMCache's server parses keys: model@world_size@worker_id@chunk_hash_hex@dtype
KEY = "meta-llama/Llama-3.1-8B-Instruct@2@1@-1a2b3c4d5e6f7081@bfloat16"


def run_reference_client(venv: Path, url: str, *model: str) -> dict:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(
        [str(venv / "bin" / "python"), str(CLIENT_SCRIPT), port, *model],
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


# LMCache names a chunk by vLLM's model setting: a local path as often as a hub id
@pytest.mark.parametrize("model", ["/models/Llama 3.1 8B Instruct", "/models/通义千问-7B"])
def test_lmcache_client_stores_under_its_model_path_on_lmkv_server_as_on_its_own(
        venv, spawn_server, lmcache_server, model):
    """LMCache's client keys chunks model@world_size@worker_id@hash@dtype with the model
    path as vLLM was given it, a space or a non-ASCII character included; its own server
    takes such keys (it strips the padding spaces only). lmkv_server answers every one FAIL
    and drops its PUTs (bad_key), so an LMCache engine moved onto it gets no hit at all."""
    reference = run_reference_client(venv, lmcache_server, model)
    assert reference["exists_after"] and reference["equal"]  # control: LMCache's own server
    server = spawn_server("--max-memory", "64MiB")
    result = run_reference_client(venv, server.url, model)
    assert result["exists_after"] and result["equal"], result


def _digits_only_scope() -> KeyScope:
    """A KeyScope whose model id and layout fingerprint happen to be all decimal digits
    (about 1 checkpoint in 280 and 1 layout in 50), with a cache_salt: lmkv's chunk keys then
    read as LMCache's model@world_size@worker_id@hash@dtype form."""
    import hashlib

    import torch

    model = next(f"/models/llama-{i}" for i in range(10**6)
                 if hashlib.blake2b(f"/models/llama-{i}".encode(), digest_size=6).hexdigest().isdigit())
    layout = next(lay for n in range(1, 200)
                  if (lay := KVLayout(n, 4, 128, torch.bfloat16, 256)).fingerprint.isdigit())
    return KeyScope(model, layout, namespace="tenant-a")


def test_lmkvs_own_chunk_keys_are_always_in_a_form_lmcache_server_parses(lmcache_server):
    """lmcache_key passes a key through when it matches a loose pattern of LMCache's form;
    lmkv's own keys lmkv1@<model id>@<layout>@<rank>@<salt>@<hash> match it whenever the
    model id and the layout fingerprint are all digits, and lmcache_server then parses the
    salt hash as a dtype, fails, and drops the connection: that engine's remote tier never
    works against it."""
    key = _digits_only_scope().key(bytes(32))
    backend = LMBackend(lmcache_server, timeout=10)
    try:
        backend.put([(key, b"chunk")])
        assert backend.get([key]) == [b"chunk"]
    finally:
        backend.close()
