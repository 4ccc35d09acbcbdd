"""Shared stores across lmkv versions and model ids (from a review of key derivation): what
another lmkv version stores under a key this one reads is never taken for corruption and
deleted, and files no engine loads do not change the model id (either would make shared
stores miss for ever)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from lmkv.codec import ForeignFrame, decode_into, encode
from lmkv.layout import KVLayout
from lmkv.memory import MemoryPool
from lmkv.model_id import model_fingerprint

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, chunk_size=4)
KEY = "lmkv1@000000000000@00000000@0@-@" + "ab" * 16


def _frame(byte_at: int, value: int) -> bytes:
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    buf = pool.allocate()
    buf.kv.copy_(torch.randn(LAYOUT.chunk_shape))
    data = bytearray(encode(buf, KEY, "zstd"))
    data[byte_at] = value  # the header only: the payload and its checksum stay sound
    buf.release()
    return bytes(data)


@pytest.mark.parametrize("what, byte_at, value", [("a newer frame version", 4, 2),
                                                  ("a codec this version lacks", 5, 9)])
def test_a_sound_frame_of_another_lmkv_version_is_foreign_not_corrupt(what, byte_at, value):
    """The key (lmkv1@...) does not change with the frame format: during a rolling upgrade,
    old and new engines read each other's frames from one Redis / lmkv_server / Mooncake.
    A FrameError other than ForeignFrame makes Tier._settle remove the chunk from the shared
    store, so each version deletes what the other stores."""
    data = _frame(byte_at, value)
    pool = MemoryPool(LAYOUT, 2 * (64 + LAYOUT.chunk_bytes))
    dst = pool.allocate()
    with pytest.raises(ForeignFrame):
        decode_into(data, dst, KEY)


def _checkpoint(path, extra: dict[str, bytes]):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    for name, data in extra.items():
        (path / name).write_bytes(data)
    return path


def test_a_gguf_beside_the_safetensors_is_not_part_of_the_model_id(tmp_path, monkeypatch):
    """Both engines load a directory's *.safetensors only (vLLM 0.32 has no GGUF loader; the
    bundled engine takes a .gguf only as --model FILE), but model_fingerprint hashes every
    *.gguf beside them: a hub repo that ships GGUF quantizations with its safetensors gets
    one id where vLLM downloaded only the safetensors and another where the whole repo was
    staged (hf download), so those hosts never share a chunk."""
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    vllm_download = _checkpoint(tmp_path / "a", {})
    full_repo = _checkpoint(tmp_path / "b", {"model-Q4_K_M.gguf": b"GGUF" + bytes(100)})
    assert model_fingerprint(vllm_download) == model_fingerprint(full_repo)

