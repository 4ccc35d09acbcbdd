"""Chunk keys name the model by every byte of its weights: a fine-tune that changes only a
few tensors (a merged LoRA, a frozen-layer fine-tune) never shares entries with its base,
copies of a checkpoint do, and each file is hashed once per version."""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from lmkv import model_id
from lmkv.model_id import model_fingerprint
from lmkv_engines.minimal.llm import LLM
from tests.engine.lmkv_workload import GREEDY, lmkv_llm, prompts


def finetune(src, dst, names=("model.layers.0.self_attn.v_proj.weight",
                              "model.layers.0.self_attn.q_proj.weight")):
    """A copy of ``src`` with the ``names`` tensors changed: same config, same file size."""
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in names:
        w[name] = w[name] + 0.5 * torch.randn(w[name].shape, generator=g)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_finetune_of_a_few_tensors_is_never_served_its_base_models_kv(tiny_model_dir, tmp_path):
    tuned = finetune(tiny_model_dir, tmp_path / "tuned")
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(tuned) == size(tiny_model_dir)
    p = prompts(n=2, length=200, seed=3)
    plain = LLM(str(tuned), enable_prefix_caching=False, kv_cache_memory=64 << 20)
    want = [o.output_token_ids for o in plain.generate(p, GREEDY)]
    with lmkv_llm(tiny_model_dir, tmp_path / "disk") as base:  # the base model fills the disk tier
        base.generate(p, GREEDY)
    with lmkv_llm(tuned, tmp_path / "disk") as llm:  # the fine-tune, on the same disk tier
        outs = llm.generate(p, GREEDY)
    assert model_fingerprint(tiny_model_dir) != model_fingerprint(tuned)
    assert [o.num_external_tokens for o in outs] == [0, 0]
    assert [o.output_token_ids for o in outs] == want


def test_copies_share_an_id_and_each_file_is_hashed_once_per_version(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert model_fingerprint(copy) == model_fingerprint(tiny_model_dir)
    hashed = []
    real = model_id.xxhash.xxh3_128
    monkeypatch.setattr(model_id.xxhash, "xxh3_128", lambda: hashed.append(1) or real())
    first = model_fingerprint(copy)
    assert hashed == [] and first == model_fingerprint(tiny_model_dir)  # remembered
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 1  # one bit, where no sample of the old fingerprint looked
    weights.write_bytes(data)
    assert model_fingerprint(copy) != first and hashed == [1]  # a new version: hashed again


def test_weights_in_other_formats_are_hashed_too(tmp_path, monkeypatch):
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    ids = []
    for i in range(2):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "pytorch_model.bin").write_bytes(bytes(1000) + bytes([i]) + bytes(1000))
        ids.append(model_fingerprint(d))
    assert ids[0] != ids[1]


def test_a_cache_dir_that_cannot_be_written_costs_a_hash_not_an_error(tiny_model_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache dir's parent is a file: nothing can be created under it
    monkeypatch.setenv("LMKV_CACHE_DIR", str(blocked))
    assert model_fingerprint(tiny_model_dir) == model_fingerprint(tiny_model_dir)
    assert not os.path.isdir(blocked)


def test_ranks_starting_at_once_hash_a_file_once(tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "w.gguf"
    weights.write_bytes(os.urandom(1 << 20))
    hashed = []
    real = model_id.xxhash.xxh3_128

    def slow():
        hashed.append(1)
        time.sleep(0.3)  # (the others arrive meanwhile)
        return real()

    monkeypatch.setattr(model_id.xxhash, "xxh3_128", slow)
    digests = []
    threads = [threading.Thread(target=lambda: digests.append(model_fingerprint(weights)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(digests)) == 1 and len(digests) == 4 and hashed == [1]


def test_only_the_weights_an_engine_loads_are_hashed(tiny_model_dir, tmp_path, monkeypatch):
    """A trainer's files beside the weights (optimizer state, arguments) are no part of the
    model: copies that differ in them share an id (and are not read at start)."""
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "optimizer.pt").write_bytes(os.urandom(1000))
    (copy / "training_args.bin").write_bytes(os.urandom(100))
    assert model_fingerprint(copy) == model_fingerprint(tiny_model_dir)
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text("{}")
    (bins / "pytorch_model.bin").write_bytes(bytes(1000))
    (bins / "training_args.bin").write_bytes(b"a")
    before = model_fingerprint(bins)
    (bins / "training_args.bin").write_bytes(b"b")
    assert model_fingerprint(bins) == before


def test_a_file_rewritten_in_place_with_its_time_restored_is_hashed_again(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "w.gguf"
    weights.write_bytes(bytes(1000))
    first = model_fingerprint(weights)
    st = weights.stat()
    time.sleep(0.01)
    with open(weights, "r+b") as f:  # same size, same inode (rsync --inplace -t, cp -p)
        f.write(b"\x01")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_fingerprint(weights) != first
