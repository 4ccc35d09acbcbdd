"""Cache policies: their invariants under random operations (bounded size, pinned chunks
never evicted, no chunk held without its prefix parent), driven directly and through the
real hot cache; and what each is for (prefix_lfu keeps a reused prefix through a scan)."""

from __future__ import annotations

import random

import pytest
import torch

from lmkv.config import ConfigError, load_config
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES, MemoryPool
from lmkv.policy import DEFAULT_POLICY, POLICIES, make_policy
from lmkv.storage.hot_cache import HotCache
from tests.policy_checks import replay_checked

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, chunk_size=4)
PREFIX_AWARE = ["prefix_lru", "prefix_lfu", "prefix_horizon", "prefix_adaptive"]


def _random_prompt(rng: random.Random) -> list[str]:
    """Chained keys: a prompt continues one of a few shared prefixes, then goes its own way."""
    root = rng.randrange(5)
    shared = rng.randrange(6)
    own = rng.randrange(1, 6)
    tag = rng.randrange(40)  # few enough that whole prompts recur
    return [f"r{root}-{i}" for i in range(shared)] + [f"r{root}-{shared}-t{tag}-{i}" for i in range(own)]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_invariants_under_random_operations(name, seed):
    rng = random.Random(seed)
    prompts = [_random_prompt(rng) for _ in range(3000)]
    replay_checked(make_policy(name), prompts, 30, rng, prefix=name in PREFIX_AWARE)


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_prefix_policies_refuse_a_chunk_whose_parent_is_gone(name):
    pol = make_policy(name)
    assert not pol.admit("b", "a", {}.__contains__)
    assert pol.admit("b", "a", {"a"}.__contains__) and pol.admit("a", None, {}.__contains__)


def test_prefix_lfu_keeps_a_reused_prefix_through_a_one_pass_scan():
    prompts = []
    for i in range(200):  # a reused 8-chunk prompt, then 20 one-pass chunks, repeated
        prompts.append([f"sys-{j}" for j in range(8)])
        prompts.append([f"scan{i}-{j}" for j in range(20)])

    def served(name: str) -> int:
        return replay_checked(make_policy(name), prompts, 16, prefix=name != "lru")[0]

    assert served("lru") == 0  # the scan flushes the prompt every time
    assert served("prefix_lfu") >= 195 * 8  # after a few repeats (counts build up), every one hits


def _hot(name: str, slots: int) -> HotCache:
    return HotCache(MemoryPool(LAYOUT, slots * (HEADER_BYTES + LAYOUT.chunk_bytes)), name)


@pytest.mark.parametrize("name", list(POLICIES))
def test_hot_cache_under_random_operations_keeps_pins_and_prefixes(name):
    rng = random.Random(7)
    hot = _hot(name, 24)
    pinned: dict[str, object] = {}  # key -> the buffer our pin holds
    for _ in range(1500):
        keys = _random_prompt(rng)
        n = 0
        while n < len(keys):
            buf = hot.get(keys[n])
            if buf is None:
                break
            if rng.random() < 0.05 and keys[n] not in pinned:
                pinned[keys[n]] = buf  # held by us: never evicted
            else:
                buf.release()
            n += 1
        for i in range(n, len(keys)):
            if hot.contains(keys[i]):  # held beyond a gap: not stored again (as the worker does)
                continue
            buf = hot.allocate()
            if buf is None:
                break
            buf.kv.fill_(float(hash(keys[i]) % 1000))
            hot.put(keys[i], buf, keys[i - 1] if i else None)
            buf.release()
        if pinned and rng.random() < 0.1:
            pinned.pop(rng.choice(sorted(pinned))).release()
        for key, buf in pinned.items():
            assert hot.contains(key)
            held = hot.get(key)
            assert held is buf  # the same slot: never evicted nor replaced
            held.release()
        assert len(hot) <= 24 and len(hot.policy) == len(hot)
        if name in PREFIX_AWARE:
            tree = hot.policy.nodes
            assert all(n.parent is None or tree.get(n.parent.key) is n.parent for n in tree.values())
    for buf in pinned.values():
        buf.release()
    hot.clear()
    hot.pool.check_integrity()
    assert hot.pool.num_free == 24 and len(hot.policy) == 0


