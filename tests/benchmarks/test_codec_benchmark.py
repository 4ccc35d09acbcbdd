"""benchmarks/codec.py runs end to end on a small setting and prints its ratio lines (its
transforms go through the same codec API the product uses, so an API change shows here)."""

from __future__ import annotations

from lmkv.codec.calibration import CalibrationSettings

from . import run_benchmark


def test_codec_benchmark_runs_and_prints_every_ratio_line():
    out = run_benchmark("codec.py", "--prompts", "2", "--length", "512", "--match-steps", "1",
                        "--repeats", "1", "--qa-prompts", "0", timeout=900)
    for line in (f"cachegen at error target {CalibrationSettings().error:g}:",
                 "cachegen decode vs disk read (one core)",
                 "per-token int8 vs cachegen size at equal or better agreement",
                 "KV rounded to bfloat16", "TTFT from disk, raw vs cachegen"):
        assert line in out, (line, out[-3000:])
