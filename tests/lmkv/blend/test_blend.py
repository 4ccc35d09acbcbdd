"""CacheBlend's building blocks: segments, content keys, RoPE re-rotation, token selection."""

from __future__ import annotations

import pytest
import torch

from lmkv.blend.plan import select_recompute
from lmkv.blend.segments import Segment, join_segments, split_segments
from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.keys import content_hashes, prefix_hashes
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES, NO_POSITION
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
    assert not set(content_hashes(doc, 32)) & set(content_hashes(doc, 32, pre_rope=True))


def test_pre_rope_chunks_are_never_read_as_post_rope_and_arrive_from_disk(tmp_path):
    """blend_store_pre_rope is part of a chunk's key: a chunk stored one way is invisible to
    an engine reading the other way (here: another process's chunks on the disk tier)."""
    layout = KVLayout(2, 1, 8, torch.float32, 16)

    def engine(pre_rope: bool) -> LMKVCache:
        cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.01, local_disk=str(tmp_path),
                          max_local_disk_size=0.01, blend_store_pre_rope=pre_rope)
        return LMKVCache(cfg, layout, "model")

    doc, sep = list(range(100, 140)), [7]
    kv = torch.randn(2, 2, len(doc), 1, 8)
    writer = engine(True)
    assert writer.store_chunk(doc, kv)
    for key in writer.content_keys(doc):  # keys before RoPE: no position to code them by
        buf = writer.storage.hot.get(key)
        assert buf.position == NO_POSITION
        buf.release()
    writer.close()  # written to disk
    post, pre = engine(False), engine(True)
    prompt = [1, 2] + sep + doc + sep + [3, 4]
    assert not post.has_chunk(doc) and post.blend_plan(prompt, sep) is None
    plan = pre.blend_plan(prompt, sep)
    assert plan is not None and plan.pre_rope and plan.num_cached_tokens == len(doc)
    assert [(s.start, s.length) for s in plan.segments] == [(3, len(doc))]
    stored = plan.stored_kv(len(prompt), torch.float32)
    torch.testing.assert_close(stored[:, :, 3 : 3 + len(doc)], kv, atol=0, rtol=0)
    plan.release()
    pre.pool.check_integrity()
    post.close()
    pre.close()


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
    # pre-RoPE storage: keys captured at [0, 50), rotated back, then rotated to p + shift
    stored = rope.rotate(rope.rotate(raw, p), p, inverse=True)
    torch.testing.assert_close(stored, raw, atol=1e-5, rtol=1e-5)
    for shift in (1, 17, 3000):
        torch.testing.assert_close(rope.rotate(stored, p + shift), rope.rotate(raw, p + shift),
                                   atol=1e-5, rtol=1e-5)


def test_select_recompute_takes_uncached_and_the_most_deviating():
    cached = torch.tensor([False, True, True, True, True, False, True, True, True, True])
    deviation = torch.tensor([100.0, 1, 9, 2, 8, 100, 3, 7, 4, 5])
    assert select_recompute(deviation, cached, 0.0).tolist() == (~cached).tolist()
    chosen = select_recompute(deviation, cached, 0.25)  # 2 of 8 cached tokens
    assert chosen.nonzero().flatten().tolist() == [0, 2, 4, 5]
    assert bool(select_recompute(deviation, cached, 1.0).all())


