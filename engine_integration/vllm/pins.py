"""The scheduler role in another process than the worker role: lookups over a Unix socket.

`vllm serve` runs vLLM's scheduler in the engine-core process and the model (the worker
role, and the KV memory) in a worker process of its own, even with one GPU or CPU. lmkv's
chunks live where the worker is: that process's engine stores them and loads them, so
the scheduler role asks it, over a Unix socket named after vLLM's engine id:

- ``PinServer`` (worker process) answers with its LMKVEngine: keys of a prompt, lookups,
  fetches that pin the found chunks in its hot cache (so the load that follows cannot
  miss them), releases, prefetches, lookup metrics, draining writes.
- ``RemoteEngine`` (engine-core process) is the part of LMKVEngine the scheduler role
  uses, answered by the server. A fetch returns ``PinnedChunk`` handles; they travel to
  the worker inside vLLM's connector metadata (as key and flag only) and the worker takes
  the pinned chunk back from its server (``PinServer.take``).

Messages are one JSON object per line, at most ``MAX_LINE`` bytes; nothing is unpickled.
The socket is created with mode 0600. Where vLLM runs both roles in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), none of this is used: they share one engine.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from lmkv.config import LMKVConfig
from lmkv.engine import LMKVEngine
from lmkv.memory import ChunkBuffer

log = logging.getLogger(__name__)

MAX_LINE = 64 << 20  # a prompt's token ids, or its keys, fit many times over
CALL_TIMEOUT = 60.0  # seconds for one answer (a fetch may read lower tiers)


def socket_path(engine_id: str) -> Path:
    safe = "".join(ch for ch in engine_id if ch.isalnum() or ch in "-_")[:64]
    return Path(tempfile.gettempdir()) / f"lmkv-{safe}.sock"


class PinServer:
    """In the worker's process: serves the scheduler role's calls on its engine."""

    def __init__(self, engine: LMKVEngine, path: Path):
        self.engine = engine
        self.path = path
        self._pinned: dict[str, list[ChunkBuffer]] = defaultdict(list)
        self._lock = threading.Lock()
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old)
        self._sock.listen(4)
        self._closed = False
        atexit.register(self.close)  # vLLM may not shut its connectors down on exit
        threading.Thread(target=self._accept, name="lmkv-pins", daemon=True).start()
        log.info("lmkv: serving the scheduler role's lookups on %s", path)

    def take(self, key: str) -> ChunkBuffer | None:
        """A chunk the scheduler pinned for a load: the caller now owns its reference."""
        with self._lock:
            bufs = self._pinned.get(key)
            if not bufs:
                return None
            buf = bufs.pop()
            if not bufs:
                del self._pinned[key]
            return buf

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.close()
        finally:
            self.path.unlink(missing_ok=True)
        with self._lock:
            bufs = [b for bs in self._pinned.values() for b in bs]
            self._pinned.clear()
        for buf in bufs:
            buf.release()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="lmkv-pins-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
            while True:
                line = rfile.readline(MAX_LINE + 1)
                if not line:
                    return
                try:
                    if len(line) > MAX_LINE or not line.endswith(b"\n"):
                        raise ValueError(f"message longer than {MAX_LINE} bytes")
                    msg = json.loads(line)
                    reply = {"ok": True, **self._handle(msg)}
                except Exception as e:  # a bad message gets an error reply, never a crash
                    log.warning("lmkv: bad request on %s: %s", self.path, e)
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                wfile.write(json.dumps(reply).encode() + b"\n")
                wfile.flush()

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op, e = msg.get("op"), self.engine
        if op == "keys":
            return {"keys": e.keys([int(t) for t in msg["tokens"]])}
        keys = [str(k) for k in msg.get("keys", [])]
        if op == "lookup":
            return {"found": e.lookup(keys)}
        if op == "fetch":
            bufs = e.fetch(keys)
            with self._lock:
                for key, buf in zip(keys, bufs, strict=False):
                    self._pinned[key].append(buf)
            return {"lossy": [b.lossy for b in bufs]}
        if op == "release":
            for key in keys:
                buf = self.take(key)
                if buf is not None:
                    buf.release()
            return {}
        if op == "prefetch":
            e.prefetch(keys)
            return {}
        if op == "record_lookup":
            e.record_lookup(int(msg["prompt_tokens"]), int(msg["hit_tokens"]))
            return {}
        if op == "drain":
            e.drain()
            return {}
        if op == "count_error":
            e.count_error(str(msg["where"]), str(msg["kind"]))
            return {}
        raise ValueError(f"unknown op {op!r}")


class PinnedChunk:
    """A chunk pinned in the worker's engine, as the scheduler role holds it. Pickled into
    vLLM's connector metadata, it keeps only its key and flag."""

    def __init__(self, key: str, lossy: bool, owner: RemoteEngine | None = None):
        self.key, self.lossy, self._owner = key, lossy, owner

    def release(self) -> None:
        if self._owner is not None:
            self._owner.call("release", keys=[self.key])
            self._owner = None

    def __getstate__(self) -> dict:
        return {"key": self.key, "lossy": self.lossy}

    def __setstate__(self, state: dict) -> None:
        self.key, self.lossy, self._owner = state["key"], state["lossy"], None


