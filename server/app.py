"""The lmkv_server process: store, persistence, lm:// listener and admin HTTP.

Threads: the Listener's (accept + one per connection), the Persister's writer, and the
main thread's event loop, which serves the admin HTTP and waits for SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
from collections.abc import Iterator

import uvicorn

from .admin import build_admin_app
from .arena import PageArena
from .config import ServerConfig
from .listener import Listener
from .metrics import build_registry
from .persistence import Persister
from .store import Store

log = logging.getLogger("lmkv_server")


def run(config: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM, then flush persistence and return."""
    asyncio.run(serve(config))


class ListenError(OSError):
    """A port cannot be bound (in use, not permitted, no such address)."""


async def serve(config: ServerConfig) -> None:
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
    arena = PageArena(config.num_pages, config.page_size, config.prefault)
    store = Store(arena, policy=config.cache_policy)
    persister = None
    if config.persist_dir is not None:
        persister = Persister(config.persist_dir, store)
        result = persister.load()
        log.info(
            "reloaded %d values from %s (%d corrupt skipped, %d without room)",
            result.loaded,
            config.persist_dir,
            result.corrupt,
            result.no_room,
        )
        persister.start()
    listener = Listener(sock, store, config)
    listener.start()
    try:  # whatever fails from here on, the listener and the persister are stopped
        await _serve(config, store, listener, persister, admin_sock)
    finally:
        log.info("shutting down")
        await asyncio.to_thread(listener.stop)
        if persister is not None:
            await asyncio.to_thread(persister.stop)
            log.info("persistence flushed (%d files written)", persister.files_written)


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
    if admin is not None and admin_task is not None:
        if admin_task in done:  # the admin server ended by itself: a failure
            waiter.cancel()
            admin_task.result()  # raises what ended it
            raise RuntimeError("the admin HTTP server stopped")
        admin.should_exit = True
        await admin_task


def _bind(host: str, port: int, what: str) -> socket.socket:
    try:
        return socket.create_server((host, port), backlog=1024)
    except OSError as e:
        hint = " (is another lmkv_server running?)" if e.errno == errno.EADDRINUSE else ""
        why = os.strerror(e.errno) if e.errno else str(e)
        raise ListenError(f"cannot listen on {what}{host}:{port}: {why}{hint}") from e


class _AdminServer(uvicorn.Server):
    """uvicorn without its own signal handling: the server's loop owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 spelling
        pass
