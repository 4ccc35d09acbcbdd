"""The lmkv_server process: store, persistence, lm:// listener and admin HTTP.

Threads: the Listener's (accept + one per connection), the Persister's writer, and the
main thread's event loop, which serves the admin HTTP and waits for SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import resource
import signal
import socket
from collections.abc import Iterator

import uvicorn

from lmkv.host_memory import host_memory_available
from lmkv.http_limits import bounded_http

from .admin import build_admin_app
from .arena import PageArena
from .config import ServerConfig
from .listener import Listener
from .metrics import build_registry
from .persistence import Persister
from .store import Store

log = logging.getLogger("lmkv_server")

ADMIN_CONNECTIONS = 16  # admin HTTP connections open at once (more are closed at accept)
ADMIN_WRITE_TIMEOUT = 5.0  # an admin client that stops reading its response this long is cut off
ADMIN_STOP_TIMEOUT = 5.0  # at a stop, admin responses still being sent get this long
RESERVED_FILES = 32  # descriptors besides connections: listening sockets, persistence, logs


def run(config: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM, then flush persistence and return."""
    asyncio.run(serve(config))


class ListenError(OSError):
    """The server cannot start: a port cannot be bound (in use, not permitted, no such
    address), its memory cannot be mapped, or it may open too few files."""


async def serve(config: ServerConfig) -> None:
    config = _fit_open_files(config)
    # both ports before the arena is touched: a port in use fails at once
    sock = _bind(config.host, config.port, "")
    admin_sock = (_bind(config.host, config.admin_port, "--admin-port ")
                  if config.admin_port is not None else None)
    if not config.loopback_only:
        log.warning(
            "binding %s: the lm:// protocol has no authentication or encryption; %s can "
            "read and overwrite every cached value",
            config.host,
            "clients in --allow " + ",".join(map(str, config.allow))
            if config.allow
            else "anyone who can reach this port",
        )
    try:
        nbytes, available = config.num_pages * config.page_size, host_memory_available()
        if available is not None and nbytes > available:  # (filling it would end in the OOM killer)
            raise ListenError(f"--max-memory {nbytes / 1e9:.3g} GB is more than this machine (or its "
                              f"container) has available ({max(available, 0) / 1e9:.3g} GB); give less")
        try:
            arena = PageArena(config.num_pages, config.page_size, config.prefault)
        except (OSError, OverflowError) as e:  # ENOMEM: more than the machine can map
            raise ListenError(f"--max-memory {config.num_pages * config.page_size} bytes cannot be "
                              f"mapped ({e}); give a size this machine has") from e
        store = Store(arena, policy=config.cache_policy)
        persister = None
        if config.persist_dir is not None:
            persister = Persister(config.persist_dir, store)
            if (why := persister.unsafe()) is not None:
                raise ListenError(why)
            if not persister.lock():
                raise ListenError(f"--persist-dir {config.persist_dir} is in use by another "
                                  "process (an lmkv_server still running?): give each server "
                                  "its own directory")
            result = persister.load()
            log.info("reloaded %d values from %s (%d corrupt and %d without room deleted; left "
                     "in place: %d unreadable, %d of another format, %d other files)",
                     result.loaded, config.persist_dir, result.corrupt, result.no_room,
                     result.unreadable, result.foreign, result.others)
        _listen(sock, "")  # ready: connections are answered from now on
        if admin_sock is not None:
            _listen(admin_sock, "--admin-port ")
    except BaseException:  # the start failed: nothing listens on
        sock.close()
        if admin_sock is not None:
            admin_sock.close()
        raise
    if persister is not None:
        persister.start()
    listener = Listener(sock, store, config)
    listener.start()
    try:  # whatever fails from here on, the listener and the persister are stopped
        await _serve(config, store, listener, persister, admin_sock)  # (until SIGTERM/SIGINT)
    finally:
        log.info("shutting down")
        await asyncio.to_thread(listener.stop)
        if persister is not None:
            if persister.pending:
                log.info("writing %d pending values to %s before stopping (SIGTERM or SIGINT "
                         "again stops without them)", persister.pending, config.persist_dir)
            await asyncio.to_thread(persister.stop)
            log.info("persistence flushed (%d files written)", persister.files_written)


