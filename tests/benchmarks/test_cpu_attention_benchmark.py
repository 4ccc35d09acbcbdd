"""benchmarks/cpu_attention.py runs at a small size and prints its lines (it checks its results)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_cpu_attention_benchmark_prints_a_ratio_per_case_and_dtype():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attention.py"), "--layers", "2",
                        "--context", "256", "--batch", "3", "--repeats", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if "torch/native = " in x]
    for dtype in ("float32", "bfloat16"):
        for case in ("1 new query over 256 keys", "8 new queries over 256 keys",
                     "decode batch of 3 x 64 keys"):
            assert sum(x.startswith(f"{dtype}, {case}:") for x in lines) == 1, r.stdout
