"""The scheduler role's lookups and pins, served by the worker processes over Unix sockets.

vLLM runs its scheduler in one process (the engine core under ``vllm serve``) and the model
(the worker role, the KV memory, and so lmkv's cache object) in others, one per
tensor-parallel rank, or all in one; lmkv's vLLM scheduler role always asks the workers,
each over a Unix socket named after vLLM's engine id and the rank, so every layout runs
the same code:

- ``LookupServer`` (a worker process) answers with its LMKVCache: lookups, pins of the
  chunks a load will take (from the cache's PinTable), pins given back, prefetches, chunks
  read up for a waiting request (bring_up, then whether they arrived, then let go of once
  it was looked up), uses of chunks the
  engine served itself (touch), lookup metrics, draining writes. Chunks are named by
  rank-free ids; it scopes them to its keys.
- ``LookupClient`` (the scheduler process) is the ``ChunkIndex`` the scheduler role uses:
  it asks every rank (``RankConnection`` each) and agrees on what all of them hold.

Messages are one JSON object per line, at most ``MAX_LINE`` bytes; nothing is unpickled.
The socket is created with mode 0600.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from lmkv.cache import LMKVCache
from lmkv.config import LMKVConfig
from lmkv.connector.scheduler import ARRIVING_WAIT, Arrival
from lmkv.keys import chunk_ids, in_epoch, tail_id

log = logging.getLogger(__name__)

MAX_LINE = 64 << 20  # a prompt's token ids, or its keys, fit many times over
MAX_OWED = 1 << 16  # unpins kept to send again (more: left to the pin TTL)
CALL_TIMEOUT = 60.0  # seconds for one answer (a fetch may read lower tiers)
BACKOFF = 5.0  # seconds after a call timed out during which calls fail at once
MAX_ARRIVALS = 4096  # reads for waiting requests a worker tracks (more: the oldest dropped)
# seconds a worker tracks such a read (a request aborted or looked up after ARRIVING_WAIT
# is never asked about again)
ARRIVAL_TTL = 2 * ARRIVING_WAIT
STARTING_SECONDS = 60.0  # a server's socket under its starting name older than this: left by a kill
POLL_INTERVAL = 0.005  # seconds between asks whether waiting requests' chunks arrived


def socket_path(engine_id: str, dp_rank: int = 0, tp_rank: int = 0) -> Path:
    """Short (AF_UNIX paths are limited to ~107 bytes) and distinct per vLLM engine, data-
    parallel rank and tensor-parallel rank."""
    name = f"{engine_id}/{dp_rank}" + (f"/tp{tp_rank}" if tp_rank else "")
    digest = hashlib.sha256(name.encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / f"lmkv-{digest}.sock"


def _same_user(sock: socket.socket) -> None:
    """PermissionError unless the process at the other end of the Unix socket runs as this
    one's user (root's too): the path in the temporary directory is predictable where
    vLLM's engine_id is set, so another user could bind it first, or connect to it."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # (not Linux: the socket file's mode 0600 alone)
        return
    creds = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("iII"))
    _, uid, _ = struct.unpack("iII", creds)
    if uid not in (os.geteuid(), 0):
        raise PermissionError(f"the other end runs as uid {uid}, not {os.geteuid()}")


def _unlink_if_dead(path: Path) -> None:
    """Remove a socket file left by a process that is gone (nothing listens: connection
    refused); one that still answers, or is too busy to within a second, is another live
    server's, and binding over it fails loudly instead."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        with contextlib.suppress(OSError):  # (another user's file in a shared /tmp)
            path.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        probe.close()


def _sweep_dead_sockets(directory: Path) -> None:
    """Remove the socket files of lookup servers whose process is gone: a vLLM stopped by a
    signal exits without closing them, and each instance's engine id names a new one."""
    for path in directory.glob("lmkv-*.sock"):
        if re.fullmatch(r"lmkv-[0-9a-f]{20}\.sock", path.name):
            _unlink_if_dead(path)
    for path in directory.glob(".lmkv-*"):  # a server's name before its link: left by a kill
        with contextlib.suppress(OSError):
            if (re.fullmatch(r"\.lmkv-[0-9a-f]{24}", path.name)
                    and time.time() - path.lstat().st_mtime > STARTING_SECONDS):
                path.unlink()


