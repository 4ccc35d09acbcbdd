"""Sizes as people write them on command lines: "4GiB", "512MB", "1.5G", "64k", "1048576".
KB/MB/GB/TB are decimal; KiB/MiB/GiB/TiB and the bare letters K/M/G/T are binary."""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes; ValueError naming what is not a size."""
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 4GB, 1048576)")
    return int(float(match.group(1)) * unit)


def size(text: str) -> int:
    """parse_size for argparse's ``type=``: its error says "invalid size value" and why."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
