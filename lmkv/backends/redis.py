"""Redis tiers: redis:// and rediss:// (one server), redis-cluster:// (Redis Cluster).

Values are stored under ``<key_prefix><key>``; the prefix comes from the URL's
``key_prefix`` query parameter (default ``lmkv:``). Batches go out as one pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from .base import Arrived, BackendError, StorageBackend, report
from .registry import redact_url


def _split_prefix(url: str) -> tuple[str, str]:
    parts = urlparse(url)
    query = parse_qs(parts.query)
    prefix = query.pop("key_prefix", ["lmkv:"])[0]
    rest = urlencode({k: v[0] for k, v in query.items()})
    return urlunparse(parts._replace(query=rest)), prefix


class RedisBackend(StorageBackend):
    def __init__(self, url: str, timeout: float = 2.0, max_value_size: int = 1 << 30):
        import redis
        from redis.exceptions import RedisClusterException

        # RedisClusterException (no node reachable, ...) is not a RedisError
        self._errors = (redis.RedisError, RedisClusterException, OSError)
        url, self.prefix = _split_prefix(url)
        self.max_value_size = max_value_size
        scheme = urlparse(url).scheme
        try:
            if scheme == "redis-cluster":
                from redis.backoff import NoBackoff
                from redis.cluster import RedisCluster
                from redis.retry import Retry

                self.client = RedisCluster.from_url(
                    url.replace("redis-cluster://", "redis://", 1), socket_timeout=timeout,
                    socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 0),  # a call is bounded by one timeout, not four
                )
            else:
                self.client = redis.Redis.from_url(
                    url, socket_timeout=timeout, socket_connect_timeout=timeout,
                )
        except self._errors as e:
            raise BackendError(f"cannot connect to {redact_url(url)}: {e}") from e

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.prefix + key, value)
            pipe.execute()
        except self._errors as e:
            raise BackendError(f"redis put failed: {e}") from e

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each value's first max_value_size + 1 bytes at most (GETRANGE): a longer value is
        not a chunk's frame, a miss, and never read whole; so is an empty one (none stored)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.getrange(self.prefix + key, 0, self.max_value_size)
            values = pipe.execute()
        except self._errors as e:
            raise BackendError(f"redis get failed: {e}") from e
        out: list[bytes | None] = []
        for v in values:
            if not isinstance(v, bytes):  # not what GETRANGE answers: a bad store
                raise BackendError(f"redis answered a GETRANGE with a {type(v).__name__}")
            out.append(v if 0 < len(v) <= self.max_value_size else None)
        return out

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        """One pipelined batch of GETs, each value copied into its ``out``."""
        lengths: list[int | None] = []
        for value, out in zip(self.get(keys), outs, strict=True):
            if value is None or len(value) > len(out):
                lengths.append(None)
                continue
            out[: len(value)] = value
            lengths.append(len(value))
        report(lengths, arrived)
        return lengths

    def contains(self, keys: Sequence[str]) -> list[bool]:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return [bool(n) for n in pipe.execute()]
        except self._errors as e:
            raise BackendError(f"redis exists failed: {e}") from e

    def remove(self, keys: Sequence[str]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self.prefix + key)
            pipe.execute()
        except self._errors as e:
            raise BackendError(f"redis delete failed: {e}") from e

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self.client.close()
