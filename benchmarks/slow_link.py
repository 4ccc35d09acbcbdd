"""A TCP relay that makes a loopback store look far away: each direction's bytes arrive
half a round trip late and no faster than a given bandwidth (serialised at that rate, as a
link's bottleneck does). For benchmarks of remote tiers; no loss, no jitter.

    relay = SlowLink(("127.0.0.1", store_port), rtt_ms=20, mbytes_per_s=100).start()
    ... connect to relay.port ...
    relay.stop()
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

PIECE = 64 << 10  # bytes read at once from a socket
QUEUED = 1024  # pieces a direction holds (64 MiB): more waits, as TCP's window would


class SlowLink:
    def __init__(self, target: tuple[str, int], rtt_ms: float, mbytes_per_s: float):
        if rtt_ms < 0 or mbytes_per_s <= 0:
            raise ValueError(f"a link needs rtt_ms >= 0 and mbytes_per_s > 0, not {rtt_ms}, {mbytes_per_s}")
        self.target = target
        self.delay = rtt_ms / 2e3
        self.bytes_per_s = mbytes_per_s * 1e6
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._conns: list[socket.socket] = []

    def start(self) -> SlowLink:
        self._sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conns.append(s)
            self._direction(client, server)
            self._direction(server, client)

    def _direction(self, src: socket.socket, dst: socket.socket) -> None:
        pieces: queue.Queue[tuple[float, bytes]] = queue.Queue(QUEUED)

        def read() -> None:
            try:
                while data := src.recv(PIECE):
                    pieces.put((time.monotonic() + self.delay, data))
            except OSError:
                pass
            pieces.put((0.0, b""))

        def write() -> None:
            free = 0.0  # when the link has sent what it was given
            try:
                while True:
                    due, data = pieces.get()
                    if not data:
                        break
                    free = max(free, due - self.delay) + len(data) / self.bytes_per_s
                    wait = max(due, free + self.delay) - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()
