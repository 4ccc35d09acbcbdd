"""lm:// backend: a client of lmkv_server or of LMCache's ``lmcache_server``.

Values are opaque bytes sent as fmt BINARY, dtype uint8, shape ``[nbytes, 0, 0, 0]``, so
either server stores them verbatim. Wire format: lmkv.backends.lm_wire.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence
from typing import NamedTuple, NoReturn
from urllib.parse import urlsplit

from lmkv.backends import lm_wire as wire
from lmkv.backends.base import BackendError, StorageBackend

DEFAULT_MAX_VALUE_SIZE = 1 << 30
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

    Every call is bounded: ``connect_timeout`` for connecting, ``timeout`` for each socket
    operation. Any failure closes the connection and raises BackendError; the next call
    reconnects. A connection found closed by the server before a call (restart, idle
    close) is replaced silently before anything is sent.

    PUT has no acknowledgement in this protocol: ``put`` returning means the bytes were
    handed to the kernel, not that the server stored them (it may also evict them later).

    Against LMCache's lmcache_server, keys must have LMCache's form
    (``model@world_size@worker_id@chunk_hash_hex@dtype[...]``): that server parses them
    and drops the connection on anything else (a BackendError here). lmkv_server only
    requires printable ASCII without spaces.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        connect_timeout: float = 3.0,
        max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if not 0 < max_value_size <= wire.MAX_LENGTH:
            raise ValueError(f"max_value_size must be in (0, {wire.MAX_LENGTH}]")
        self.address = parse_lm_url(url)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_value_size = max_value_size
        self._sock: socket.socket | None = None
        self._header = bytearray(wire.RESPONSE_SIZE)

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
        try:
            for header, payload in frames:
                sock.sendall(header)
                sock.sendall(payload)
        except OSError as exc:
            self._fail(f"put to {self._where()} failed: {exc}", exc)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values in order, None for misses. Hits are returned as bytearrays."""
        requests = [wire.pack_request(wire.Command.GET, self._key(k)) for k in keys]
        sock = self._connection()
        values: list[bytes | None] = []
        try:
            for request in requests:
                sock.sendall(request)
                reply = self._read_response(sock)
                if reply.code != wire.Code.SUCCESS:
                    values.append(None)
                    continue
                if not 0 <= reply.length <= self.max_value_size:
                    self._fail(f"{self._where()} announced a {reply.length}-byte value")
                value = bytearray(reply.length)
                self._recv_exactly(sock, memoryview(value))
                values.append(value)  # type: ignore[arg-type]  # bytearray: no copy
        except OSError as exc:
            self._fail(f"get from {self._where()} failed: {exc}", exc)
        return values

    def contains(self, keys: Sequence[str]) -> list[bool]:
        requests = [wire.pack_request(wire.Command.EXIST, self._key(k)) for k in keys]
        sock = self._connection()
        found = []
        try:
            for request in requests:
                sock.sendall(request)
                found.append(self._read_response(sock).code == wire.Code.SUCCESS)
        except OSError as exc:
            self._fail(f"exist on {self._where()} failed: {exc}", exc)
        return found

    def health(self) -> bool:
        """True if the server answers HEALTH (lmcache_server 0.5.6 does too)."""
        sock = self._connection()
        try:
            sock.sendall(wire.pack_request(wire.Command.HEALTH, _HEALTH_KEY))
            return self._read_response(sock).code == wire.Code.SUCCESS
        except OSError as exc:
            self._fail(f"health of {self._where()} failed: {exc}", exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connection(self) -> socket.socket:
        if self._sock is not None and self._peer_closed(self._sock):
            self.close()
        if self._sock is None:
            try:
                sock = socket.create_connection(self.address, timeout=self.connect_timeout)
            except OSError as exc:
                raise BackendError(f"cannot connect to {self._where()}: {exc}") from exc
            sock.settimeout(self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    @staticmethod
    def _peer_closed(sock: socket.socket) -> bool:
        # Between calls nothing may be pending on a request/response connection: readable
        # means EOF (server gone or restarted), a reset, or stray bytes. Drop it either way.
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def _read_response(self, sock: socket.socket) -> wire.ResponseHeader:
        self._recv_exactly(sock, memoryview(self._header))
        return wire.unpack_response(self._header)

    def _recv_exactly(self, sock: socket.socket, view: memoryview) -> None:
        while view.nbytes:
            n = sock.recv_into(view)
            if n == 0:
                self._fail(f"{self._where()} closed the connection mid-reply")
            view = view[n:]

    def _key(self, key: str) -> bytes:
        try:
            return wire.encode_key(key)
        except wire.WireError as exc:
            raise BackendError(f"invalid lm:// key: {exc}") from exc

    def _fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        self.close()
        raise BackendError(message) from cause

    def _where(self) -> str:
        return f"lm://{self.address.host}:{self.address.port}"