def _stop_at_next_signal(persister: Persister | None) -> None:
    """While the server stops, SIGTERM or SIGINT ends the process at once (a persist
    directory whose writes hang, an NFS mount gone, held the stop for ever). Files are
    written atomically: what is not written is lost, nothing is left torn."""
    loop = asyncio.get_running_loop()

    def now() -> None:
        left = persister.pending if persister is not None else 0
        log.error("stopped at a second signal: %d values not persisted", left)
        logging.shutdown()
        os._exit(1)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, now)


async def _serve(config: ServerConfig, store: Store, listener: Listener,
                 persister: Persister | None, admin_sock: socket.socket | None) -> None:
    """Serve the admin HTTP (if any) until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    admin = admin_task = None
    if admin_sock is not None:
        registry = build_registry(store, listener.traffic, persister)
        app = build_admin_app(config, store, listener.traffic, persister, registry)
        admin = _AdminServer(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.admin_port,
                log_level=config.log_level.lower(),
                access_log=False,
                lifespan="off",
                http=bounded_http(ADMIN_CONNECTIONS, write_timeout=ADMIN_WRITE_TIMEOUT),
                timeout_graceful_shutdown=ADMIN_STOP_TIMEOUT,  # (nothing waits for ever)
                backlog=ADMIN_CONNECTIONS,  # also what one pass of asyncio's accept loop takes
            )
        )
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
    log.info(
        "lmkv_server listening on %s:%d (max_memory=%d bytes, cache_policy=%s, admin port %s)",
        config.host,
        listener.port,
        store.arena.capacity,
        config.cache_policy,
        config.admin_port,
    )
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([t for t in (waiter, admin_task) if t is not None],
                                 return_when=asyncio.FIRST_COMPLETED)
    if admin_task in done:  # the admin server ended by itself: a failure
        waiter.cancel()
        admin_task.result()  # raises what ended it
        raise RuntimeError("the admin HTTP server stopped")
    _stop_at_next_signal(persister)  # from the first signal on: nothing of the stop waits for ever
    if admin is not None and admin_task is not None:
        admin.should_exit = True
        await admin_task


def _fit_open_files(config: ServerConfig) -> ServerConfig:
    """Raise the open-file limit to what --max-connections needs (up to the hard limit);
    where the hard limit is lower, lower max_connections to fit it, with a warning: past
    the limit, accept fails and new clients would hang in the backlog, never refused."""
    need = config.max_connections + RESERVED_FILES + ADMIN_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= need:
        return config
    fit = soft - RESERVED_FILES - ADMIN_CONNECTIONS
    if fit < 1:
        raise ListenError(f"the process may open only {soft} files (ulimit -n): too few to "
                          "serve clients; raise the limit")
    log.warning("--max-connections lowered from %d to %d: the process may open at most %d "
                "files (ulimit -n; raise it to serve more)", config.max_connections, fit, soft)
    return dataclasses.replace(config, max_connections=fit)


def _bind(host: str, port: int, what: str) -> socket.socket:
    """A socket bound to the port, not listening yet (``_listen``): until then a client's
    connect is refused, so a client, or a TCP readiness probe, sees the store as down
    rather than accepted and left unanswered while the server touches its memory and
    reloads what it persisted."""
    try:  # the address's own family (a name's IPv4 address where it has one, as before)
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise _listen_error(e, host, port, what) from e
    family, _, _, _, address = next((f for f in found if f[0] == socket.AF_INET), found[0])
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ListenError(f"cannot open a socket for {what}{host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a restart's TIME_WAITs)
        sock.bind(address)
        return sock
    except OSError as e:
        sock.close()
        raise _listen_error(e, host, port, what) from e


def _listen(sock: socket.socket, what: str) -> None:
    """Start listening. Another server that bound the same port while neither listened
    (two started at once) is found here: the one that listens second stops, by name."""
    try:
        sock.listen(1024)
    except OSError as e:
        host, port = sock.getsockname()[:2]
        raise _listen_error(e, host, port, what) from e


def _listen_error(e: OSError, host: str, port: int, what: str) -> ListenError:
    """The error of a bind or listen that failed, by name (a port in use: with a hint)."""
    hint = " (is another lmkv_server running?)" if e.errno == errno.EADDRINUSE else ""
    why = e.strerror or (os.strerror(e.errno) if e.errno else str(e))  # (a lookup's too)
    return ListenError(f"cannot listen on {what}{host}:{port}: {why}{hint}")


class _AdminServer(uvicorn.Server):
    """uvicorn without its own signal handling: the server's loop owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 spelling
        pass
