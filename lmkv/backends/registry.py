"""URL scheme -> backend, each imported only when chosen."""

from __future__ import annotations

import importlib
from urllib.parse import urlparse

from .base import StorageBackend

# scheme -> (module, class)
SCHEMES = {
    "lm": ("lmkv.backends.lm", "LMBackend"),
    "redis": ("lmkv.backends.redis", "RedisBackend"),
    "rediss": ("lmkv.backends.redis", "RedisBackend"),
    "redis-cluster": ("lmkv.backends.redis", "RedisBackend"),
}


def check_url(url: str) -> str:
    """The URL's scheme, or ValueError naming what is wrong."""
    parts = urlparse(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"unsupported scheme {parts.scheme!r} in {url!r} (known: {', '.join(SCHEMES)})")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    return parts.scheme


def create_backend(url: str, timeout: float) -> StorageBackend:
    module, name = SCHEMES[check_url(url)]
    cls = getattr(importlib.import_module(module), name)
    return cls(url, timeout=timeout)
