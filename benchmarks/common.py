"""Shared pieces of the benchmarks: the model they run (SmolLM2-135M-Instruct by default, or a
realistic-shape random Llama), transformers on the same weights, and timing helpers."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# ~75M parameters: 8 layers, hidden 768, GQA 12:4, head_dim 64, vocab 32000 (tied)
REALISTIC = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
    num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
    tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
)
# SmolLM2-135M-Instruct's shape (30 layers, hidden 576, GQA 9:3, head_dim 64, vocab 49152) with
# random weights: its timings where the GGUF file cannot travel (a GPU machine takes 64 MiB)
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1,
    eos_token_id=2,
)
MODEL_HELP = ("a directory, a .gguf file, 'realistic' (a random ~75M Llama) or 'smollm2-shape' "
              "(random weights of SmolLM2-135M's shape); default: SmolLM2-135M-Instruct")


MODELS = Path(__file__).resolve().parent / "quality" / "models"
TRAINED_MODEL = MODELS / "qa-2layer"


def trained_model_dir(name: str = TRAINED_MODEL.name) -> Path | None:
    """A QA model shipped with the benchmarks (trained by benchmarks.quality.trained_model):
    "qa-2layer", or "qa-2layer-continued" (also trained on documents in two paragraphs);
    None when this checkout lacks it."""
    path = MODELS / name
    return path if (path / "model.safetensors").is_file() else None


def realistic_model_dir(root: Path | None = None, **overrides) -> Path:
    """A random-weight Llama of realistic shape saved by transformers (cached on disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmkv_engines.minimal.demo_model import default_cache_dir, ensure_demo_model

    cfg = {**REALISTIC, **overrides}
    root = root or default_cache_dir()
    tag = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
    path = root / f"bench-llama-{tag}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(initializer_range=0.05, **cfg))
    tmp = root / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    tmp.rename(path)
    return path


def bench_model(name: str | None) -> Path:
    """The model a benchmark runs: None is SmolLM2-135M-Instruct (the engine's default GGUF
    file), "realistic" the random-weight ~75M Llama above, "smollm2-shape" random weights of
    SmolLM2-135M's shape, anything else a path."""
    if name == "realistic":
        return realistic_model_dir()
    if name == "smollm2-shape":
        return realistic_model_dir(**SMOLLM2_SHAPE)
    from lmkv_engines.minimal.default_model import resolve_model

    return resolve_model(name)


def hf_model(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """transformers' dense model of a checkpoint directory or a GGUF file (its blocks
    dequantized at load, as the engine does), in ``dtype`` on ``device``."""
    try:
        import transformers
    except ImportError as e:
        raise SystemExit(f"{e}: the benchmarks compare with transformers; run `make setup` "
                         "(lmkv with its test extras) first") from e

    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        dense = ({"quantization_config": transformers.GgufConfig(dequantize=True)}
                 if hasattr(transformers, "GgufConfig") else {})
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, **dense)
    return model.to(device).eval()


def add_device_args(ap) -> None:
    """--device, --dtype and --enforce-eager of the engine a benchmark runs (EngineConfig's keys)."""
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs of decode steps")


def sync(device) -> None:
    """Wait for the device's queued work (a timer reads the host clock after it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _times(fn: Callable[[], object], repeats: int,
           before: Callable[[], object] | None = None) -> list[float]:
    """Wall times of ``repeats`` calls, after one warm-up call; ``before`` runs untimed
    ahead of every call."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls, after one warm-up call."""
    return statistics.median(_times(fn, repeats))


def best(fn: Callable[[], object], repeats: int = 5, before: Callable[[], object] | None = None) -> float:
    """Lowest wall time of ``repeats`` calls, after one warm-up call (``before``: as _times)."""
    return min(_times(fn, repeats, before))


def add_kv_work_args(ap, block: int) -> None:
    """The shared work's size on the command line: a prompt of --tokens in chunks of --chunk
    (whole blocks of ``block``), Llama-3.2-1B's KV shape by default (16 layers, 8 KV heads,
    head_dim 64). Check the result with ``check_kv_work_args``."""
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.set_defaults(block=block)


def check_kv_work_args(ap, args) -> None:
    if args.tokens % args.chunk or args.chunk % args.block:
        ap.error(f"--tokens must be a multiple of --chunk, and --chunk of {args.block}")


def drop_page_cache(paths: list[Path]) -> None:
    """Flush ``paths`` and drop them from the page cache, so the next read hits the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_seconds(paths: list[Path], repeats: int = 3) -> tuple[float, int]:
    """The fastest of the ways to read these files cold that we know, best of ``repeats``
    each (the files dropped from the page cache before every read): one after the other; all
    advised WILLNEED, then 4 threads; 16 threads reading 1 MiB pieces; O_DIRECT with 4 and
    with 16 threads. What the disk gives plain reads: the floor of a disk load, as far as
    the disk's speed holds still between the reads compared (on a VM it may not)."""
    sizes = [p.stat().st_size for p in paths]
    page = 4096
    rounded = [-(-n // page) * page for n in sizes]
    region = mmap.mmap(-1, sum(rounded))  # page-aligned, as O_DIRECT asks
    buf = memoryview(region)
    buf[:] = bytes(len(buf))  # pre-fault
    offsets = [sum(rounded[:i]) for i in range(len(sizes))]
    piece = 1 << 20

    def read(i: int, start: int = 0, length: int | None = None) -> None:
        n = sizes[i] - start if length is None else min(length, sizes[i] - start)
        with open(paths[i], "rb", buffering=0) as f:
            f.seek(start)
            f.readinto(buf[offsets[i] + start : offsets[i] + start + n])

    def read_direct(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            done = 0
            while done < sizes[i]:
                n = os.preadv(fd, [buf[offsets[i] + done : offsets[i] + rounded[i]]], done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)

    def serial() -> None:
        for i in range(len(paths)):
            read(i)

    def advised_threads() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(read, range(len(paths))))

    def pieces() -> None:
        jobs = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, piece)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda j: read(j[0], j[1], piece), jobs))

    def direct(threads: int) -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read_direct, range(len(paths))))

    methods = [serial, advised_threads, pieces]
    if hasattr(os, "O_DIRECT"):
        methods += [lambda: direct(4), lambda: direct(16)]
    best = float("inf")
    for method in methods * repeats:
        drop_page_cache(paths)
        start = time.perf_counter()
        try:
            method()
        except OSError:  # a file system without O_DIRECT
            continue
        best = min(best, time.perf_counter() - start)
    buf.release()
    region.close()
    return best, sum(sizes)


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()
