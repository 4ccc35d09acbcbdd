"""TCP connections to remote stores within a time bound, the name lookup included: the
system resolver (getaddrinfo) takes no timeout, and a DNS server that does not answer holds
its caller through every retry (glibc: 5 s per try, 2 tries per server). A lookup runs on
a thread of its own and is waited for until the bound; one lookup per name runs at a time,
and callers that come while it hangs share it, so a dead DNS server costs one thread per
name, not one per call. An answer is kept ANSWER_TTL seconds (so a DNS server slower than
the bound still lets the next call through)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

ANSWER_TTL = 30.0  # seconds a name's addresses are used without looking it up again

_lookups: dict[tuple[str, int], Future] = {}  # the lookup in flight for each (host, port)
_answers: dict[tuple[str, int], tuple[float, list[tuple]]] = {}  # (when, addresses)
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
        when, found = _answers.get((host, port), (0.0, []))
        if found and time.monotonic() - when < ANSWER_TTL:
            return found
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
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except BaseException as e:  # (a set_exception: every waiter sees it)
        with _lookups_lock:
            del _lookups[host, port]
        lookup.set_exception(e)
        return
    with _lookups_lock:
        del _lookups[host, port]
        _answers[host, port] = (time.monotonic(), found)
    lookup.set_result(found)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port`` as ``socket.create_connection`` makes it (each
    address in the resolver's order, each given ``timeout`` seconds: an address that drops
    the connection's packets, a broken IPv6 route, does not keep the next from being tried),
    the lookup bounded by ``timeout`` too; the socket keeps ``timeout`` as its timeout.
    OSError (TimeoutError included) if none could be made."""
    error: OSError | None = None
    for family, kind, proto, _, address in resolve(host, port, timeout):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError as e:
            sock.close()
            error = e
            continue
        return sock
    raise error or OSError(f"{host} has no address")
