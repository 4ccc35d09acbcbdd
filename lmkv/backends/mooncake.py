"""mooncakestore://master_host:port/ : a Mooncake Store (master + storage segments).

Settings other than the master's address follow LMCache's names, from the JSON file named
by MOONCAKE_CONFIG_PATH or the URL's query: local_hostname, metadata_server,
global_segment_size, local_buffer_size, protocol, device_name. Chunks move zero-copy
(put_from / get_into) when they live in memory registered with ``register_memory`` (lmkv's
chunk pool); otherwise through Python bytes and the client's local buffer, which bounds
them. A put the store declines (full, a quota) is not stored, not a failure. The client's
calls to the master and its transfers without progress time out after ``remote_timeout``
(Mooncake's MC_RPC_TIMEOUT_MS, MC_TCP_PROGRESS_TIMEOUT_SEC and MC_TCP_STATUS_TIMEOUT_SEC,
unless set: its defaults are 30 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import parse_qs, urlparse

from ..logs import LogThrottle
from . import net
from .base import Arrived, BackendError, StorageBackend, report

log = logging.getLogger(__name__)
NOT_FOUND = -704
TOO_SMALL = -600  # get_into's buffer is smaller than the object (INVALID_PARAMS)
# a read's codes that are a miss of that key alone, not a failing store: absent, too large
# for a chunk, being written now (REPLICA_IS_NOT_READY), its lease ran out (LEASE_EXPIRED)
MISSES = (NOT_FOUND, TOO_SMALL, -703, -707)
# puts the store declines for want of room (NO_AVAILABLE_HANDLE: full until its eviction
# runs; TENANT_QUOTA_EXCEEDED) or because another client writes the key now
# (OBJECT_ALREADY_EXISTS): the chunk is not stored, and the store is not failing
NOT_STORED = {-200: "the store has no room for it (full, or no storage segment mounted)",
              -705: "another client is writing the key",
              -1700: "the tenant's quota is used up"}
_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40), ("k", 1 << 10),
          ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))


def _size(key: str, value) -> int:
    """A size setting as Mooncake's own config reads it: bytes, or a number with a binary
    unit ("1GB", "256mb", "0.5g")."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        unit, scale = next(((u, m) for u, m in _UNITS if text.endswith(u)), ("", 1))
        try:
            n = int(float(text[: len(text) - len(unit)]) * scale)
        except (ValueError, OverflowError):
            raise BackendError(f"Mooncake setting {key}: {value!r} is not a size (bytes, or a "
                               "number with kb, mb, gb or tb)") from None
    if n < 0:
        raise BackendError(f"Mooncake setting {key}: {value!r} is negative")
    return n


# what a mooncakestore:// URL's query may set (MOONCAKE_CONFIG_PATH's file is LMCache's, and
# may hold more)
_URL_SETTINGS = {"local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
                 "protocol", "device_name"}


def _settings(url: str) -> dict:
    parts = urlparse(url)
    host, port = parts.hostname, parts.port or 50051
    settings = {
        "local_hostname": "127.0.0.1",
        "metadata_server": f"http://{host}:8080/metadata",
        "global_segment_size": 0,  # store nothing in the engine process by default
        "local_buffer_size": 64 << 20,
        "protocol": "tcp",
        "device_name": "",
    }
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path) as f:
                settings.update(json.load(f))
        except (OSError, ValueError) as e:
            raise BackendError(f"cannot read MOONCAKE_CONFIG_PATH={path}: {e}") from e
    for key, values in parse_qs(parts.query).items():
        key = "device_name" if key == "device" else key  # (LMCache's URLs name it so)
        if key not in _URL_SETTINGS:
            raise BackendError(f"unknown Mooncake URL setting {key!r} (known: "
                               f"{', '.join(sorted(_URL_SETTINGS))}, device)")
        settings[key] = values[0]
    settings["master_server_address"] = f"{host}:{port}"
    for key in ("global_segment_size", "local_buffer_size"):
        settings[key] = _size(key, settings[key])
    return settings


