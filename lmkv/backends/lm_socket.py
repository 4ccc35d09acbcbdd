"""Kernel timeouts of a blocking lm:// socket, bounded by a deadline. Shared by the lm://
client (lmkv.backends.lm) and by lmkv_server: both wait in the kernel (SO_RCVTIMEO,
SO_SNDTIMEO), not in Python's poll loop."""

from __future__ import annotations

import math
import socket
import struct
import time

DEADLINE_SLACK = 0.1  # seconds a wait may end past its deadline
MIN_TIMEOUT = 0.001  # seconds; socket timeouts run on the kernel's 1-4 ms timer tick


def timeval(seconds: float) -> bytes:
    """A struct timeval of ``seconds`` (finite), rounded up to at least 1 us: the kernel
    takes timeval 0 as no timeout at all."""
    whole, micros = divmod(max(1, math.ceil(seconds * 1e6)), 1_000_000)
    return struct.pack("@ll", whole, micros)


class SocketTimeouts:
    """A socket's SO_RCVTIMEO and SO_SNDTIMEO: each at its usual value, or shortened so
    that the next wait ends by a deadline (within DEADLINE_SLACK). A setsockopt only when
    the value changes: waits that end well before their deadline cost none."""

    def __init__(self, sock: socket.socket, receive: float, send: float):
        self.sock = sock
        self.usual = {socket.SO_RCVTIMEO: receive, socket.SO_SNDTIMEO: send}
        self._set: dict[int, float] = {}
        self.restore()

    def restore(self) -> None:
        """Both timeouts back to their usual values."""
        for option, seconds in self.usual.items():
            self._apply(option, seconds)

    def until(self, option: int, deadline: float | None) -> None:
        """The next wait of ``option`` ends by ``deadline`` (None: after the usual timeout);
        TimeoutError if the deadline has passed."""
        usual = self.usual[option]
        if deadline is None:
            self._apply(option, usual)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out " + ("receiving" if option == socket.SO_RCVTIMEO
                                               else "sending"))
        self._apply(option, left if left + DEADLINE_SLACK < usual else usual)

    def _apply(self, option: int, seconds: float) -> None:
        if self._set.get(option) != seconds:
            self.sock.setsockopt(socket.SOL_SOCKET, option, timeval(seconds))
            self._set[option] = seconds