def test_cache_policy_is_validated_by_key():
    assert load_config(env={}).cache_policy == DEFAULT_POLICY
    assert load_config(env={"LMKV_CACHE_POLICY": "lru"}).cache_policy == "lru"
    with pytest.raises(ConfigError, match="cache_policy.*lru.*prefix_lfu.*'arc'"):
        load_config(env={}, cache_policy="arc")


@pytest.mark.parametrize("name", ["lru", "prefix_lru", "prefix_horizon", "prefix_adaptive"])
def test_a_recency_policy_evicts_the_least_recently_used_when_all_were_used(name):
    """Every entry read since the last insert: the victim is still the one read longest ago
    (a horizon of 0 must be LRU, not give up the newest)."""
    pol = make_policy(name)
    for key in "abcd":
        pol.inserted(key, None)
    for key in "abcd":
        pol.accessed(key)
    assert pol.victim(lambda k: True) == "a"


@pytest.mark.parametrize("name", list(POLICIES))
def test_bookkeeping_stays_bounded_in_a_cache_that_never_fills(name):
    pol = make_policy(name)
    for key in "abcd":
        pol.inserted(key, None)
    for i in range(50000):
        pol.accessed("abcd"[i % 4])
    heaps = [getattr(pol, a, []) for a in ("_heap", "_oldest", "_newest")]
    real = getattr(pol, "real", None)
    if real is not None:
        heaps += [real._oldest, real._newest]
    assert all(len(h) <= 8 * 4 + 64 for h in heaps)


@pytest.mark.parametrize("name", list(POLICIES))
def test_dropping_lossy_chunks_drops_what_continues_them(name):
    """The quality gate drops the chunks decoded from a lossy codec; with a prefix policy,
    the chunks held after them go too (computed over their KV, and unreachable without
    them: a parent stored again later must never be evicted before an old continuation)."""
    hot = _hot(name, 8)

    def put(key, parent, lossy=False):
        buf = hot.allocate()
        buf.lossy = lossy
        assert hot.put(key, buf, parent)
        buf.release()

    put("a0", None)
    put("a1", "a0", lossy=True)
    put("a2", "a1")
    put("a3", "a2")
    put("b0", None)
    put("b1", "b0")
    dropped = hot.drop_lossy()
    kept = {"a0", "b0", "b1"} | (set() if name in PREFIX_AWARE else {"a2", "a3"})
    assert set(hot.entries) == kept and dropped == 6 - len(kept)
    assert len(hot.policy) == len(kept)
    if name in PREFIX_AWARE:
        assert hot.policy.nodes["a0"].children == 0  # a leaf again
    hot.clear()
    hot.pool.check_integrity()


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_victim_kept_after_a_failed_delete_is_not_counted_as_used(name):
    """The disk tier gives back a victim whose delete failed (kept): it stays, the next
    victim is another, and it is not taken as a chunk that came back (no use counted, no
    horizon moved)."""
    pol = make_policy(name)
    for i in range(40):
        pol.inserted(f"k{i}", None)
    for _ in range(200):  # every delete fails
        victim = pol.victim(lambda _: True)
        assert victim is not None
        pol.kept(victim)
    assert len(pol) == 40
    nodes = getattr(pol, "nodes", {})
    assert all(n.count == 1 for n in nodes.values())
    horizon = getattr(getattr(pol, "real", pol), "horizon", 0.0)
    assert horizon == 0.0
    first = pol.victim(lambda _: True)
    pol.kept(first)
    assert pol.victim(lambda _: True) != first
