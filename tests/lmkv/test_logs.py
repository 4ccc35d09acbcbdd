"""LogThrottle: one line per kind a minute, and what it says of the lines it left out."""

from __future__ import annotations

import logging

import lmkv.logs


def test_the_count_of_lines_left_out_names_the_time_they_happened_in(monkeypatch, caplog):
    """From a review: the count of lines left out was said to be "in the last 60 s" however
    long ago they were (5 at t=0..10, then one an hour later)."""
    now = [1000.0]
    monkeypatch.setattr(lmkv.logs.time, "monotonic", lambda: now[0])
    quiet = lmkv.logs.LogThrottle()
    log = logging.getLogger("lmkv.test_logs")
    with caplog.at_level(logging.WARNING, logger="lmkv.test_logs"):
        for t in range(6):  # one line logged, five left out
            now[0] = 1000.0 + 2 * t
            quiet.log(log, logging.WARNING, "corrupt", "a chunk is corrupt")
        now[0] = 1000.0 + 3600
        quiet.log(log, logging.WARNING, "corrupt", "a chunk is corrupt")
    assert [r.getMessage() for r in caplog.records] == [
        "a chunk is corrupt",
        "a chunk is corrupt (and 5 more like it in the 3600 s since the last such line)"]
