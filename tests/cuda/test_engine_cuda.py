"""The engine on a real GPU (skipped without one): the workload of test_engine_emulated
(prefills, decodes, lmkv saves and loads, a CacheBlend request) on CUDA gives exactly the
CPU path's tokens, with its KV within float32 rounding, in both load modes, with lmkv's
kernels doing decode attention, cache writes, transfers and RoPE (prefills take torch's
attention on CUDA, lmkv.ops), and decode steps replaying CUDA graphs give the eager tokens."""

from __future__ import annotations

from collections import Counter

import emu_cases
import pytest
import torch
from emu_cases import TOLERANCE, decode

from lmkv_cuda import attention
from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams
from tests.cuda.test_engine_emulated import _llm, _workload, count_launches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kernel", attention.DECODE_KERNELS)
def test_every_decode_kernel_matches_torch_on_cuda(kernel):
    """The emulator tests' decode cases on the GPU: GQA groups, step, block and partition
    boundaries, split partitions and long contexts."""
    from lmkv_cuda.launcher import gpu_launcher

    launcher = gpu_launcher(torch.cuda.current_device())
    assert launcher is not None
    cases = [(64, 4, 4, [1, 16, 17, 45], 512), (128, 8, 1, [33, 2], 512),
             (64, 16, 2, [1, 48, 49, 150], 48), (128, 12, 3, [1, 17, 63, 64, 65, 129], 512),
             (64, 12, 3, [300, 600], 96), (128, 32, 8, [4096, 1000], 512)]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim, hq, hkv, lens, parts in cases:
            error = decode(launcher, dtype, dim, hq, hkv, lens, partition_size=parts,
                           kernel=kernel, device="cuda")  # fmt: skip
            assert error < TOLERANCE[dtype], (dtype, dim, hq, hkv, lens, error)


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
def test_a_decode_gives_the_same_bits_in_any_batch_on_cuda(kernel):
    """test_kernel_attention's batch-invariance check on the GPU, at the default partitions:
    2,560 keys alone, next to 9,600, over a 4x wider table (MAX_PARTITIONS lowered to 2 so
    that both split past it)."""
    from lmkv_cuda.launcher import gpu_launcher

    launcher = gpu_launcher(torch.cuda.current_device())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "MAX_PARTITIONS", 2)
        assert emu_cases.decode_bits_alone_and_batched(launcher, kernel, partition_size=1024,
                                                       device="cuda")


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_engine_on_cuda_gives_the_cpu_paths_tokens(tiny_model_dir, monkeypatch, layerwise):
    from lmkv_cuda.launcher import CupyLauncher

    launched = count_launches(monkeypatch, CupyLauncher)
    with _llm(tiny_model_dir, "cpu", layerwise) as cpu:
        want = _workload(cpu)
        want_kv = cpu.engine.kv_cache.clone()
        cpu_loaded = cpu.engine.kv_connector.cache.metrics.loaded_tokens._value.get()
    with _llm(tiny_model_dir, "cuda", layerwise) as gpu:
        assert gpu.engine.kv_cache.is_cuda
        got = _workload(gpu)
        lmkv = gpu.engine.kv_connector.cache
        assert lmkv.metrics.loaded_tokens._value.get() == cpu_loaded > 0
        assert lmkv.metrics.blend_recomputed_tokens._value.get() > 0
        torch.testing.assert_close(gpu.engine.kv_cache.cpu(), want_kv, atol=1e-4, rtol=1e-4)
    assert got == want
    assert launched["paged_attention.cu"] > 0 and launched["kv_copy.cu"] > 0, launched
    assert launched["rope.cu"] > 0, launched


def test_decode_steps_replay_cuda_graphs_with_the_eager_tokens(tiny_model_dir, monkeypatch):
    from lmkv_engines.minimal.cuda_graphs import DecodeGraphs

    replays: Counter[int] = Counter()
    real = DecodeGraphs.run

    def counting(self, ids, *args):
        replays[len(ids)] += 1
        return real(self, ids, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counting)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (9, 30, 17, 64)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        with LLM(str(tiny_model_dir), kv_cache_memory=8 << 20, device="cuda", enforce_eager=eager,
                 max_num_seqs=8, dtype="float32") as llm:
            assert (llm.engine.runner.graphs is None) == eager
            outs[eager] = [[o.output_token_ids for o in llm.generate(prompts[:n], greedy)]
                           for n in (4, 3, 1)]  # a captured size, one padded, one alone
        assert bool(replays) != eager
    assert outs[False] == outs[True]
    assert set(replays) == {4, 3, 1}  # every decode step of each batch replayed a graph
