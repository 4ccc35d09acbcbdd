"""Each benchmark runs at a small size and prints its lines (run_benchmark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float = 300) -> str:
    """benchmarks/``script`` run with ``args`` from the repository root; its stdout, once it
    exited 0."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout
