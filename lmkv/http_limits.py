"""uvicorn's HTTP/1.1 protocol with its connections bounded, for lmkv's HTTP servers (the
engine's API, lmkv_server's admin port). uvicorn times out only connections that had a
request, and waits for the rest of a request head for ever, so a client that connects and
sends nothing, or one byte, held a connection (a file descriptor) until it went away."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle


def bounded_http(max_connections: int, head_timeout: float | None = None,
                 write_timeout: float | None = None) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``): beyond ``max_connections``
    open at once a new connection is closed at once; one that sends nothing is closed after
    the keep-alive timeout; one whose request head does not arrive whole within
    ``head_timeout`` seconds (default: the keep-alive timeout) of its first byte is closed;
    with ``write_timeout``, one that stops reading its responses (the send buffer full) for
    that long is cut off (else it holds its connection, and a graceful stop, for ever)."""

    class BoundedHTTP(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle  # the request before these bytes (None: none yet)
            between = waiting is None or waiting.response_complete
            super().data_received(data)
            if self.cycle is not waiting:  # a request head arrived: it is being served
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
            elif between and self._head_timer is None and not self.transport.is_closing():
                # part of a head: all of it is due by the deadline (more bytes do not move it)
                due = self.timeout_keep_alive if head_timeout is None else head_timeout
                self._head_timer = self.loop.call_later(due, self._head_late, waiting)

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._head_timer, self._write_timer):  # not hold the connection's
                if timer is not None:  # buffers for the timeout
                    timer.cancel()
            self._head_timer = self._write_timer = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout is not None and self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_stalled(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                self.transport.abort()

        def _head_late(self, waiting: RequestResponseCycle | None) -> None:
            self._head_timer = None
            if self.cycle is waiting and not self.transport.is_closing():  # still no request
                self.transport.close()

    return BoundedHTTP