class LookupServer:
    """In the worker's process: serves the scheduler role's calls on its lmkv cache."""

    def __init__(self, cache: LMKVCache, path: Path):
        self.cache = cache
        self.path = path
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        # reads for waiting requests (bring_up) by ticket, with when each started: until
        # asked after done, or ARRIVAL_TTL
        self._arrivals: OrderedDict[int, tuple[float, Any]] = OrderedDict()
        self._tickets = itertools.count(1)
        _sweep_dead_sockets(path.parent)
        _unlink_if_dead(path)
        # bound and listening under a name no sweep takes for a dead server's (a socket bound
        # but not yet listening refuses connections as a dead one's does), then linked to
        # its path: a live server's file there fails the link, as a bind over it would
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        starting = path.with_name(f".lmkv-{os.urandom(12).hex()}")  # (no longer than path's name)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(starting))
            self._sock.listen(4)
            try:
                os.link(starting, path)
            except FileExistsError:
                raise OSError(errno.EADDRINUSE, f"{path} is another lookup server's") from None
        except OSError:
            self._sock.close()
            raise
        finally:
            os.umask(old)
            with contextlib.suppress(OSError):
                starting.unlink()
        self._closed = False
        atexit.register(self.close)  # vLLM may not shut its connectors down on exit
        threading.Thread(target=self._accept, name="lmkv-lookups", daemon=True).start()
        log.info("lmkv: serving the scheduler role's lookups on %s", path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        self._sock.close()
        self.path.unlink(missing_ok=True)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                _same_user(conn)
            except OSError as e:
                log.warning("lmkv: refused a lookup connection: %s", e)
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lmkv-lookups-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
                while not self._closed:
                    line = rfile.readline(MAX_LINE + 1)
                    if not line:
                        return
                    oversized = len(line) > MAX_LINE or not line.endswith(b"\n")
                    msg = None
                    try:
                        if oversized:
                            raise ValueError(f"message longer than {MAX_LINE} bytes")
                        msg = json.loads(line)
                        reply = {"ok": True, **self._handle(msg)}
                    except Exception as e:  # a bad message gets an error reply, never a crash
                        log.warning("lmkv: bad request on %s: %s", self.path, e)
                        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    if isinstance(msg, dict) and "id" in msg:  # the client matches replies by it
                        reply["id"] = msg["id"]
                    try:
                        wfile.write(json.dumps(reply).encode() + b"\n")
                        wfile.flush()
                    except OSError:  # the client gave up waiting: it never learns of these pins
                        if reply["ok"] and msg.get("op") == "pin":
                            self._unpin(msg["keys"][: len(reply["lossy"])])
                        raise
                    if oversized:  # the rest of that line is not a message: hang up
                        return
        except OSError:
            return  # the client went away
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _unpin(self, ids: list[str]) -> None:
        self.cache.unpin([self.cache.key_of(str(k)) for k in ids])
        log.warning("lmkv: the scheduler role stopped waiting for a pin of %d chunks; given back",
                    len(ids))

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op, e = msg.get("op"), self.cache
        # the scheduler names chunks by rank-free ids; this worker's keys are its shard's
        keys = [e.key_of(str(k)) for k in msg.get("keys", [])]
        if op == "lookup":
            return {"found": e.lookup(keys)}
        if op == "pin":
            parent = msg.get("parent")
            return {"lossy": e.pin(keys, None if parent is None else e.key_of(str(parent)),
                                   bool(msg.get("again", False)))}
        if op == "unpin":
            e.unpin(keys)
            return {}
        if op == "prefetch":
            parent = msg.get("parent")
            e.prefetch(keys, None if parent is None else e.key_of(str(parent)))
            return {}
        if op == "touch":
            e.touch(keys)
            return {}
        if op == "bring_up":
            parent = msg.get("parent")
            arrival = e.bring_up(keys, None if parent is None else e.key_of(str(parent)))
            if arrival is None:
                return {"ticket": None}
            now = time.monotonic()
            dropped = []
            with self._lock:
                ticket = next(self._tickets)
                self._arrivals[ticket] = (now, arrival)
                while (len(self._arrivals) > MAX_ARRIVALS
                       or next(iter(self._arrivals.values()))[0] < now - ARRIVAL_TTL):
                    dropped.append(self._arrivals.popitem(last=False)[1][1])
            for old in dropped:
                old.release()
            return {"ticket": ticket}
        if op == "arrived":  # which of these tickets' reads are done (or no longer tracked)
            with self._lock:
                found = {t: self._arrivals.get(t, (0.0, None))[1] for t in map(int, msg["tickets"])}
            return {"done": [t for t, arrival in found.items() if arrival is None or arrival.done()]}
        if op == "let_go":  # the requests were looked up (or left): their chunks' holds go
            with self._lock:
                gone = [self._arrivals.pop(t, (0.0, None))[1] for t in map(int, msg["tickets"])]
            for arrival in gone:
                if arrival is not None:
                    arrival.release()
            return {}
        if op == "record_lookup":
            e.record_lookup(int(msg["prompt_tokens"]), int(msg["hit_tokens"]),
                            int(msg.get("engine_tokens", 0)))
            return {}
        if op == "drain":
            e.drain()
            return {}
        if op == "count_error":
            where, kind = str(msg["where"]), str(msg["kind"])
            if where != "connector" or kind not in ("lookup", "load", "save", "blend"):
                raise ValueError(f"no error counter {where}/{kind}")  # labels stay bounded
            e.count_error(where, kind)
            return {}
        raise ValueError(f"unknown op {op!r}")


class LookupClient:
    """In the scheduler's process: the ``ChunkIndex`` the scheduler role asks, answered by
    the LookupServer of every tensor-parallel rank's worker (one socket each). Chunks are
    named by rank-free ids (``lmkv.keys.chunk_ids``); a chunk is a hit only where every
    rank holds its shard, and it is pinned on every rank. Calls come from vLLM's scheduler
    thread, one at a time; connections open on first use."""

    def __init__(self, config: LMKVConfig, paths: list[Path], connect_timeout: float = 60.0):
        self.config = config
        self.chunk_size = config.chunk_size
        self.ranks = [RankConnection(p, connect_timeout) for p in paths]
        # reads started for waiting requests, (rank, ticket), not known to be done
        self._waiting: set[tuple[RankConnection, int]] = set()
        self._polled = 0.0
        self._epoch: bytes | None = None  # new_epoch's: chunks stored before are not named

    def keys(self, tokens: list[int]) -> list[str]:
        return in_epoch(chunk_ids(tokens, self.chunk_size), self._epoch)

    def tail_key(self, tokens: list[int]) -> str | None:
        tail = tail_id(tokens, self.chunk_size)
        return None if tail is None else in_epoch([tail], self._epoch)[0]

    def new_epoch(self) -> None:
        """Name no chunk stored so far again (the engine's weights changed in place): every
        rank keeps what it holds, found by nothing from now on (and evicted in time)."""
        self._epoch = os.urandom(16)

    def lookup(self, keys: list[str]) -> int:
        return min(r.call("lookup", keys=keys)["found"] for r in self.ranks)

    def pin(self, keys: list[str], parent: str | None = None, again: bool = False) -> list[bool]:
        pinned: list[list[bool]] = []
        try:
            for r in self.ranks:
                reply = r.call("pin", keys=keys, parent=parent, again=again)
                pinned.append([bool(f) for f in reply["lossy"]])
        except BaseException:
            for r, flags in zip(self.ranks, pinned, strict=False):
                r.unpin(keys[: len(flags)])
            raise
        n = min(len(flags) for flags in pinned)
        for r, flags in zip(self.ranks, pinned, strict=True):
            if len(flags) > n:  # held by this rank, not by every rank: give it back
                r.unpin(keys[n : len(flags)])
        return [any(flags[i] for flags in pinned) for i in range(n)]

    # the calls below are best effort: a failure is logged, never raised into vLLM's
    # scheduler (an unpin that fails is sent again before the rank's next call; a lost
    # drain only means a consumer may miss chunks still being written)
    def unpin(self, keys: list[str]) -> None:
        if keys:
            for r in self.ranks:
                r.unpin(keys)

    def touch(self, keys: list[str]) -> None:
        for r in self.ranks:
            r.best_effort("touch", keys=keys)

    def prefetch(self, keys: list[str], parent: str | None = None) -> None:
        if self.config.enable_prefetch:
            for r in self.ranks:
                r.best_effort("prefetch", keys=keys, parent=parent)

    def bring_up(self, keys: list[str], parent: str | None = None) -> Arrival | None:
        arrival = RemoteArrival(self)
        for r in self.ranks:  # (a rank that fails: its tickets on the others expire there)
            ticket = r.call("bring_up", keys=keys, parent=parent)["ticket"]
            if ticket is not None:
                arrival.tickets.add((r, int(ticket)))
                arrival.started.append((r, int(ticket)))
        if not arrival.tickets:
            return None
        self._waiting |= arrival.tickets
        return arrival

    def _poll(self) -> None:
        """Ask each rank, in one call, which of the reads it started are done, at most every
        POLL_INTERVAL seconds (vLLM asks about each waiting request at every step). A rank
        that does not answer is taken as done: its requests are looked up, as without."""
        now = time.monotonic()
        if not self._waiting or now - self._polled < POLL_INTERVAL:
            return
        self._polled = now
        for r in self.ranks:
            tickets = [t for rank, t in self._waiting if rank is r]
            if not tickets:
                continue
            try:
                done = r.call("arrived", tickets=tickets)["done"]
            except Exception:  # (logged by call)
                done = tickets
            self._waiting.difference_update((r, int(t)) for t in done)

    def record_lookup(self, prompt_tokens: int, hit_tokens: int, engine_tokens: int = 0) -> None:
        self.ranks[0].best_effort("record_lookup", prompt_tokens=prompt_tokens,
                                  hit_tokens=hit_tokens, engine_tokens=engine_tokens)

    def drain(self) -> None:
        for r in self.ranks:
            r.best_effort("drain")

    def count_error(self, where: str, kind: str) -> None:
        self.ranks[0].best_effort("count_error", where=where, kind=kind)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


class RemoteArrival:
    """Chunks read up for a waiting request in the workers' processes: done when every rank
    that started a read says it is (LookupClient._poll), or when asking fails; released
    with one call per rank (best effort: a worker lets go by itself after ARRIVAL_HOLD)."""

    def __init__(self, client: LookupClient):
        self.client = client
        self.tickets: set[tuple[RankConnection, int]] = set()  # not known to be done
        self.started: list[tuple[RankConnection, int]] = []

    def done(self) -> bool:
        self.client._poll()
        self.tickets &= self.client._waiting
        return not self.tickets

    def release(self) -> None:
        self.client._waiting.difference_update(self.started)
        for r in self.client.ranks:
            tickets = [t for rank, t in self.started if rank is r]
            if tickets:
                r.best_effort("let_go", tickets=tickets)
        self.started, self.tickets = [], set()


class NotSent(ConnectionError):
    """A call that never reached the worker (no connection, or the back-off after a
    timeout): nothing of it was done there."""


class RankConnection:
    """One rank's worker process, over its socket: one request, one reply, matched by id."""

    def __init__(self, path: Path, connect_timeout: float = 60.0):
        self.path = path
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._rfile: Any = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._quiet_until = 0.0  # after a timeout: calls fail at once until then
        self._down = False  # the last call failed: told once, and again when one succeeds
        # keys whose unpin failed (the worker did not answer): sent before the next call,
        # else their slots stay pinned until the worker's pin TTL (10 minutes)
        self._owed: list[str] = []

    def best_effort(self, op: str, **args: Any) -> None:
        with contextlib.suppress(Exception):  # (call logs the worker going away and back)
            self.call(op, **args)

    def unpin(self, keys: list[str]) -> None:
        """Give back pins; one that certainly did not reach the worker is sent again with the
        next call (one that may have reached it is not: pins are counted per key, and a
        second unpin would give back another request's pin; the worker's TTL ends it)."""
        try:
            self.call("unpin", keys=keys)
        except NotSent:  # (logged by call)
            with self._lock:
                self._owed = (self._owed + list(keys))[-MAX_OWED:]  # older ones: the TTL
        except Exception:
            pass  # (logged by call)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """One request and its reply (after any owed unpin). Any failure closes the
        connection (the next call opens a new one), so no late reply is ever read as
        another call's."""
        with self._lock:
            if self._owed:
                owed, self._owed = self._owed, []
                try:
                    self._exchange("unpin", {"keys": owed})
                except NotSent:
                    self._owed = owed  # (nothing joins it while the lock is held)
                    raise
            out = self._exchange(op, args)
        if not out.get("ok"):
            raise RuntimeError(f"lmkv worker process: {out.get('error')}")
        return out

    def _exchange(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """One request and its reply, under the lock."""
        if time.monotonic() < self._quiet_until:
            raise NotSent(f"lmkv: the worker process on {self.path} did not answer in "
                          f"{CALL_TIMEOUT:.0f} s; asking again in at most {BACKOFF:.0f} s")
        self._next_id += 1
        line = json.dumps({"op": op, "id": self._next_id, **args}).encode() + b"\n"
        if len(line) > MAX_LINE:
            raise ValueError(f"lmkv: {op} message of {len(line)} bytes exceeds {MAX_LINE}")
        sent = False  # from the first byte on, the worker may have the request
        try:
            sock = self._connect()
            sent = True
            sock.sendall(line)
            reply = self._rfile.readline(MAX_LINE + 1)
            if not reply:
                raise ConnectionError(f"lmkv worker process closed {self.path}")
            out = json.loads(reply)
            if not isinstance(out, dict) or out.get("id") != self._next_id:
                raise ConnectionError(f"lmkv: reply out of step on {self.path}")
        except BaseException as e:
            self.close()
            if isinstance(e, TimeoutError):  # a wedged worker: do not hold vLLM's scheduler
                self._quiet_until = time.monotonic() + BACKOFF  # not CALL_TIMEOUT at every call
            if not self._down and isinstance(e, OSError | ValueError):
                self._down = True
                log.warning("lmkv: the worker process on %s does not answer (%s: %s); "
                            "requests are computed without lmkv until it does", self.path,
                            op, e)
            if not sent and isinstance(e, OSError):
                raise NotSent(str(e)) from e
            raise
        if self._down:
            self._down = False
            log.warning("lmkv: the worker process on %s answers again", self.path)
        return out

    def close(self) -> None:
        if self._rfile is not None:  # (it holds the socket open too)
            self._rfile.close()
            self._rfile = None
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
                _same_user(sock)  # (else another user's process bound the path first)
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
