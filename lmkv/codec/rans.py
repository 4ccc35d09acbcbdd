"""Interleaved static rANS over bytes, vectorised across lanes with numpy.

One of the two entropy stages of the cachegen codec (the other is zstd; benchmarks/codec.py
measures both). Symbol i goes to lane i % lanes; each step codes one symbol of every lane
with numpy ops over all lanes, so the Python loop runs len / lanes times. Each lane costs
4 bytes of final state, hence lanes ~ len / 256 (0.125 bit/symbol of overhead).

Stream: lo i16, n u16, freq u16[n] (symbols lo .. lo+n-1, summing to 1 << PROB_BITS),
lanes u32, words u32, state u32[lanes], word u16[words]. State x in [2^16, 2^32); 16-bit
renormalisation, so each step moves at most one word per lane.
"""

from __future__ import annotations

import struct

import numpy as np

PROB_BITS = 12
_M = 1 << PROB_BITS
_LOW = 1 << 16
_HEAD = struct.Struct("<hH")
_TAIL = struct.Struct("<II")
SYMBOLS_PER_LANE = 256


class RansError(ValueError):
    """A rANS stream that does not decode to the expected number of symbols."""


def _frequencies(counts: np.ndarray) -> np.ndarray:
    """counts [n] > 0 somewhere -> frequencies [n] summing to 2^PROB_BITS, >= 1 where used."""
    total = int(counts.sum())
    freq = np.where(counts > 0, np.maximum(1, counts * _M // total), 0).astype(np.int64)
    freq[int(np.argmax(freq))] += _M - int(freq.sum())
    if freq[counts > 0].min() < 1:  # only with > 2^PROB_BITS / 2 symbols in use: cannot be
        raise RansError("alphabet too large for the probability resolution")
    return freq


def encode(symbols: np.ndarray) -> bytes:
    """symbols: int8 [n] (n >= 1) -> stream bytes."""
    sym = symbols.astype(np.int64)
    lo, hi = int(sym.min()), int(sym.max())
    counts = np.bincount(sym - lo, minlength=hi - lo + 1)
    freq = _frequencies(counts)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    n = len(sym)
    lanes = max(1, n // SYMBOLS_PER_LANE)
    steps = -(-n // lanes)
    pad = int(np.argmax(freq))
    grid = np.full(steps * lanes, pad, dtype=np.int64)
    grid[:n] = sym - lo
    grid = grid.reshape(steps, lanes)  # [steps, lanes]
    x = np.full(lanes, _LOW, dtype=np.int64)
    emitted = []
    for t in range(steps - 1, -1, -1):
        s = grid[t]
        f = freq[s]
        m = x >= (f << (32 - PROB_BITS))  # (_LOW >> PROB_BITS) << 16 == 1 << (32 - PROB_BITS)
        emitted.append((x[m] & 0xFFFF).astype(np.uint16))
        x = np.where(m, x >> 16, x)
        x = ((x // f) << PROB_BITS) + (x % f) + cum[s]
    words = np.concatenate(emitted[::-1]) if emitted else np.zeros(0, np.uint16)
    return b"".join([
        _HEAD.pack(lo, len(freq)), freq.astype("<u2").tobytes(), _TAIL.pack(lanes, len(words)),
        x.astype("<u4").tobytes(), words.astype("<u2").tobytes(),
    ])


def decode(data: bytes | memoryview, n: int) -> np.ndarray:
    """The ``n`` int8 symbols of a stream made by ``encode``. Raises RansError when the
    stream is malformed."""
    view = memoryview(data)
    try:
        lo, k = _HEAD.unpack_from(view, 0)
        off = _HEAD.size
        freq = np.frombuffer(view, "<u2", k, off).astype(np.int64)
        off += 2 * k
        lanes, nwords = _TAIL.unpack_from(view, off)
        off += _TAIL.size
        x = np.frombuffer(view, "<u4", lanes, off).astype(np.int64)
        off += 4 * lanes
        words = np.frombuffer(view, "<u2", nwords, off).astype(np.int64)
    except (struct.error, ValueError) as e:
        raise RansError(f"truncated rANS stream: {e}") from e
    if lanes != max(1, n // SYMBOLS_PER_LANE):  # what encode writes: fewer is a slow loop
        raise RansError(f"{lanes} lanes for {n} symbols")
    if off + 2 * nwords != len(view) or int(freq.sum()) != _M or lanes < 1 or k < 1:
        raise RansError("malformed rANS stream header")
    if lo < -128 or lo + k > 128:
        raise RansError(f"rANS symbols [{lo}, {lo + k}) outside int8")
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    lut = np.repeat(np.arange(k), freq)  # slot -> symbol index
    steps = -(-n // lanes)
    out = np.empty((steps, lanes), dtype=np.int64)
    pos = 0
    for t in range(steps):
        slot = x & (_M - 1)
        s = lut[slot]
        out[t] = s
        x = freq[s] * (x >> PROB_BITS) + slot - cum[s]
        m = x < _LOW
        c = int(np.count_nonzero(m))
        if pos + c > nwords:
            raise RansError("rANS stream ends early")
        x[m] = (x[m] << 16) | words[pos : pos + c]
        pos += c
    if pos != nwords or not np.all(x == _LOW):
        raise RansError("rANS stream does not end in the initial state")
    return (out.reshape(-1)[:n] + lo).astype(np.int8)
