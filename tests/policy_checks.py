"""A cache policy driven over prompts of chained keys as a bounded cache drives it, with the
policy invariants checked after every prompt (shared by the policy tests)."""

from __future__ import annotations

import random


def replay_checked(pol, prompts: list[list[str]], capacity: int,
            rng: random.Random | None = None, prefix: bool = True) -> tuple[int, dict]:
    """Chunks served (leading hits) over ``prompts`` by a cache of ``capacity`` chunks, and
    the keys held at the end (key -> parent), checking the invariants after every prompt.
    With ``rng``, held chunks are pinned and unpinned at random (as planned loads do);
    ``prefix``: the policy is prefix-aware (only leaves go, no orphans are kept)."""
    held: dict[str, str | None] = {}
    pinned: set[str] = set()
    served = 0
    for keys in prompts:
        if rng is not None and held and rng.random() < 0.3:
            pinned.add(rng.choice(sorted(held)))
            if rng.random() < 0.5:
                pinned.discard(rng.choice(sorted(pinned)))
        n = 0
        while n < len(keys) and keys[n] in held:
            pol.accessed(keys[n])
            n += 1
        served += n
        for i in range(n, len(keys)):
            key, parent = keys[i], keys[i - 1] if i else None
            if key in held:
                pol.accessed(key)
                continue
            if len(held) >= capacity:
                victim = pol.victim(lambda k: k not in pinned)
                if victim is None:
                    break
                assert victim in held and victim not in pinned
                assert not prefix or all(p != victim for p in held.values())  # only leaves go
                del held[victim]
                pol.removed(victim)
            if pol.admit(key, parent, held.__contains__):
                held[key] = parent
                pol.inserted(key, parent)
        assert len(held) <= capacity and len(pol) == len(held)
        assert not prefix or all(p is None or p in held for p in held.values())  # no orphans
        assert pinned <= held.keys()
    return served, held


def shared_prefix_prompts(rng: random.Random, n: int = 3000) -> list[list[str]]:
    """``n`` prompts: chains over a few shared prefixes, whole prompts recurring."""
    prompts = []
    for _ in range(n):
        root, shared, tag = rng.randrange(4), rng.randrange(6), rng.randrange(60)
        prompts.append([f"r{root}-{i}" for i in range(shared)]
                       + [f"r{root}-{shared}-t{tag}-{i}" for i in range(rng.randrange(1, 8))])
    return prompts