def _check_metadata_server(url: str, timeout: float) -> None:
    """An HTTP metadata server must answer within ``timeout`` before setup() is called: a
    master that accepts connections but hangs (a stopped host) holds setup(), and the GIL
    with it, for minutes. When the server is the master's own, this shows a hung master;
    one apart from it does not. Any HTTP answer will do."""
    if not url.startswith("http://"):
        return  # etcd and the like: not probed
    try:
        parts = urlparse(url)
        net.resolve(parts.hostname or "", parts.port or 80, timeout)  # (urllib's timeout
        # leaves the name lookup out: a DNS server that does not answer would hold it)
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # not a proxy's answer
        direct.open(f"{url}?key=lmkv-probe", timeout=timeout).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except (OSError, ValueError) as e:
        raise BackendError(f"Mooncake metadata server {url} does not answer: {e}") from e


def _bound_master_calls(timeout: float) -> None:
    """Mooncake's calls to its master (and each of setup()'s 20 tries, which hold the GIL)
    wait MC_RPC_TIMEOUT_MS, 30 s unless set: a hung master stopped a lookup for 30 s and the
    whole engine for 10 minutes; and its TCP transfers of the chunks wait for a storage
    process that stopped answering MC_TCP_PROGRESS_TIMEOUT_SEC and MC_TCP_STATUS_TIMEOUT_SEC,
    30 s each unless set (a read held the I/O worker and the tier's lock that long). Set
    them from ``timeout`` where the operator did not (read when a client is made)."""
    bounds = {"MC_RPC_TIMEOUT_MS": str(max(1, round(timeout * 1000))),
              "MC_TCP_PROGRESS_TIMEOUT_SEC": str(max(1, math.ceil(timeout))),
              "MC_TCP_STATUS_TIMEOUT_SEC": str(max(1, math.ceil(timeout)))}
    set_here = [name for name in bounds if name not in os.environ or name in _timeouts_ours]
    for name in set_here:
        _timeouts_ours.add(name)
        os.environ[name] = bounds[name]
    if set_here:
        log.info("lmkv: Mooncake's calls to its master time out after %s ms and its transfers "
                 "after %s s without progress (remote_timeout; %s set them)",
                 os.environ["MC_RPC_TIMEOUT_MS"], os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"],
                 ", ".join(bounds))


