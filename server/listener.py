"""Listener: accepts lm:// connections and runs each Connection in its own thread.

All of the server's I/O concurrency lives here. Threads, not an event loop, because the
kernel copies a payload inside the calling thread's recv/send: with blocking sockets
every connection's copy proceeds in parallel and the kernel does the waiting (see
protocol.py). The GIL is released in those calls; shared state is the Store (locked).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from lmkv.logs import LogThrottle

from .config import ServerConfig
from .protocol import Connection, Traffic
from .store import Store

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.5  # how often the accept loop looks at the stop flag


class Listener:
    def __init__(self, sock: socket.socket, store: Store, config: ServerConfig) -> None:
        self.sock = sock
        self.store = store
        self.config = config
        self._lock = threading.Lock()
        self._live: dict[Connection, threading.Thread] = {}
        self._closed = Traffic()  # counters of connections that have ended
        self._quiet = LogThrottle()  # one line a minute per kind of client fault
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="lmkv-accept")

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> None:
        self.sock.settimeout(_ACCEPT_POLL_S)
        self._thread.start()

    def traffic(self) -> Traffic:
        """Counters summed over ended and open connections."""
        with self._lock:
            live = list(self._live)
            total = Traffic.total([self._closed, *(c.traffic for c in live)])
        total.connections = len(live)
        return total

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, close every connection, wait for their threads."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        self._thread.join()
        self.sock.close()
        with self._lock:
            live = list(self._live.items())
        for conn, _ in live:
            conn.stopping = True
            with contextlib.suppress(OSError):  # wakes its blocked recv/send
                conn.sock.shutdown(socket.SHUT_RDWR)
        for _, thread in live:
            thread.join(timeout)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                if self._stopping.is_set():
                    break
                log.error("accept failed: %s", exc)
                self._stopping.wait(_ACCEPT_POLL_S)
                continue
            try:
                self._admit(sock, address[0])
            except Exception:  # one bad connection must not end the accept loop
                log.exception("dropping a connection from %s during setup", address[0])
                sock.close()

    def _admit(self, sock: socket.socket, address: str) -> None:
        if not self.config.allows(address):
            self._refuse(sock, "allow", "refusing a connection from %s: not in --allow", address)
            return
        with self._lock:
            full = len(self._live) >= self.config.max_connections
        if full:
            self._refuse(sock, "max_connections", "refusing a connection from %s: "
                         "max_connections=%d", address, self.config.max_connections)
            return
        conn = Connection(sock, self.store, self.config, self._quiet)
        thread = threading.Thread(
            target=self._run, args=(conn,), name=f"lmkv-conn-{conn.peer}", daemon=True
        )
        with self._lock:
            self._live[conn] = thread
        try:
            thread.start()  # e.g. RuntimeError: can't start new thread
        except BaseException:
            with self._lock:  # its slot is free again; the accept loop closes the socket
                del self._live[conn]
            raise

    def _refuse(self, sock: socket.socket, reason: str, msg: str, *args: object) -> None:
        with self._lock:
            self._closed.refused[reason] += 1
        self._quiet.log(log, logging.WARNING, f"refuse_{reason}", msg, *args)
        sock.close()

    def _run(self, conn: Connection) -> None:
        try:
            conn.serve()
        finally:
            with self._lock:
                del self._live[conn]
                self._closed = Traffic.total([self._closed, conn.traffic])
