"""The engine's GPU code path without a GPU: ``device="emulate"`` runs every kernel lmkv
ships (paged attention for decode and prefill, cache writes, KV transfers between paged
memory and chunks, RoPE re-rotation) under the CPU emulator, through the same launch code
as on a GPU. A whole workload (prefills, decodes, lmkv saves and loads, a CacheBlend
request) gives exactly the tokens of the torch path, and its KV agrees within rounding."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from lmkv.blend.segments import join_segments
from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _llm(model_dir, device: str, layerwise: bool = False) -> LLM:
    cfg = load_config(env={}, chunk_size=32, max_local_cpu_size=0.02, enable_blending=True,
                      blend_recompute_ratio=0.15, use_layerwise=layerwise)
    return LLM(str(model_dir), lmkv_config=cfg, kv_cache_memory=8 << 20,
               enable_prefix_caching=False, device=device, dtype="float32")


def count_launches(monkeypatch, launcher_cls) -> Counter[str]:
    """Launches of ``launcher_cls``'s kernels from now on, by source file and by name."""
    launched: Counter[str] = Counter()
    real = launcher_cls.kernel

    def counting(self, file, name):
        kernel = real(self, file, name)

        def launch(*args, **kwargs):
            launched[file] += 1
            launched[name] += 1
            return kernel(*args, **kwargs)

        return launch

    monkeypatch.setattr(launcher_cls, "kernel", counting)
    return launched


def _workload(llm: LLM) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (75, 40)]
    docs = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (40, 33)]
    query = torch.randint(5, 4000, (6,), generator=g).tolist()
    out = [o.output_token_ids for o in llm.generate(prompts, GREEDY)]  # computed, then saved
    out += [o.output_token_ids for o in llm.generate(prompts, GREEDY)]  # loaded from lmkv
    llm.precompute(docs, progress=False)
    blended = join_segments([docs[1], docs[0], query], llm.engine.blend_separator)
    out += [o.output_token_ids for o in llm.generate([blended], GREEDY)]
    return out


def test_the_whole_engine_step_through_the_emulated_kernels(tiny_model_dir, monkeypatch):
    from lmkv_cuda.emu import EmuLauncher

    launched = count_launches(monkeypatch, EmuLauncher)
    from lmkv_cuda import attention

    for fn in ("paged_attention_decode", "paged_attention_prefill"):
        wrapped = getattr(attention, fn)
        monkeypatch.setattr(attention, fn, lambda *a, _w=wrapped, _n=fn, **k: launched.update([_n])
                            or _w(*a, **k))
    with _llm(tiny_model_dir, "cpu") as cpu:
        want = _workload(cpu)
        want_kv = cpu.engine.kv_cache.clone()
        cpu_loaded = cpu.engine.kv_connector.cache.metrics.loaded_tokens._value.get()
    assert not launched  # the torch path launches nothing
    with _llm(tiny_model_dir, "emulate") as emu:
        got = _workload(emu)
        lmkv = emu.engine.kv_connector.cache
        assert lmkv.metrics.loaded_tokens._value.get() == cpu_loaded > 0
        assert lmkv.metrics.blend_recomputed_tokens._value.get() > 0
        torch.testing.assert_close(emu.engine.kv_cache, want_kv, atol=1e-4, rtol=1e-4)
    assert got == want
    # every kernel family ran: attention (decode, prefill), cache writes and transfers, RoPE
    assert launched["paged_attention.cu"] > 0 and launched["kv_copy.cu"] > 0
    assert launched["rope.cu"] > 0, launched
    copies = {n for n in launched if n.startswith("kv_copy<")}
    assert {n.endswith("true>") for n in copies} == {True, False}, copies  # both directions
    assert launched["paged_attention_decode"] > 0 and launched["paged_attention_prefill"] > 0


def _graph_runs(model_dir, prompts, params, monkeypatch, **engine_args):
    """Tokens of ``prompts`` eager and through the decode graphs (the emulator's stand-ins,
    which re-run the forward pass over the graphs' static buffers), and the (batch size,
    width) of every replay."""
    from lmkv_engines.minimal import cuda_graphs

    replays: Counter[tuple[int, int]] = Counter()
    real = cuda_graphs._Rerun.replay

    def counting(self):
        meta = self.run.__defaults__[1]
        replays[meta.slot_mapping.shape[0], meta.block_tables.shape[1]] += 1
        real(self)

    monkeypatch.setattr(cuda_graphs._Rerun, "replay", counting)
    outs = {}
    for eager in (True, False):
        with LLM(str(model_dir), device="emulate", dtype="float32", enforce_eager=eager,
                 **engine_args) as llm:
            assert (llm.engine.runner.graphs is None) == eager
            outs[eager] = [o.output_token_ids for o in llm.generate(prompts, params)]
            preempted = llm.engine.scheduler.num_preemptions
    assert outs[False] == outs[True]
    return replays, preempted


def test_decode_graphs_give_the_eager_tokens(tiny_model_dir, monkeypatch):
    """Requests finishing mid-batch (padded sizes), sequences growing from one block-table
    width bucket into the next, a context limit that is not whole blocks, preemption, and
    one-token prefill chunks beside decodes."""
    from lmkv_engines.minimal import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WIDTH_TOKENS", 32)  # buckets of 32, 128 and 300 tokens
    g = torch.Generator().manual_seed(1)

    def prompts(*lens):
        return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lens]

    def greedy(n):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    replays, _ = _graph_runs(tiny_model_dir, prompts(9, 30, 17, 5, 40),
                             [greedy(n) for n in (3, 9, 5, 12, 7)], monkeypatch,
                             kv_cache_memory=8 << 20, max_num_seqs=8, max_model_len=300)
    assert {b for b, _ in replays} >= {8, 4, 2, 1}  # 5 sequences padded to 8, then fewer
    assert {w for _, w in replays} == {32 // 16, 128 // 16}  # 40 + 7 tokens: the 2nd bucket
    replays, preempted = _graph_runs(tiny_model_dir, prompts(10, 14, 12, 9), [greedy(14)] * 4,
                                     monkeypatch, num_kv_blocks=14, block_size=4, max_num_seqs=4,
                                     max_model_len=37)
    assert preempted > 0 and replays
    replays, _ = _graph_runs(tiny_model_dir, prompts(7, 5, 6), [greedy(6)] * 3, monkeypatch,
                             kv_cache_memory=8 << 20, max_num_batched_tokens=3, max_num_seqs=4)
    assert replays


def test_a_cuda_device_by_index_becomes_the_current_device_and_a_missing_one_is_named(monkeypatch):
    """--device cuda:1: lmkv's pinned pool, streams and kernels use the current device, which
    stayed cuda:0 (a context there too); an index past the devices is refused by name."""
    from lmkv_engines.minimal.device import resolve_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert resolve_device("cuda:1").torch == torch.device("cuda:1")
    assert made_current == [torch.device("cuda:1")]
    with pytest.raises(ValueError, match="2 CUDA device"):
        resolve_device("cuda:2")
    resolve_device("cuda")  # (no index: the current device, whatever it is)
    assert len(made_current) == 1
