"""prefix_adaptive: its invariants under random operations, and that it follows the better
of its candidate horizons, each run over the whole workload: the horizon on a loop of
prompts larger than the cache (where LRU serves nothing), prefix LRU on a recency-friendly
pattern (where any horizon loses)."""

from __future__ import annotations

import random

import pytest

from lmkv.policy import make_policy
from lmkv.policy.prefix_adaptive import RATE, SCALES
from lmkv.policy.prefix_horizon import PrefixHorizonPolicy
from tests.policy_checks import replay_checked, shared_prefix_prompts


@pytest.mark.parametrize("seed", range(3))
def test_invariants_under_random_operations(seed):
    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng)
    pol = make_policy("prefix_adaptive")
    served, held = replay_checked(pol, prompts, 25, rng)
    assert served > 0 and set(pol.nodes) == held.keys()
    assert all(len(s.held) <= pol.capacity + 1 for s in pol.shadows)  # shadows: 1/RATE of it


def _loop() -> list[list[str]]:
    """300 prompts of 4 chunks (1,200 chunks) in a loop, 20 times."""
    return [[f"p{j}-{i}" for i in range(4)] for j in range(300)] * 20


def _recency() -> list[list[str]]:
    """Sessions growing 2 chunks a turn, the newest ones the likeliest to go on; a session
    ends past 30 chunks."""
    rng = random.Random(0)
    prompts: list[list[str]] = []
    live: list[list[str]] = []
    for n in range(6000):
        if len(live) < 8 or rng.random() < 0.15:
            live.append([f"s{n}-0"])
        s = live[-1 - min(int(rng.expovariate(0.5)), len(live) - 1)]
        s.extend(f"{s[0]}-{len(s)}-{i}" for i in range(2))
        prompts.append(list(s))
        if len(s) > 30:
            live.remove(s)
    return prompts


@pytest.mark.parametrize("pattern, capacity, best", [(_loop, 800, "horizon"), (_recency, 400, "lru")])
def test_follows_the_better_candidate(pattern, capacity, best):
    prompts = pattern()
    served = {s: replay_checked(PrefixHorizonPolicy(s), prompts, capacity)[0] for s in SCALES}
    lru = replay_checked(make_policy("prefix_lru"), prompts, capacity)[0]
    assert lru == served[0.0]  # horizon 0 is prefix LRU
    horizon = max(served[s] for s in SCALES[1:])
    if best == "horizon":
        assert lru == 0 and horizon > 0.5 * 4 * 300 * 20  # a loop: LRU loses each chunk
    else:
        assert horizon < 0.7 * lru  # recency: holding old sessions keeps out new ones
    adaptive = replay_checked(make_policy("prefix_adaptive"), prompts, capacity)[0]
    assert adaptive >= 0.95 * max(lru, horizon)


def test_shadows_stay_bounded_when_the_cache_never_fills():
    """A cache that drops its keys itself (never asking for a victim) leaves no pile of
    keys in the shadows."""
    pol = make_policy("prefix_adaptive")
    for i in range(20000):
        key = f"k{i}"
        pol.inserted(key, None)
        pol.removed(key)
    assert pol.capacity is None and len(pol) == 0
    assert all(len(s.held) <= 66 for s in pol.shadows)  # 64 + 2 * 1 / RATE, plus the new key


def test_a_disk_tier_restarted_with_a_lower_cap_sizes_its_shadows_to_the_new_cap(tmp_path):
    """The capacity is read at the first victim after an insert: a tier that starts over
    its cap (evicting from 160 files to 16) does not leave the shadows ten times too big."""
    from lmkv.backends.disk import DiskBackend

    DiskBackend(tmp_path, 160_000, "prefix_adaptive", direct=False).put(
        [(f"k{i}", b"x" * 1000) for i in range(160)])
    disk = DiskBackend(tmp_path, 16_000, "prefix_adaptive", direct=False)
    assert len(disk.index) == 16
    disk.put([("new", b"y" * 1000), ("newer", b"y" * 1000)])  # the second evicts after an insert
    assert disk.policy.capacity == 16 / RATE
