"""URL scheme -> backend, each imported only when chosen."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlparse

from .base import Arrived, BackendError, StorageBackend

log = logging.getLogger(__name__)

# scheme -> (module, class)
SCHEMES = {
    "lm": ("lmkv.backends.lm", "LMBackend"),
    "redis": ("lmkv.backends.redis", "RedisBackend"),
    "rediss": ("lmkv.backends.redis", "RedisBackend"),
    "redis-cluster": ("lmkv.backends.redis", "RedisBackend"),
    "mooncakestore": ("lmkv.backends.mooncake", "MooncakeBackend"),
}


def redact_url(url: str) -> str:
    """``url`` as logs and errors show it: a password in it (redis://:PASSWORD@host, or
    user:PASSWORD@, or a query setting whose name holds "password", as ssl_password)
    replaced by ***."""
    parts = urlparse(url)
    if "password" in parts.query.lower():  # (the other settings as they were written)
        parts = parts._replace(query="&".join(
            f"{item.partition('=')[0]}=***" if "password" in item.partition("=")[0].lower()
            else item for item in parts.query.split("&")))
    if parts.password is None:
        return parts.geturl()
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}***@{host}").geturl()


def check_url(url: str) -> str:
    """The URL's scheme, or ValueError naming what is wrong (at start, not at the first
    call: a tier whose URL can never work would only ever log its failures)."""
    parts = urlparse(url)
    raw, url = url, redact_url(url)  # (as the errors name it)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"unsupported scheme {parts.scheme!r} in {url!r} (known: {', '.join(SCHEMES)})")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise ValueError(f"bad port in {url!r}") from None
    if parts.scheme == "lm":
        from .lm import parse_lm_url

        parse_lm_url(url)  # a port, no path
    elif parts.scheme == "mooncakestore":
        from .mooncake import _settings

        try:  # the URL's settings and MOONCAKE_CONFIG_PATH's file
            _settings(url)
        except BackendError as e:
            raise ValueError(f"{e} ({url!r})") from None
    else:
        from .redis import check_redis_url

        try:  # its query settings and database, as the client will read them
            check_redis_url(raw)
        except ValueError as e:
            raise ValueError(f"{e} ({url!r})") from None
    return parts.scheme


def create_backend(url: str, timeout: float, max_value_size: int | None = None) -> StorageBackend:
    """The backend for ``url``; it connects on first use, and again after a failure, so a
    store that is down at start-up is picked up once it comes back. ``max_value_size``: the
    largest value it reads (a chunk's largest frame: a larger one is a miss, never read
    whole) or writes."""
    module, name = SCHEMES[check_url(url)]
    cls = getattr(importlib.import_module(module), name)
    bound = {} if max_value_size is None else {"max_value_size": max_value_size}
    return LazyBackend(lambda: cls(url, timeout=timeout, **bound), redact_url(url))


class LazyBackend(StorageBackend):
    """Connects on first use and again after a BackendError; forwards every method of the
    contract (batched reads above all: one round trip per batch, not per chunk)."""

    def __init__(self, factory: Callable[[], StorageBackend], url: str):
        self._factory = factory
        self._url = url
        self._backend: StorageBackend | None = None
        self._regions: list[memoryview] = []
        self._made = False  # a client was made before (later ones are made after failures)

    def _connected(self) -> StorageBackend:
        if self._backend is None:
            try:
                backend = self._factory()  # raises BackendError while the store is unreachable
            except BackendError:
                raise
            except Exception as e:  # a client library's own error type: the tier fails, the engine does not
                raise BackendError(f"cannot connect to {self._url}: {type(e).__name__}: {e}") from e
            for region in self._regions:
                backend.register_memory(region)
            self._backend = backend
            # (again after each failure, while the store is down: the tier says when it
            # answers again)
            log.log(logging.DEBUG if self._made else logging.INFO, "lmkv: client for %s made (it "
                    "may connect at its first request; a failed request is logged apart)", self._url)
            self._made = True
        return self._backend

    def _call(self, fn):
        backend = self._connected()
        try:
            return fn(backend)
        except Exception as e:  # a client library's error of its own (a garbage reply it could
            if not backend.reconnects:  # not parse, ...) is the store's fault too: the tier
                self._reset()  # backs off and counts it, the engine recomputes
            if isinstance(e, BackendError):
                raise
            raise BackendError(f"{self._url}: {type(e).__name__}: {e}") from e

    def _reset(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.close()

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        self._call(lambda b: b.put(items))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call(lambda b: b.get(keys))

    def get_into(self, key: str, out: memoryview) -> int | None:
        return self._call(lambda b: b.get_into(key, out))

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        return self._call(lambda b: b.get_into_many(keys, outs, arrived))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda b: b.contains(keys))

    def remove(self, keys: Sequence[str]) -> None:
        self._call(lambda b: b.remove(keys))

    def will_get(self, keys: Sequence[str]) -> None:
        if self._backend is not None:  # a hint never opens a connection
            self._backend.will_get(keys)

    @property
    def num_evictions(self) -> int:
        return self._backend.num_evictions if self._backend is not None else 0

    @property
    def torn_reads(self) -> bool:
        return self._backend is not None and self._backend.torn_reads

    @property
    def num_unreadable(self) -> int:
        return self._backend.num_unreadable if self._backend is not None else 0

    @property
    def num_not_stored(self) -> int:
        return self._backend.num_not_stored if self._backend is not None else 0

    def register_memory(self, region: memoryview) -> None:
        self._regions.append(region)
        if self._backend is not None:
            self._backend.register_memory(region)

    def close(self) -> None:
        self._reset()
