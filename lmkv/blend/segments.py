"""Prompts built as [prefix] SEP [chunk] SEP [chunk] ... SEP [query], split at separators."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Segment(NamedTuple):
    start: int  # token range [start, end) of the prompt
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def split_segments(tokens: list[int], separator: list[int]) -> list[Segment]:
    """The token ranges between occurrences of ``separator`` (separators excluded), in
    order. Without a separator the whole prompt is one segment."""
    if not separator:
        return [Segment(0, len(tokens))]
    out = []
    start = i = 0
    n, m = len(tokens), len(separator)
    first = separator[0]
    while i <= n - m:
        if tokens[i] == first and tokens[i : i + m] == separator:
            out.append(Segment(start, i))
            i += m
            start = i
        else:
            i += 1
    out.append(Segment(start, n))
    return out


def join_segments(parts: list[list[int]], separator: list[int]) -> list[int]:
    """The inverse: token lists joined with the separator between them."""
    out: list[int] = []
    for i, part in enumerate(parts):
        if i:
            out.extend(separator)
        out.extend(part)
    return out


def separator_tokens(encode: Callable[[str], list[int]], separator: str) -> list[int]:
    """The separator's token ids as running text has them: what it becomes between two
    words, where the tokenizer splits cleanly on both sides of it (then a prompt's parts,
    tokenized one by one and joined with these ids, are tokenized exactly as the whole text
    would be); its ids alone otherwise. A byte-level BPE, for one, makes "\\n\\n" alone one
    token that running text, where it is followed by a word, never has: two "\\n" tokens.
    ``encode`` tokenizes without special tokens."""
    alone = encode(separator)
    left, right = encode("x"), encode("y")
    between = encode(f"x{separator}y")
    if (len(between) > len(left) + len(right) and between[: len(left)] == left
            and between[len(between) - len(right) :] == right):
        return between[len(left) : len(between) - len(right)]
    return alone
