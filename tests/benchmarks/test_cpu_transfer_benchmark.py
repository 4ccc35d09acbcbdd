"""benchmarks/cpu_transfer.py runs at a small size and prints its lines (it checks its copies)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_cpu_transfer_benchmark_prints_a_ratio_per_dtype_and_direction():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_transfer.py"), "--tokens", "256",
                        "--chunk", "64", "--layers", "2", "--heads", "2", "--head-dim", "16",
                        "--repeats", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for dtype in ("float16", "float32"):
        for what in ("load", "save"):
            assert sum(f"{dtype}" in x and f", {what} (chunk" in x and "native/torch = " in x
                       for x in lines) == 1
        assert sum(dtype in x and "native/memcpy = " in x for x in lines) == 1
        for state in ("as they are", "just zeroed"):
            assert sum(dtype in x and f"load into pages {state}" in x and "with plain stores" in x
                       for x in lines) == 1
