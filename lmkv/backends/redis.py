"""Redis tiers: redis:// and rediss:// (one server), redis-cluster:// (Redis Cluster).

Values are stored under ``<key_prefix><key>``; the prefix comes from the URL's
``key_prefix`` query parameter (default ``lmkv:``). Batches go out as one pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from . import net
from .base import Arrived, BackendError, StorageBackend, report
from .registry import redact_url


def _split_prefix(url: str) -> tuple[str, str]:
    parts = urlparse(url)
    query = parse_qs(parts.query, keep_blank_values=True)  # (key_prefix= : no prefix)
    prefix = query.pop("key_prefix", ["lmkv:"])[0]
    rest = urlencode({k: v[0] for k, v in query.items()})
    return urlunparse(parts._replace(query=rest)), prefix


# what redis-py takes in a URL's query besides the settings it parses itself
_URL_SETTINGS = {"client_name", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile",
                 "ssl_keyfile", "ssl_password"}


def check_redis_url(url: str) -> None:
    """ValueError naming a setting of a redis:// URL the client would refuse at its first
    call (a value it cannot read, a setting it does not know, a database on a cluster)."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

    url, _ = _split_prefix(url)
    cluster = url.startswith("redis-cluster://")
    path = urlparse(url).path.strip("/")
    if path and not path.isdigit():  # (redis-py takes such a path as database 0, silently)
        raise ValueError(f"the Redis database in the URL's path must be a number, not {path!r}")
    settings = parse_url(url.replace("redis-cluster://", "redis://", 1))  # (ValueError: a bad value)
    known = set(URL_QUERY_ARGUMENT_PARSERS) | _URL_SETTINGS | {"host", "port", "username",
                                                               "password", "path", "connection_class"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown Redis URL setting(s): {', '.join(unknown)}")
    if cluster and settings.get("db", 0) != 0:
        raise ValueError(f"a Redis Cluster has database 0 only, not {settings['db']}")


class RedisBackend(StorageBackend):
    def __init__(self, url: str, timeout: float = 2.0, max_value_size: int = 1 << 30):
        import redis
        from redis.exceptions import AskError, MovedError, RedisClusterException, TryAgainError

        # RedisClusterException (no node reachable, ...) is not a RedisError
        self._errors = (redis.RedisError, RedisClusterException, OSError)
        self._moved = (MovedError, AskError, TryAgainError)  # a key's slot moved or moving
        self._stale_map = (MovedError, TryAgainError)
        url, self.prefix = _split_prefix(url)
        self.max_value_size = max_value_size
        parts = urlparse(url)
        self.cluster = parts.scheme == "redis-cluster"
        # a cluster client finds the other nodes (a failover's new primary) by itself: kept
        # after a failed call; a new one would know only the URL's node, which may be the
        # one that died
        self.reconnects = self.cluster
        self._remap = False  # the cluster's slot map is to be read again before the next batch
        self._new_nodes: dict[tuple[str, int], object] = {}  # ASK targets the map lacks
        if parts.hostname:  # redis-py's own lookups take no timeout: a DNS server that does
            # not answer fails this client within ``timeout`` (the next one looks up again)
            try:
                net.resolve(parts.hostname, parts.port or 6379, timeout)
            except OSError as e:
                raise BackendError(f"cannot connect to {redact_url(url)}: {e}") from e
        try:
            if self.cluster:
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
        self._checked("set", self._batch("set", [(self.prefix + k, (v,)) for k, v in items]))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each value's first max_value_size + 1 bytes at most (GETRANGE): a longer value is
        not a chunk's frame, a miss, and never read whole; so is an empty one (none stored),
        and a key of another Redis type or one whose slot is moving (that key alone)."""
        values = self._batch("getrange", [(self.prefix + k, (0, self.max_value_size)) for k in keys])
        out: list[bytes | None] = []
        for v in self._misses("getrange", values):
            if v is not None and not isinstance(v, bytes):  # not what GETRANGE answers
                raise BackendError(f"redis answered a GETRANGE with a {type(v).__name__}")
            out.append(v if v is not None and 0 < len(v) <= self.max_value_size else None)
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
        found = self._batch("exists", [(self.prefix + key, ()) for key in keys])
        return [bool(n) for n in self._misses("exists", found)]

    def remove(self, keys: Sequence[str]) -> None:
        self._checked("delete", self._batch("delete", [(self.prefix + key, ()) for key in keys]))

    def _checked(self, command: str, replies: list) -> None:
        """A write's replies: any error (out of memory, read-only, no permission) fails it."""
        for reply in replies:
            if isinstance(reply, Exception):
                hint = (" (Redis is full and evicts none of lmkv's keys: lmkv sets no TTL, so "
                        "under maxmemory-policy noeviction or volatile-* nothing makes room; "
                        "use allkeys-lru)") if "maxmemory" in str(reply) else ""  # (redis-py drops "OOM")
                raise BackendError(f"redis {command} failed: {reply}{hint}")

    def _misses(self, command: str, replies: list) -> list:
        """A read's replies, the error replies that concern one key alone (another type;
        a slot being moved: the next batch maps them again) as None; others fail it."""
        out = []
        for reply in replies:
            if isinstance(reply, Exception):
                if not (isinstance(reply, self._moved) or str(reply).startswith("WRONGTYPE")):
                    raise BackendError(f"redis {command} failed: {reply}")
                reply = None
            out.append(reply)
        return out

    def _batch(self, command: str, calls: list[tuple[str, tuple]]) -> list:
        """``command`` on each (key, args), pipelined: the replies in order, error replies as
        exceptions (the callers decide). A cluster's keys go out as one plain pipeline per
        node, the call failing at the first node that fails: redis-py's own cluster pipeline
        sends each command that timed out again on its own, one timeout per key of a hung
        node, on the caller's thread. After a node failed or a slot moved, the next batch
        first maps the cluster again (a failover's new primary)."""
        try:
            if not self.cluster:
                pipe = self.client.pipeline(transaction=False)
                for key, args in calls:
                    getattr(pipe, command)(key, *args)
                return pipe.execute(raise_on_error=False)
            if self._remap:
                self._remap = False
                self.client.nodes_manager.initialize()
            nodes = [self.client.get_node_from_key(key) for key, _ in calls]
            out: list = [None] * len(calls)
            for i, reply in self._on_nodes(command, calls, nodes):
                self._remap = self._remap or isinstance(reply, self._stale_map)
                out[i] = reply
            self._follow_asks(command, calls, out)
            return out
        except self._errors as e:
            raise BackendError(f"redis {command} failed: {e}") from e

    def _follow_asks(self, command: str, calls: list[tuple[str, tuple]], out: list) -> None:
        """Commands answered ASK (their slot is moving, and the key is not, or no longer,
        on the node that had it) sent again to the node it names, each after an ASKING, one
        pipeline per node; the slot map stays (the slot still belongs to the first node).
        A MOVED reply there has the map read again before the next batch."""
        from redis.exceptions import AskError

        nodes = [self._node(r.host, r.port) if isinstance(r, AskError) else None for r in out]
        for i, reply in self._on_nodes(command, calls, nodes, asking=True):
            self._remap = self._remap or isinstance(reply, self._stale_map)
            out[i] = reply

    def _node(self, host: str, port: int):
        """The cluster node at ``host:port``; one the slot map does not name yet (a node
        added to take slots holds none until the first has moved) is kept apart, with its
        connection, for as long as this client lives."""
        node = self.client.get_node(host=host, port=port)
        if node is None:
            node = self._new_nodes.get((host, port))
        if node is None:
            from redis.cluster import PRIMARY, ClusterNode

            node = self._new_nodes[host, port] = ClusterNode(host, port, server_type=PRIMARY)
        return node

    def _on_nodes(self, command: str, calls: list[tuple[str, tuple]], nodes: list,
                  asking: bool = False) -> Iterator[tuple[int, object]]:
        """``command`` on each call whose node is given, one pipeline per node, each command
        after an ASKING with ``asking``: (index, reply) pairs. A node that fails fails the
        call, and the slot map is read again before the next batch (a dead primary answers
        nothing, never MOVED)."""
        by_node: dict[str, tuple[object, list[int]]] = {}
        for i, node in enumerate(nodes):
            if node is not None:
                by_node.setdefault(node.name, (node, []))[1].append(i)
        for node, indexes in by_node.values():
            pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
            for i in indexes:
                if asking:
                    pipe.execute_command("ASKING")
                getattr(pipe, command)(calls[i][0], *calls[i][1])
            try:
                replies = pipe.execute(raise_on_error=False)
            except self._errors:
                self._remap = True
                raise
            yield from zip(indexes, replies[1::2] if asking else replies, strict=True)

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self.client.close()
        for node in self._new_nodes.values():
            if node.redis_connection is not None:
                with contextlib.suppress(*self._errors):
                    node.redis_connection.close()
