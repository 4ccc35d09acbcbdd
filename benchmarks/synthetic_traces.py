"""Request traces generated from a seed, in the Mooncake trace's jsonl shape
(``input_length``, ``hash_ids`` of 512-token prefix blocks: equal ids = equal prefixes).

- agent: tool-use sessions. A few long system prompts (4-24 blocks, Zipf popularity);
  each session runs 2-12 turns, each turn appending a tool result (1-4 blocks) to the
  whole context so far; sessions interleave (a pool of ~64 open at once).
- rag: retrieval-augmented questions. One of 8 system prompts, then 3-5 documents drawn
  Zipf(1.1) from 20,000 (2-6 blocks each), then the question (a partial block).

    python benchmarks/synthetic_traces.py {agent,rag} --seed 0 --requests 12000 > FILE
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

BLOCK = 512


class PrefixIds:
    """Prefix hash ids: the id of a block names the whole prefix up to it."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, object], int] = {}

    def chain(self, parent: int, blocks: list[object]) -> list[int]:
        out = []
        for b in blocks:
            parent = self.ids.setdefault((parent, b), len(self.ids))
            out.append(parent)
        return out


def _zipf(n: int, s: float) -> list[float]:
    return [1 / (i + 1) ** s for i in range(n)]


def agent(seed: int, requests: int) -> Iterator[dict]:
    rng = random.Random(seed)
    ids = PrefixIds()
    prompts = [[("sys", p, i) for i in range(rng.randint(4, 24))] for p in range(16)]
    weights = _zipf(len(prompts), 1.0)
    sessions: list[dict] = []
    made = 0
    while made < requests:
        while len(sessions) < 64:
            p = rng.choices(range(len(prompts)), weights)[0]
            sessions.append({"blocks": list(prompts[p]), "turns": rng.randint(2, 12), "id": made})
        s = rng.choice(sessions)
        s["blocks"] += [("tool", s["id"], len(s["blocks"]), i) for i in range(rng.randint(1, 4))]
        s["turns"] -= 1
        if s["turns"] == 0:
            sessions.remove(s)
        hash_ids = ids.chain(-1, s["blocks"])
        yield {"timestamp": made, "input_length": len(hash_ids) * BLOCK + rng.randint(1, BLOCK - 1),
               "output_length": rng.randint(20, 400), "hash_ids": hash_ids}
        made += 1


def rag(seed: int, requests: int) -> Iterator[dict]:
    rng = random.Random(seed)
    ids = PrefixIds()
    systems = [[("sys", p, i) for i in range(rng.randint(1, 3))] for p in range(8)]
    docs = [[("doc", d, i) for i in range(rng.randint(2, 6))] for d in range(20000)]
    weights = _zipf(len(docs), 1.1)
    for made in range(requests):
        blocks = list(rng.choice(systems))
        for d in rng.choices(range(len(docs)), weights, k=rng.randint(3, 5)):
            blocks += docs[d]
        hash_ids = ids.chain(-1, blocks)
        yield {"timestamp": made, "input_length": len(hash_ids) * BLOCK + rng.randint(1, BLOCK - 1),
               "output_length": rng.randint(20, 400), "hash_ids": hash_ids}


SHAPES = {"agent": agent, "rag": rag}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=12000)
    a = ap.parse_args()
    for req in SHAPES[a.shape](a.seed, a.requests):
        sys.stdout.write(json.dumps(req) + "\n")


if __name__ == "__main__":
    main()
