"""benchmarks/engine_host.py runs at a small size and prints a ratio line per output kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_engine_host_benchmark_prints_a_ratio_per_output_kind():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_host.py"), "--requests", "4",
                        "--short", "64", "--long", "600", "--steps", "8"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if "long/short = " in x]
    assert [x.split(":")[0] for x in lines] == ["output cumulative", "output delta",
                                                "output final_only"], r.stdout
