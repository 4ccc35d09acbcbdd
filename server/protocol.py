"""Connection: serves lm:// frames on one client socket until EOF, in its own thread.

Blocking I/O straight between the kernel and the store's pages, one system call per
payload: a PUT payload is received into its reserved pages with one
``recvmsg_into(pages, MSG_WAITALL)``, a GET reply leaves with one ``sendmsg([header,
*pages])`` (header and payload in one call, as the reference client needs). Timeouts
are the kernel's (SO_RCVTIMEO/SO_SNDTIMEO), so the socket stays blocking and the
kernel, not Python, waits for the peer (faster than asyncio designs were here: figures in
docs/server.md).

TCP keepalive ends a connection whose peer vanished (host down, network cut), and
``idle_timeout``, if set, one that sends no request for that long: either would
otherwise hold a thread and a slot of max_connections for good.

Errors stay local: a frame that cannot be answered meaningfully fails (FAIL reply, or a
dropped PUT, which has no reply), and a frame that leaves the stream unparseable (unknown
command, negative or oversized length, timeout inside a frame) closes this connection.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from lmkv.backends import lm_wire as wire
from lmkv.backends.lm_socket import SocketTimeouts
from lmkv.logs import LogThrottle

from .config import ServerConfig
from .store import Store

log = logging.getLogger(__name__)

_DRAIN_CHUNK = 256 * 1024
_EVICT_STEP = 4 << 20  # a PUT evicts for this many more bytes only once those before arrived
_IOV_MAX = 512  # buffers per sendmsg/recvmsg call, below Linux's IOV_MAX of 1024
SEND_STALL = 5.0  # seconds a reply may wait for its reader to take any of it
# TCP keepalive: a peer silent for 60 s is probed every 10 s, and after 6 unanswered
# probes the kernel fails the connection (a dead client host is noticed in ~2 minutes).
_KEEPALIVE_IDLE_S = 60
_KEEPALIVE_INTERVAL_S = 10
_KEEPALIVE_PROBES = 6


@dataclass(slots=True)
class Traffic:
    """Counters of what connections did; each Connection owns one, /stats sums them."""

    connections: int = 0  # open now (set when summing)
    connections_total: int = 0
    idle_timeouts: int = 0  # connections closed after idle_timeout without a request
    requests: dict[str, int] = field(default_factory=lambda: {c.name: 0 for c in wire.Command})
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    # PUTs not stored: "too_large" (above max_memory), "busy" (the rest is pinned or in
    # flight), "bad_key"
    dropped: dict[str, int] = field(
        default_factory=lambda: {"too_large": 0, "busy": 0, "bad_key": 0}
    )
    # frames that were malformed (FAIL reply or connection closed) or timed out
    protocol_errors: dict[str, int] = field(
        default_factory=lambda: {"bad_command": 0, "bad_length": 0, "bad_key": 0, "timeout": 0}
    )
    # connections refused at accept: more than --max-connections, or a peer outside --allow
    refused: dict[str, int] = field(default_factory=lambda: {"max_connections": 0, "allow": 0})

    @classmethod
    def total(cls, parts: Iterable[Traffic]) -> Traffic:
        out = cls()
        for part in parts:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(part, f.name)
                if isinstance(mine, dict):
                    for key, value in theirs.items():
                        mine[key] += value
                else:
                    setattr(out, f.name, mine + theirs)
        return out


class _Closed(Exception):
    """The peer closed the connection in the middle of a frame."""


class _Stalled(Exception):
    """A frame did not complete within io_timeout (or its reply's reader stopped: the
    message says)."""


class Connection:
    def __init__(self, sock: socket.socket, store: Store, config: ServerConfig,
                 quiet: LogThrottle | None = None) -> None:
        self.sock = sock
        self.store = store
        self.config = config
        # misbehaving clients are logged once a minute per kind of fault, server-wide
        self.quiet = quiet or LogThrottle()
        self.traffic = Traffic(connections_total=1)
        self.peer = _peer_name(sock)
        self.stopping = False  # set by the listener; the socket is shut down with it
        self._header = bytearray(wire.REQUEST_SIZE)
        self._deadline = 0.0
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)
        # receives wake at least this often, to look at the clock and the stop flag; inside a
        # frame, a wait that the frame's deadline cuts short gets a shorter timeout
        wake = min(config.io_timeout, config.idle_timeout or config.io_timeout)
        self._timeouts = SocketTimeouts(sock, wake, config.io_timeout)

    def serve(self) -> None:
        try:
            while self._next_frame():
                pass
        except _Closed:
            if not self.stopping:
                self.quiet.log(log, logging.INFO, "closed", "%s closed the connection inside a "
                               "frame", self.peer)
        except _Stalled as exc:
            self.traffic.protocol_errors["timeout"] += 1
            self.quiet.log(log, logging.WARNING, "timeout", "%s: %s; closing", self.peer,
                           exc or f"frame not completed within {self.config.io_timeout:g}s")
        except OSError as exc:  # including ETIMEDOUT: keepalive probes went unanswered
            if not self.stopping:
                self.quiet.log(log, logging.INFO, "error", "%s: connection error: %s",
                               self.peer, exc)
        finally:
            self.sock.close()

    def _next_frame(self) -> bool:
        """Serve one frame; False when the connection should close."""
        header = memoryview(self._header)
        idle = self.config.idle_timeout
        idle_since = time.monotonic()
        self._timeouts.restore()  # a frame before this one may have shortened them
        while True:  # idle: wait for a frame, up to idle_timeout (0: as long as it takes)
            try:  # not MSG_WAITALL: the frame's clock starts with its first bytes
                n = self.sock.recv_into(header, wire.REQUEST_SIZE)
                break
            except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
                if self.stopping:
                    return False
                if idle and time.monotonic() - idle_since >= idle:
                    self.traffic.idle_timeouts += 1
                    log.info("%s: idle for %ss; closing", self.peer, idle)
                    return False
        if n == 0:
            return False
        self._deadline = time.monotonic() + self.config.io_timeout
        if n < wire.REQUEST_SIZE:
            self._recv_into([header[n:]], wire.REQUEST_SIZE - n)
        request = wire.unpack_request(self._header)
        try:
            command = wire.Command(request.command)
        except ValueError:
            # Whether a payload follows is unknown: the stream cannot be resynchronised.
            self.traffic.protocol_errors["bad_command"] += 1
            self.quiet.log(log, logging.WARNING, "bad_command", "%s: unknown command %d; closing",
                           self.peer, request.command)
            self._send([wire.FAIL_EMPTY])
            return False
        self.traffic.requests[command.name] += 1
        if command is wire.Command.PUT:
            return self._put(request)
        if command is wire.Command.LIST:
            return True  # the reference server sends nothing back either
        if command is wire.Command.HEALTH:
            self._send([wire.SUCCESS_EMPTY])
            return True
        if not self._key_ok(request.key):
            self._send([wire.FAIL_EMPTY])
            return True
        if command is wire.Command.EXIST:
            found = self.store.contains(request.key)
            self._send([wire.SUCCESS_EMPTY if found else wire.FAIL_EMPTY])
            return True
        self._get(request.key)
        return True

    def _put(self, request: wire.RequestHeader) -> bool:
        length = request.length
        if not 0 <= length <= self.config.max_value_size:
            self.traffic.protocol_errors["bad_length"] += 1
            self.quiet.log(log, logging.WARNING, "bad_length", "%s: PUT of %d bytes outside "
                           "[0, max_value_size=%d]; closing", self.peer, length,
                           self.config.max_value_size)
            return False
        if not self._key_ok(request.key):
            self.traffic.dropped["bad_key"] += 1
            self._drain(length)
            return True
        store = self.store
        need = store.pages_for(length)
        if not store.fits(length) or not store.room_for(need):
            self._drop(length, "busy" if store.fits(length) else "too_large")
            return True
        # Pages (free ones, or freed by evictions) only while the payload arrives: the first
        # once a byte of it is here, each next (twice as many, up to _EVICT_STEP) once the
        # bytes before it are in place. A PUT that stops early (a client that disconnects or
        # stalls after its header) holds, and costs other clients' values, about what it sent.
        most = max(1, _EVICT_STEP // store.arena.page_size)
        step = 1
        pages: list[int] = []
        got = 0  # payload bytes in place
        try:
            while len(pages) < need:
                if length:  # (an empty value has no byte to wait for: its page is taken now)
                    self._await_payload()
                want, step = min(need - len(pages), step), min(2 * step, most)
                more = store.reserve_pages(want)
                if more is None:  # readers pinned what was evictable meanwhile
                    store.abort(pages)
                    pages = []
                    self._drop(length - got, "busy")
                    return True
                pages += more
                end = min(length, len(pages) * store.arena.page_size)
                self._recv_into(_advance(store.arena.segments(pages, end), got), end - got)
                got = end
        except BaseException:
            store.abort(pages)
            raise
        self.traffic.bytes_in += length
        self.store.commit(request.key, length, request.fmt, request.dtype, request.shape, pages)
        return True

    def _drop(self, length: int, reason: str) -> None:
        """A PUT that will not be stored: count it, and read past the rest of its payload."""
        self.traffic.dropped[reason] += 1
        if reason == "too_large":  # (a client's setting: one line a minute, all counted)
            self.quiet.log(log, logging.WARNING, "put_too_large", "%s: PUT not stored (too_large: "
                           "a value above --max-value-size or --max-memory)", self.peer)
        else:  # busy: load
            log.debug("%s: PUT not stored (%s)", self.peer, reason)
        self._drain(length)

    def _get(self, key: bytes) -> None:
        entry = self.store.acquire(key)
        if entry is None:
            self.traffic.misses += 1
            self._send([wire.FAIL_EMPTY])
            return
        try:
            self.traffic.hits += 1
            header = wire.pack_response(
                wire.Code.SUCCESS, entry.length, entry.fmt, entry.dtype, entry.shape
            )
            self._send([header, *self.store.segments(entry)])
            self.traffic.bytes_out += entry.length
        finally:
            self.store.release(entry)

    def _key_ok(self, key: bytes) -> bool:
        try:
            wire.check_key(key)
        except wire.WireError as exc:
            self.traffic.protocol_errors["bad_key"] += 1
            self.quiet.log(log, logging.WARNING, "bad_key", "%s: bad key (%s)", self.peer, exc)
            return False
        return True

    def _recv_into(self, views: list[memoryview], length: int) -> None:
        """Fill ``views`` (``length`` bytes in all) before the frame's deadline."""
        while length:
            self._until_deadline(socket.SO_RCVTIMEO)
            try:
                n = self.sock.recvmsg_into(views[:_IOV_MAX], 0, socket.MSG_WAITALL)[0]
            except BlockingIOError:  # SO_RCVTIMEO expired
                n = -1
            if n == 0:
                raise _Closed
            if n > 0:
                length -= n
                views = _advance(views, n)
            if length and time.monotonic() > self._deadline:
                raise _Stalled
            if self.stopping:
                raise _Closed

    def _await_payload(self) -> None:
        """Return once the next payload byte has arrived (left unread); _Closed at EOF."""
        while True:
            self._until_deadline(socket.SO_RCVTIMEO)
            try:
                if self.sock.recv(1, socket.MSG_PEEK):
                    return
                raise _Closed
            except BlockingIOError:  # SO_RCVTIMEO expired
                pass
            if time.monotonic() > self._deadline:
                raise _Stalled
            if self.stopping:
                raise _Closed

    def _until_deadline(self, option: int) -> None:
        """The next wait of ``option`` (SO_RCVTIMEO, SO_SNDTIMEO) ends by the frame's
        deadline; _Stalled if it has passed."""
        try:
            self._timeouts.until(option, self._deadline)
        except TimeoutError:
            raise _Stalled from None

    def _drain(self, length: int) -> None:
        """Read and discard a PUT payload that will not be stored."""
        scratch = memoryview(bytearray(min(length, _DRAIN_CHUNK)))
        while length:
            chunk = min(length, scratch.nbytes)
            self._recv_into([scratch[:chunk]], chunk)
            length -= chunk

    def _send(self, buffers: list[bytes | memoryview]) -> None:
        """Send ``buffers`` in order before the frame's deadline, the reader taking some of
        them at least every SEND_STALL seconds (a GET's value is held, unevictable, while it
        is sent: a client that stopped reading held it for all of io_timeout, and writes
        that needed its room were dropped); one call in practice."""
        progress = time.monotonic()
        while buffers:
            deadline = min(self._deadline, progress + SEND_STALL)
            try:
                self._timeouts.until(socket.SO_SNDTIMEO, deadline)
            except TimeoutError:
                raise self._send_stalled(deadline) from None
            try:
                sent = self.sock.sendmsg(buffers[:_IOV_MAX])
            except BlockingIOError:  # SO_SNDTIMEO expired with nothing sent
                sent = 0
            if sent:
                progress = time.monotonic()
            buffers = _advance(buffers, sent)
            if buffers and time.monotonic() > deadline:
                raise self._send_stalled(deadline)

    def _send_stalled(self, deadline: float) -> _Stalled:
        if deadline < self._deadline:
            return _Stalled(f"its reader took none of a reply for {SEND_STALL:g}s")
        return _Stalled()


def _advance(views: list, n: int) -> list:
    """``views`` (bytes or memoryviews) without their first ``n`` bytes."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    if n:
        return [memoryview(views[i])[n:], *views[i + 1 :]]
    return views[i:]


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "client"
    return f"{host}:{port}"
