"""The pieces of streaming and of the command line that need no server."""

from __future__ import annotations

import argparse

import pytest

from lmkv_engines.minimal.cli import parse_size
from lmkv_engines.minimal.event_stream import hold_back


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        ("hello wor", ("world",), "hello "),  # "wor" may become "world"
        ("hello w", ("world", "wx"), "hello "),
        ("hello", ("world",), "hello"),
        ("hello", (), "hello"),
        ("abab", ("abc",), "ab"),  # the longest tail that is a prefix: "ab"
        ("end.", (".",), "end."),  # a complete stop is the engine's to cut, not held
        ("", ("x",), ""),
    ],
)
def test_hold_back_keeps_only_text_that_cannot_start_a_stop(text, stops, want):
    assert hold_back(text, stops) == want


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "lots", "2 parsecs", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
