"""lm:// backend: a client of lmkv_server or of LMCache's ``lmcache_server``.

Values are opaque bytes sent as fmt BINARY, dtype uint8, shape ``[nbytes, 0, 0, 0]``, so
either server stores them verbatim. Wire format: lmkv.backends.lm_wire.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import select
import socket
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple, NoReturn
from urllib.parse import urlsplit

from lmkv.backends import lm_wire as wire
from lmkv.backends import net
from lmkv.backends.base import Arrived, BackendError, StorageBackend
from lmkv.backends.lm_socket import MIN_TIMEOUT, SocketTimeouts
from lmkv.keys import KEY_VERSION
from lmkv.logs import LogThrottle

log = logging.getLogger(__name__)

DEFAULT_MAX_VALUE_SIZE = 256 << 20  # lmkv_server's default: a larger PUT would be refused
CONNECT_TIMEOUT = 3.0  # seconds to connect at most (less where a call may take less)
RECEIVE_STEP = 16 << 20  # a value is received into memory grown by this much as it arrives
# lmcache_server parses the key of every frame, HEALTH included, and drops the connection
# if it is not model@world_size@worker_id@chunk_hash_hex@dtype
_HEALTH_KEY = b"lmkv-health@1@0@0@uint8"


class LMAddress(NamedTuple):
    host: str
    port: int


def parse_lm_url(url: str) -> LMAddress:
    """``lm://host:port`` -> LMAddress; raises ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "lm":
        raise ValueError(f"not an lm:// URL: {url!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}") from exc
    if not parts.hostname or port is None:
        raise ValueError(f"lm:// URL needs host and port: {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"lm:// URL takes no path or query: {url!r}")
    return LMAddress(parts.hostname, port)


class LMBackend(StorageBackend):
    """One persistent TCP connection to an lm:// server, used serially.

    Every call is bounded: ``connect_timeout`` for connecting, the name lookup included
    (default the smaller of CONNECT_TIMEOUT and ``timeout``: a link that cannot connect
    within a call's time would not answer one either), ``timeout`` for each request
    and its reply, from the first byte sent to the last byte received, within
    lm_socket.DEADLINE_SLACK (in a batch read, each reply from the end of the one before; a
    batch of EXISTs as a whole; in a batch write, each value, so a link must carry a chunk's
    frame within ``timeout``, as it must for a read). The requests of a batch read must make
    progress within ``timeout`` at every send. Any failure closes the
    connection and raises BackendError; the next call reconnects. A connection that the
    server closed between calls (restart, idle close) is replaced before anything is sent.

    PUT has no acknowledgement in this protocol: ``put`` returning means the bytes were
    handed to the kernel, not that the server stored them (it may also evict them later).

    Against LMCache's lmcache_server, keys must have LMCache's form
    (``model@world_size@worker_id@chunk_hash_hex@dtype[...]``): that server parses them
    and drops the connection on anything else (a BackendError here). lmkv_server takes
    any key of 1-150 bytes without control bytes or a leading or trailing space.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        connect_timeout: float | None = None,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
    ) -> None:
        if connect_timeout is None:
            connect_timeout = min(CONNECT_TIMEOUT, timeout)
        for name, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not MIN_TIMEOUT <= seconds < math.inf:  # NaN fails too
                raise ValueError(
                    f"{name} must be finite and at least {MIN_TIMEOUT} s, got {seconds!r}")
        if not 0 < max_value_size <= wire.MAX_LENGTH:
            raise ValueError(f"max_value_size must be in (0, {wire.MAX_LENGTH}]")
        self.address = parse_lm_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_value_size = max_value_size
        self._sock: socket.socket | None = None
        self._timeouts: SocketTimeouts | None = None  # of _sock
        self._header = bytearray(wire.RESPONSE_SIZE)
        self._quiet = LogThrottle()

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        frames = []
        for key, value in items:
            payload = memoryview(value).cast("B")
            if payload.nbytes > self.max_value_size:
                raise BackendError(
                    f"value for {key!r} is {payload.nbytes} bytes, over max_value_size"
                )
            header = wire.pack_request(
                wire.Command.PUT,
                self._key(key),
                payload.nbytes,
                wire.Fmt.BINARY,
                wire.DType.UINT8,
                wire.binary_shape(payload.nbytes),
            )
            frames.append((header, payload))
        sock = self._connection()
        with self._exchange("put to"):
            for header, payload in frames:  # each value within the timeout, as each reply is
                self._send(sock, [header, payload], time.monotonic() + self.timeout)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in order, None for misses. Hits are returned as bytearrays (no copy). All
        GETs are sent at once, the replies read in order (one round trip for the batch)."""
        requests = [wire.pack_request(wire.Command.GET, self._key(k)) for k in keys]
        sock = self._connection()
        values: list[bytes | None] = []
        with self._exchange("get from"):
            self._send(sock, requests, None)
            for key in keys:
                deadline = time.monotonic() + self.timeout
                length = self._read_value_header(sock, deadline)
                if length is not None and length > self.max_value_size:
                    self._skip(sock, key, length, self.max_value_size, deadline)
                    length = None
                values.append(None if length is None
                              else self._recv_value(sock, length, deadline))  # type: ignore[arg-type]
        return values

    def get_into(self, key: str, buffer: memoryview | bytearray) -> int | None:
        """Receive ``key``'s value straight into ``buffer`` (e.g. a pre-faulted pool slot,
        which avoids the page faults of a fresh allocation); its length, or None on a miss.
        A value larger than ``buffer`` is read past and taken as a miss."""
        request = wire.pack_request(wire.Command.GET, self._key(key))
        view = memoryview(buffer).cast("B")
        sock = self._connection()
        with self._exchange("get from"):
            deadline = time.monotonic() + self.timeout
            self._send(sock, [request], deadline)
            length = self._read_value_header(sock, deadline)
            if length is None:
                return None
            if length > view.nbytes:
                self._skip(sock, key, length, view.nbytes, deadline)
                return None
            self._recv_exactly(sock, view[:length], deadline)
            return length

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        """All GETs sent at once, the replies read in order into ``outs``."""
        requests = [wire.pack_request(wire.Command.GET, self._key(k)) for k in keys]
        views = [memoryview(out).cast("B") for out in outs]
        sock = self._connection()
        lengths: list[int | None] = []
        with self._exchange("get from"):
            self._send(sock, requests, None)
            for key, view in zip(keys, views, strict=True):
                deadline = time.monotonic() + self.timeout
                length = self._read_value_header(sock, deadline)
                if length is not None and length > view.nbytes:
                    self._skip(sock, key, length, view.nbytes, deadline)
                    length = None
                if length is not None:
                    self._recv_exactly(sock, view[:length], deadline)
                if length is not None and arrived is not None:
                    arrived(len(lengths), length)
                lengths.append(length)
        return lengths

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """All EXISTs sent at once, the answers read in order; the batch as a whole within
        one ``timeout`` (a lookup waits on it: a store that answers each EXIST just in time
        must not hold it for a timeout per key)."""
        requests = [wire.pack_request(wire.Command.EXIST, self._key(k)) for k in keys]
        sock = self._connection()
        found = []
        with self._exchange("exist on"):
            deadline = time.monotonic() + self.timeout
            self._send(sock, requests, deadline)
            for _ in keys:
                found.append(self._read_answer(sock, deadline))
        return found

    def health(self) -> bool:
        """True if the server answers HEALTH (lmcache_server 0.5.6 does too)."""
        sock = self._connection()
        with self._exchange("health of"):
            deadline = time.monotonic() + self.timeout
            self._send(sock, [wire.pack_request(wire.Command.HEALTH, _HEALTH_KEY)], deadline)
            return self._read_answer(sock, deadline)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connection(self) -> socket.socket:
        if self._sock is not None and self._peer_closed(self._sock):
            self.close()
        if self._sock is None:
            try:
                sock = net.connect(*self.address, self.connect_timeout)
            except OSError as exc:
                raise BackendError(f"cannot connect to {self._where()}: {exc}") from exc
            # Blocking socket with kernel timeouts: a reply is received with one
            # recv(MSG_WAITALL) and the kernel does the waiting, not Python's poll loop.
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._timeouts = SocketTimeouts(sock, self.timeout, self.timeout)
            self._sock = sock
        return self._sock

    @staticmethod
    def _peer_closed(sock: socket.socket) -> bool:
        # Between calls nothing may be pending on a request/response connection: readable
        # means EOF (server gone or restarted), a reset, or stray bytes. Drop it either way.
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def _send(self, sock: socket.socket, buffers: list[bytes | memoryview],
              deadline: float | None) -> None:
        """Send ``buffers`` by ``deadline``; with None, each send must make progress within
        ``timeout`` instead. A send that moves nothing in time raises BlockingIOError."""
        for buf in buffers:
            view = memoryview(buf).cast("B")
            while view.nbytes:
                self._timeouts.until(socket.SO_SNDTIMEO, deadline)
                view = view[sock.send(view):]  # short if SO_SNDTIMEO cut it off

    def _read_response(self, sock: socket.socket, deadline: float) -> wire.ResponseHeader:
        self._recv_exactly(sock, memoryview(self._header), deadline)
        return wire.unpack_response(self._header)

    def _read_answer(self, sock: socket.socket, deadline: float) -> bool:
        """An EXIST or HEALTH reply: a bare header, 200 (yes) or 400 (no)."""
        reply = self._read_response(sock, deadline)
        if reply.code not in (wire.Code.SUCCESS, wire.Code.FAIL) or reply.length != 0:
            # not such a reply: the stream is out of step
            self._fail_with(f"{self._where()} answered with code {reply.code}, "
                            f"length {reply.length}")
        return reply.code == wire.Code.SUCCESS

    def _read_value_header(self, sock: socket.socket, deadline: float) -> int | None:
        reply = self._read_response(sock, deadline)
        if reply.code == wire.Code.FAIL and reply.length == 0:  # not stored
            return None
        if reply.code != wire.Code.SUCCESS or reply.length < 0:  # the stream is out of step
            self._fail_with(f"{self._where()} answered with code {reply.code}, length "
                            f"{reply.length}: out of step")
        return reply.length

    def _recv_value(self, sock: socket.socket, length: int, deadline: float) -> bytearray:
        """A value of ``length`` bytes (at most max_value_size), in memory that grows as the
        bytes arrive, so a length announced but never sent costs no more than what came."""
        value = bytearray(min(length, RECEIVE_STEP))
        self._recv_exactly(sock, memoryview(value), deadline)
        while len(value) < length:
            start = len(value)
            value.extend(bytes(min(length - start, RECEIVE_STEP)))
            self._recv_exactly(sock, memoryview(value)[start:], deadline)
        return value

    def _skip(self, sock: socket.socket, key: str, length: int, room: int, deadline: float) -> None:
        """Read and drop a value too large for its buffer or max_value_size (not a frame this
        reader can take: another layout's, or corrupt), through a bounded scratch buffer and
        within the reply's deadline, so the connection stays in step; the caller takes it as
        a miss."""
        self._quiet.log(log, logging.WARNING, "oversize", "lmkv: %s holds %d bytes under %r, "
                        "more than the %d this reader takes; taken as a miss", self._where(),
                        length, key, room)
        scratch = memoryview(bytearray(min(length, RECEIVE_STEP)))
        while length:
            n = min(length, scratch.nbytes)
            self._recv_exactly(sock, scratch[:n], deadline)
            length -= n

    def _recv_exactly(self, sock: socket.socket, view: memoryview, deadline: float) -> None:
        while view.nbytes:
            # each receive waits at most the time left, so the reply as a whole is bounded
            self._timeouts.until(socket.SO_RCVTIMEO, deadline)
            try:
                n = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO expired with nothing received
                continue
            if n == 0:
                self._fail_with(f"{self._where()} closed the connection mid-reply")
            view = view[n:]

    def _key(self, key: str) -> bytes:
        try:
            wire.encode_key(key)  # the caller's key must be valid as is
            return wire.encode_key(lmcache_key(key))
        except wire.WireError as exc:
            raise BackendError(f"invalid lm:// key: {exc}") from exc

    @contextlib.contextmanager
    def _exchange(self, what: str) -> Iterator[None]:
        """Requests sent and replies read on the connection: a network error is a
        BackendError; on any error the connection is closed (replies left unread would be
        read as the answers to the next call's requests)."""
        try:
            yield
        except OSError as exc:
            self._fail(what, exc)
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str, exc: OSError) -> NoReturn:
        if isinstance(exc, BlockingIOError):  # SO_SNDTIMEO expired
            exc = TimeoutError("timed out sending")
        self._fail_with(f"{what} {self._where()} failed: {exc}", exc)

    def _fail_with(self, message: str, cause: BaseException | None = None) -> NoReturn:
        self.close()
        raise BackendError(message) from cause

    def _where(self) -> str:
        return f"lm://{self.address.host}:{self.address.port}"


# LMCache's model@world_size@worker_id@hash@dtype[@...], its dtype names as its server reads them
_LMCACHE_KEY = re.compile(r"[^@\s]+@\d+@\d+@-?[0-9a-f]+@(half|bfloat16|float|double|int8|uint8|"
                          r"int16|int32|int64|bool|fp8_e4m3fn|fp8_e4m3fnuz|fp8_e5m2|fp8_e5m2fnuz)"
                          r"(@\S*)?")


def lmcache_key(key: str) -> str:
    """``key`` in the ``model@world_size@worker_id@hash@dtype`` form that LMCache's server
    parses (it drops the connection on anything else). Keys already in that form pass
    through; others, lmkv's own always (some read as that form), become
    ``lmkv@1@0@<64-bit hash>@uint8``. A hash collision cannot return wrong KV: every lmkv
    frame carries its full key's hash, checked on read."""
    if not key.startswith(KEY_VERSION) and _LMCACHE_KEY.fullmatch(key):
        return key
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)
    return f"lmkv@1@0@{format(h, 'x')}@uint8"
