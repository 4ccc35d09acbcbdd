"""Cache policies by name (``cache_policy``), each imported only when chosen."""

from __future__ import annotations

import importlib

from .base import CachePolicy

POLICIES = {  # name -> (module, class)
    "lru": ("lru", "LRUPolicy"),
    "prefix_lru": ("prefix_lru", "PrefixLRUPolicy"),
    "prefix_lfu": ("prefix_lfu", "PrefixLFUPolicy"),
    "prefix_horizon": ("prefix_horizon", "PrefixHorizonPolicy"),
}
DEFAULT_POLICY = "prefix_lru"  # never below LRU on any trace measured (docs/operations.md)


def make_policy(name: str) -> CachePolicy:
    """A new policy object of the registered ``name``."""
    module, cls = POLICIES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


__all__ = ["CachePolicy", "DEFAULT_POLICY", "POLICIES", "make_policy"]
