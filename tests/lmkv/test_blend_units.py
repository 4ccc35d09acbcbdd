"""CacheBlend's building blocks: segments, content keys, RoPE re-rotation, token selection."""

from __future__ import annotations

import pytest
import torch

from lmkv.blend.plan import select_recompute
from lmkv.blend.segments import Segment, join_segments, split_segments
from lmkv.keys import content_hashes, prefix_hashes
from lmkv.ops import rerotate_keys
from lmkv_engines.minimal.model_config import RopeScaling
from lmkv_engines.minimal.rope import RotaryEmbedding


def test_split_and_join_segments():
    sep = [7, 7]
    tokens = join_segments([[1, 2], [3], [], [4, 5, 6]], sep)
    assert tokens == [1, 2, 7, 7, 3, 7, 7, 7, 7, 4, 5, 6]
    segs = split_segments(tokens, sep)
    assert segs == [Segment(0, 2), Segment(4, 5), Segment(7, 7), Segment(9, 12)]
    assert split_segments([1, 2, 3], [9]) == [Segment(0, 3)]
    assert split_segments([7, 1], [7, 1]) == [Segment(0, 0), Segment(2, 2)]


def test_content_keys_ignore_position_and_differ_from_prefix_keys():
    doc = list(range(100, 170))
    assert content_hashes(doc, 32) == content_hashes(list(doc), 32)
    assert len(content_hashes(doc, 32)) == 3  # 32 + 32 + 6
    assert content_hashes(doc, 32)[0] != content_hashes(doc[:64], 32)[0]  # length is part of it
    assert not set(content_hashes(doc[:64], 32)) & set(prefix_hashes(doc[:64], 32))


@pytest.mark.parametrize("scaling", [None, RopeScaling("llama3", 8.0, 1.0, 4.0, 256)])
def test_rerotated_keys_equal_keys_computed_at_the_new_position(scaling):
    rope = RotaryEmbedding(64, 4096, 500000.0 if scaling else 10000.0, scaling)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(50, 2, 64, generator=g)
    p = torch.arange(50)
    for shift in (0, 1, 17, 1000, 3000):
        at_p = rope.rotate(raw, p)
        want = rope.rotate(raw, p + shift)
        got = rerotate_keys(at_p.clone(), torch.full((50,), shift), rope.inv_freq)
        # fp32 angles of ~3000 rad carry ~2e-4 rad of rounding, in the reference as well
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    back = rerotate_keys(rope.rotate(raw, p + 500), torch.full((50,), -500), rope.inv_freq)
    torch.testing.assert_close(back, rope.rotate(raw, p), atol=2e-4, rtol=1e-4)


def test_select_recompute_takes_uncached_and_the_most_deviating():
    cached = torch.tensor([False, True, True, True, True, False, True, True, True, True])
    deviation = torch.tensor([100.0, 1, 9, 2, 8, 100, 3, 7, 4, 5])
    assert select_recompute(deviation, cached, 0.0).tolist() == (~cached).tolist()
    chosen = select_recompute(deviation, cached, 0.25)  # 2 of 8 cached tokens
    assert chosen.nonzero().flatten().tolist() == [0, 2, 4, 5]
    assert bool(select_recompute(deviation, cached, 1.0).all())
