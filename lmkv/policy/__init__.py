"""Cache policies by name (``cache_policy``), each imported only when chosen."""

from __future__ import annotations

import importlib

from .base import CachePolicy

POLICIES = {  # name -> (module, class)
    "lru": ("lru", "LRUPolicy"),
    "prefix_lru": ("prefix_lru", "PrefixLRUPolicy"),
    "prefix_lfu": ("prefix_lfu", "PrefixLFUPolicy"),
    "prefix_horizon": ("prefix_horizon", "PrefixHorizonPolicy"),
    "prefix_adaptive": ("prefix_adaptive", "PrefixAdaptivePolicy"),
}
DEFAULT_POLICY = "prefix_adaptive"  # never below LRU on any trace measured, most above (docs/operations.md)


def make_policy(name: str) -> CachePolicy:
    """A new policy object of the registered ``name``."""
    module, cls = POLICIES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


__all__ = ["CachePolicy", "DEFAULT_POLICY", "POLICIES", "make_policy"]
