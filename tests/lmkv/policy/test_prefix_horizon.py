"""prefix_horizon: its invariants under random operations (bounded size, pinned chunks never
evicted, only leaves evicted, no chunk held without its parent), and what it is for: a loop
of prompts larger than the cache, where LRU serves nothing, is served in part."""

from __future__ import annotations

import random

import pytest

from lmkv.policy import make_policy
from lmkv.policy.prefix_horizon import PrefixHorizonPolicy
from tests.policy_checks import replay_checked, shared_prefix_prompts


@pytest.mark.parametrize("seed", range(4))
def test_invariants_under_random_operations(seed):
    rng = random.Random(seed)
    prompts = shared_prefix_prompts(rng)
    pol = make_policy("prefix_horizon")
    served, held = replay_checked(pol, prompts, 25, rng)
    assert served > 0 and pol.horizon >= 0
    pol._compact()  # rebuilt heaps hold exactly the leaves
    leaves = {k for k in held if all(p != k for p in held.values())}
    assert {k for _, k in pol._oldest} == leaves


def test_a_loop_larger_than_the_cache_is_served_in_part():
    loop = [[f"p{j}-{i}" for i in range(4)] for j in range(10)]  # 40 chunks, cache of 20
    prompts = loop * 60
    lru_served, _ = replay_checked(make_policy("lru"), prompts, 20, prefix=False)
    assert lru_served == 0  # each chunk goes just before its reuse
    pol = make_policy("prefix_horizon")
    served, _ = replay_checked(pol, prompts, 20)
    assert pol.horizon > 0  # learned: hold longer than LRU holds
    assert served >= 0.1 * 4 * 10 * 60  # a part of the loop stays


def test_the_horizon_shrinks_when_a_new_chunk_given_up_returns_soon():
    pol = PrefixHorizonPolicy()
    pol.horizon = 100.0
    for i in range(10):
        pol.inserted(f"k{i}", None)
    assert pol.victim(lambda _: True) == "k9"  # nothing past the horizon: the newest goes
    pol.removed("k9")
    pol.inserted("k9", None)  # back within 10 inserts: LRU would have held it
    assert pol.horizon == pytest.approx(100.0 - 10 * 0.01 * 9)
    assert pol.nodes["k9"].count == 2  # and it comes back as used again