_timeouts_ours: set[str] = set()  # the variables set here, not by the operator


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakeBackend(StorageBackend):
    # a failed call is answered by the same client once the master answers again (a
    # restarted master included), while making a new client (setup) against a master that
    # hangs holds the interpreter's GIL for up to 20 x 30 s: every thread of the engine stops
    reconnects = True
    torn_reads = True  # (upsert does not wait for readers' leases)

    max_value_size = 1 << 30  # a larger value is a miss, never read
    # values moved through Python bytes pass through the client's local buffer: a larger
    # one can be neither written nor read that way (set from local_buffer_size)
    copy_limit = 64 << 20

    def __init__(self, url: str, timeout: float = 2.0, max_value_size: int = 1 << 30):
        self.max_value_size = max_value_size
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise BackendError("mooncakestore:// needs `pip install mooncake-transfer-engine-non-cuda`"
                               f" (and libibverbs1): {e}") from e
        s = _settings(url)
        host, port = s["master_server_address"].rsplit(":", 1)
        try:  # setup() against a dead master blocks for ~90 s: fail fast instead
            net.connect(host, int(port), timeout).close()
        except OSError as e:
            raise BackendError(f"Mooncake master {host}:{port} unreachable: {e}") from e
        _check_metadata_server(s["metadata_server"], timeout)
        _bound_master_calls(timeout)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(s["local_hostname"], s["metadata_server"], s["global_segment_size"],
                              s["local_buffer_size"], s["protocol"], s["device_name"],
                              s["master_server_address"])
        if rc != 0:  # (its threads and buffers go; a new client is made at the next try)
            with contextlib.suppress(Exception):
                self.store.close()
            raise BackendError(f"Mooncake setup against {url} failed (code {rc})")
        self._regions: list[tuple[int, int]] = []  # registered [start, end) addresses
        self.copy_limit = s["local_buffer_size"]
        self.num_not_stored = 0
        self._quiet = LogThrottle()

    def register_memory(self, region: memoryview) -> None:
        start = _address(region)
        rc = self.store.register_buffer(start, len(region))
        if rc != 0:
            log.warning("Mooncake register_buffer failed (code %d): chunks go through copies", rc)
            return
        self._regions.append((start, start + len(region)))

    def _registered(self, view: memoryview) -> int | None:
        if view.readonly:
            return None
        addr = _address(view)
        if any(lo <= addr and addr + len(view) <= hi for lo, hi in self._regions):
            return addr
        return None

    def put(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """A put the store declines (full, a quota, a concurrent writer) or that cannot pass
        the local buffer is not stored (counted in ``num_not_stored``), not a failure."""
        for key, value in items:
            view = memoryview(value)
            addr = self._registered(view)
            if addr is not None:
                rc = self.store.upsert_from(key, addr, len(view))
            elif len(view) > self.copy_limit:
                self._not_stored("local_buffer", f"a {len(view)}-byte value does not fit "
                                 f"local_buffer_size ({self.copy_limit} bytes): raise it")
                continue
            else:
                rc = self.store.upsert(key, bytes(view))
            if rc in NOT_STORED:
                self._not_stored(str(rc), f"{NOT_STORED[rc]} (code {rc})")
            elif rc != 0:
                raise BackendError(f"Mooncake put of {len(view)} bytes failed (code {rc})")

    def _not_stored(self, why: str, message: str) -> None:
        self.num_not_stored += 1  # (a full store declines puts until it evicts: throttled)
        self._quiet.log(log, logging.WARNING, why, "lmkv: Mooncake did not store a chunk: %s "
                        "(each counted in lmkv_dropped_total)", message)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            size = self.store.get_size(key)
            if size == NOT_FOUND:
                out.append(None)
                continue
            if size < 0:
                raise BackendError(f"Mooncake get_size failed (code {size})")
            if size > self.max_value_size:  # not a chunk's frame
                out.append(None)
                continue
            if size > self.copy_limit:  # cannot pass the local buffer: a miss, not a failure
                self._quiet.log(log, logging.WARNING, "read_local_buffer", "lmkv: Mooncake holds "
                                "a %d-byte value that cannot be read through local_buffer_size "
                                "(%d bytes): served as a miss; raise it", size, self.copy_limit)
                out.append(None)
                continue
            value = self.store.get(key)
            if size and not value:  # the client's way of failing (a timeout), or the key
                if self.store.get_size(key) == NOT_FOUND:  # was evicted meanwhile: a miss
                    out.append(None)
                    continue
                raise BackendError(f"Mooncake get of a {size}-byte value returned nothing")
            out.append(value if len(value) == size else None)  # else replaced meanwhile
        return out

    def get_into(self, key: str, out: memoryview) -> int | None:
        addr = self._registered(out)
        if addr is None:
            return super().get_into(key, out)
        n = self.store.get_into(key, addr, len(out))  # one round trip: no get_size first
        if n in MISSES:
            return None  # absent, larger than a chunk frame, or being written: not read now
        if n < 0:
            raise BackendError(f"Mooncake get_into failed (code {n})")
        return n

    def get_into_many(self, keys: Sequence[str], outs: Sequence[memoryview],
                      arrived: Arrived | None = None) -> list[int | None]:
        """One batch_get_into when every target is in the registered pool."""
        addrs = [self._registered(out) for out in outs]
        if len(keys) < 2 or None in addrs:
            return super().get_into_many(keys, outs, arrived)
        codes = self.store.batch_get_into(list(keys), addrs, [len(out) for out in outs])
        lengths: list[int | None] = []
        for n in codes:
            if n in MISSES:  # (a key another engine writes now fails only that key)
                lengths.append(None)
            elif n < 0:
                raise BackendError(f"Mooncake batch_get_into failed (code {n})")
            else:
                lengths.append(n)
        report(lengths, arrived)
        return lengths

    def contains(self, keys: Sequence[str]) -> list[bool]:
        codes = self.store.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise BackendError("Mooncake batch_is_exist failed")
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            rc = self.store.remove(key, True)  # force: a lease from a recent get would refuse it
            if rc not in (0, NOT_FOUND):
                raise BackendError(f"Mooncake remove failed (code {rc})")

    def close(self) -> None:
        self.store.close()
