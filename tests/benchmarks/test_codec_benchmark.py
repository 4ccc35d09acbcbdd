"""benchmarks/codec.py runs end to end on a small setting and prints its ratio lines (its
transforms go through the same codec API the product uses, so an API change shows here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lmkv.codec.calibration import CalibrationSettings

ROOT = Path(__file__).resolve().parents[2]


def test_codec_benchmark_runs_and_prints_every_ratio_line():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "codec.py"), "--prompts", "2", "--length", "512",
         "--match-steps", "1", "--repeats", "1", "--qa-prompts", "0"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for line in (f"cachegen at error target {CalibrationSettings().error:g}:",
                 "cachegen decode vs disk read (one core)",
                 "per-token int8 vs cachegen size at equal or better agreement",
                 "KV rounded to bfloat16", "TTFT from disk, raw vs cachegen"):
        assert line in run.stdout, (line, run.stdout[-3000:])