def test_a_blend_check_layer_past_the_model_is_refused():
    layout = KVLayout(2, 1, 8, torch.float32, 16)
    cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.001, enable_blending=True,
                      blend_check_layer=2)
    with pytest.raises(ValueError, match=r"blend_check_layer is 2, but the model has 2 layers \(0\.\.1\)"):
        LMKVCache(cfg, layout, "model")
    LMKVCache(cfg.__class__(**{**cfg.__dict__, "blend_check_layer": 1}), layout, "model").close()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_rag_chunk_tail_is_stored_at_its_own_size(tmp_path, codec):
    """A 90-token RAG chunk with chunk_size 256 takes a 90-token file, and comes back from
    disk in a new process exactly, the rest of its slot zeroed."""
    layout = KVLayout(2, 2, 16, torch.float32, 256)
    cfg = load_config(env={}, chunk_size=256, max_local_cpu_size=0.01, local_disk=str(tmp_path),
                      max_local_disk_size=0.1, local_disk_codec=codec, enable_prefetch=False)
    tokens = list(range(1000, 1300))  # one full chunk and a 44-token tail
    kv = torch.randn(2, 2, len(tokens), 2, 16)
    with_tail = LMKVCache(cfg, layout, "model")
    assert with_tail.store_chunk(tokens, kv)
    bufs = [with_tail.storage.hot.get(k) for k in with_tail.content_keys(tokens)]
    assert [b.position for b in bufs] == [0, 256]  # their offsets in the document
    for b in bufs:
        b.release()
    with_tail.storage.io.drain()
    with_tail.close()
    sizes = sorted(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    full = layout.chunk_bytes
    if codec == "raw":
        assert sizes == [64 + full * 44 // 256, 64 + full]
    else:
        assert sizes[0] < 64 + full * 44 // 256 + 1024 and sizes[1] > 64 + full // 2
    again = LMKVCache(cfg, layout, "model")
    bufs = again.fetch(again.content_keys(tokens))
    assert [b.num_tokens for b in bufs] == [256, 44]
    assert torch.equal(bufs[0].kv, kv[:, :, :256])
    assert torch.equal(bufs[1].kv[:, :, :44], kv[:, :, 256:])
    assert not bufs[1].kv[:, :, 44:].any()
    assert again.has_chunk(tokens)
    for b in bufs:
        b.release()
    again.pool.check_integrity()
    again.close()


def test_the_pieces_of_a_long_rag_chunk_are_kept_in_order():
    """A RAG chunk longer than chunk_size is stored as pieces, each under the one before
    it: a prefix policy gives up the last piece first (a later piece without the earlier
    ones serves nothing: blending needs the whole chunk)."""
    cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.01, enable_blending=True)
    cache = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, 16), "m")
    tokens = list(range(100, 100 + 40))
    cache.store_chunk(tokens, torch.randn(2, 2, len(tokens), 1, 4))
    keys = cache.content_keys(tokens)
    nodes = cache.storage.hot.policy.nodes
    assert [None if nodes[k].parent is None else nodes[k].parent.key for k in keys] == [
        None, keys[0], keys[1]]
    cache.close()


def test_store_chunk_refuses_kv_of_another_shape_and_says_when_a_piece_went_nowhere():
    """KV of a shape that does not fit the tokens and the model is a ValueError before any
    slot is taken (a short one raised half-way, holding a slot for good; one layer for two
    was broadcast and stored). A piece the hot cache's policy refuses with no tier below
    makes store_chunk False (it said True for chunks no lookup could find)."""
    cfg = load_config(env={}, chunk_size=16, max_local_cpu_size=0.01, enable_blending=True)
    cache = LMKVCache(cfg, KVLayout(2, 1, 4, torch.float32, 16), "m")
    tokens = list(range(100, 140))
    free = cache.pool.num_free
    for bad in ((2, 2, 30, 1, 4), (2, 1, 40, 1, 4), (2, 2, 40, 4, 1), (2, 2, 41, 1, 4)):
        with pytest.raises(ValueError, match=r"needs KV of shape \[2, 2, 40, 1, 4\]"):
            cache.store_chunk(tokens, torch.randn(bad))
    assert cache.pool.num_free == free and len(cache.storage.hot) == 0
    cache.pool.check_integrity()
    cache.close()

    small = load_config(env={}, chunk_size=16, enable_blending=True,
                        max_local_cpu_size=6 * (HEADER_BYTES + 2 * 2 * 16 * 4 * 4) / 1e9 + 1e-12)
    cache = LMKVCache(small, KVLayout(2, 1, 4, torch.float32, 16), "m")
    assert cache.pool.num_slots == 6
    long = list(range(200, 200 + 10 * 16))  # 10 pieces, 6 slots, nothing below
    assert cache.store_chunk(long, torch.randn(2, 2, len(long), 1, 4)) is False
    assert not cache.has_chunk(long)
    cache.pool.check_integrity()
    cache.close()
