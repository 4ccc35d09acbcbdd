"""TCP connections to remote stores within a time bound, the name lookup included: the
system resolver (getaddrinfo) takes no timeout, and a DNS server that does not answer holds
its caller through every retry (glibc: 5 s per try, 2 tries per server). A lookup runs on
a thread of its own and is waited for until the bound; one lookup per name runs at a time,
and callers that come while it hangs share it, so a dead DNS server costs one thread per
name, not one per call."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

_lookups: dict[tuple[str, int], Future] = {}  # the lookup in flight for each (host, port)
_lookups_lock = threading.Lock()


def resolve(host: str, port: int, timeout: float) -> list[tuple]:
    """``getaddrinfo(host, port)`` for TCP, within ``timeout`` seconds: OSError if the name
    does not resolve, TimeoutError if no answer came in time."""
    try:  # an address needs no lookup
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    with _lookups_lock:
        lookup = _lookups.get((host, port))
        if lookup is None:
            lookup = _lookups[host, port] = Future()
            try:
                threading.Thread(target=_look_up, args=(host, port, lookup), daemon=True,
                                 name=f"lmkv-resolve-{host}").start()
            except RuntimeError as e:  # no thread to be had
                del _lookups[host, port]
                raise OSError(f"cannot look up {host}: {e}") from e
    try:
        return lookup.result(timeout)
    except FutureTimeout:
        raise TimeoutError(f"the name {host} did not resolve within {timeout:g} s "
                           "(DNS not answering?)") from None


def _look_up(host: str, port: int, lookup: Future) -> None:
    try:
        lookup.set_result(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    except BaseException as e:  # (a set_exception: every waiter sees it)
        lookup.set_exception(e)
    finally:
        with _lookups_lock:
            del _lookups[host, port]


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port``, the lookup and the connect together within
    ``timeout`` seconds (each address in the resolver's order, as
    ``socket.create_connection`` tries them); the socket keeps ``timeout`` as its timeout.
    OSError (TimeoutError included) if none could be made."""
    deadline = time.monotonic() + timeout
    error: OSError | None = None
    for family, kind, proto, _, address in resolve(host, port, timeout):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
        except OSError as e:
            sock.close()
            error = e
            continue
        sock.settimeout(timeout)
        return sock
    raise error or TimeoutError(f"no connection to {host}:{port} within {timeout:g} s")
