"""What in the Mooncake conversation trace predicts a chunk's reuse: how requests continue
conversations, when the next turn comes, and how the chance of a conversation's return
moves with the time since its last turn (the hazard), for first turns and later ones.

    python benchmarks/trace_stats.py [--trace FILE] [--requests N]

A request continues a conversation when it shares more than the first block (which every
request of this trace shares) with an earlier one; its turn is one more than that request's.
The hazard of age band [a, b) is the share of the turns still waiting at age a (in
requests) whose next turn comes before b, per 1000 requests; turns in the last 3000
requests are left out (their return would fall past the trace).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or with -m
from benchmarks.trace_replay import BLOCK, DEFAULT_TRACE  # noqa: E402

BANDS = (0, 50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600, 2400, 3000)
TAIL = 3000  # requests at the end whose next turn is not looked for


def conversations(reqs: list[dict]) -> tuple[list[int | None], list[int], list[bool]]:
    """Per request: the request it continues (None: it starts a conversation), its turn,
    and whether it extends the whole of that request's prompt."""
    last_use: dict[int, int] = {}  # block id -> the last request holding it
    blocks_of: list[int] = []
    prev, turn, whole = [], [], []
    for i, r in enumerate(reqs):
        ids = r["hash_ids"][: r["input_length"] // BLOCK]
        n = 0
        while n < len(ids) and ids[n] in last_use:
            n += 1
        before = last_use[ids[n - 1]] if n >= 2 else None
        prev.append(before)
        turn.append(turn[before] + 1 if before is not None else 1)
        whole.append(before is not None and n >= blocks_of[before])
        for b in ids:
            last_use[b] = i
        blocks_of.append(len(ids))
    return prev, turn, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=12000)
    a = ap.parse_args()
    with a.trace.open() as f:
        reqs = [json.loads(line) for line, _ in zip(f, range(a.requests), strict=False)]
    prev, turn, whole = conversations(reqs)
    cont = [i for i, p in enumerate(prev) if p is not None]
    print(f"conversation trace, first {len(reqs)} requests: {len(reqs) - len(cont)} start a conversation, "
          f"{len(cont)} continue one ({sum(whole[i] for i in cont) / len(cont):.0%} extending the whole "
          f"earlier prompt)")
    uses: dict[int, int] = {}
    for r in reqs:
        for b in r["hash_ids"][: r["input_length"] // BLOCK]:
            uses[b] = uses.get(b, 0) + 1
    once = sum(n == 1 for n in uses.values())
    print(f"distinct full blocks {len(uses)}, used by one request only {once}: once/distinct = "
          f"{once / len(uses):.2f}")
    nxt: dict[int, int] = {}
    for i in cont:
        nxt.setdefault(prev[i], i)  # the first request continuing each one
    gaps = sorted(nxt[p] - p for p in nxt)
    q = lambda f: gaps[int(f * (len(gaps) - 1))]  # noqa: E731
    print(f"next turn after 10th / 50th / 90th percentile: {q(0.1)} / {q(0.5)} / {q(0.9)} requests")
    for label, first in (("first turns", True), ("later turns", False)):
        waiting = [i for i in range(len(reqs) - TAIL) if (turn[i] == 1) == first]
        ages = [nxt[i] - i if i in nxt else None for i in waiting]
        back = sum(g is not None and g < TAIL for g in ages) / len(ages)
        alive, cells = len(ages), []
        for lo, hi in zip(BANDS, BANDS[1:], strict=False):
            came = sum(g is not None and lo <= g < hi for g in ages)
            cells.append(f"[{lo},{hi}) {1e3 * came / alive / (hi - lo):.2f}")
            alive -= came
        print(f"{label}: {len(ages)}, back within {TAIL} requests {back:.2f}; hazard per 1000 requests "
              + " ".join(cells))


if __name__ == "__main__":
    main()