class RemoteEngine:
    """In the engine-core process: what the scheduler role asks of an LMKVEngine, answered
    by the worker process's PinServer. Calls are made from vLLM's scheduler thread, one at
    a time; the connection is opened on first use (the worker starts its server before
    vLLM builds the scheduler)."""

    def __init__(self, config: LMKVConfig, path: Path, connect_timeout: float = 60.0):
        self.config = config
        self.chunk_size = config.chunk_size
        self.path = path
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def keys(self, tokens: list[int]) -> list[str]:
        return self.call("keys", tokens=list(tokens))["keys"]

    def lookup(self, keys: list[str]) -> int:
        return self.call("lookup", keys=keys)["found"]

    def fetch(self, keys: list[str]) -> list[PinnedChunk]:
        lossy = self.call("fetch", keys=keys)["lossy"]
        return [PinnedChunk(k, f, self) for k, f in zip(keys, lossy, strict=False)]

    def prefetch(self, keys: list[str]) -> None:
        if self.config.enable_prefetch:
            self.call("prefetch", keys=keys)

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.call("record_lookup", prompt_tokens=prompt_tokens, hit_tokens=hit_tokens)

    def drain(self) -> None:
        self.call("drain")

    def count_error(self, where: str, kind: str) -> None:
        """Counted in the worker process's metrics, where it can be reached."""
        try:
            self.call("count_error", where=where, kind=kind)
        except (OSError, RuntimeError) as e:
            log.debug("lmkv: could not count an error in the worker process: %s", e)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        line = json.dumps({"op": op, **args}).encode() + b"\n"
        with self._lock:
            try:
                sock = self._connect()
                sock.sendall(line)
                reply = self._rfile.readline(MAX_LINE + 1)
            except OSError:
                self.close()
                raise
        if not reply:
            self.close()
            raise ConnectionError(f"lmkv worker process closed {self.path}")
        out = json.loads(reply)
        if not out.get("ok"):
            raise RuntimeError(f"lmkv worker process: {out.get('error')}")
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        deadline = time.monotonic() + self.connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(self.path))
                break
            except OSError as e:
                sock.close()
                if time.monotonic() > deadline:
                    self.connect_timeout = 0.0  # waited once: later calls fail at once
                    raise ConnectionError(f"lmkv: no worker process serves {self.path} ({e})") from e
                time.sleep(0.1)
        sock.settimeout(CALL_TIMEOUT)
        self._sock, self._rfile = sock, sock.makefile("rb")
        log.info("lmkv: the scheduler role asks the worker process on %s", self.path)
        return sock
