"""KV codecs judged by task quality on a real chat model (SmolLM2-135M-Instruct by default):
held-out RAG QA prompts (benchmarks/quality/rag_qa.py) answered with the prompt's KV stored
through a codec and decoded back, beside lossless full prefill.

    python -m benchmarks.codec_rag [--model PATH] [--n 100] [--errors 0.03 0.06 0.12] [--decode-only]

Each prompt is prefilled once (lossless: the reference answer and 64 greedy tokens); its
chunks (lmkv's hot cache) are then replaced by codec.decode(codec.encode(kv)) and the prompt
is run again, the chunks loaded instead of computed (the last partial chunk, the question's
end, is computed). Settings: per-token int8 (one fp16 scale per token, layer, K/V) and
cachegen at each error target, calibrated on "dev" prompts of the same set (the targets
weighed by each layer's measured effect on the answers, as `engine calibrate` does; --ramp:
the ramp alone). One line per
setting: size vs fp16 of the stored KV, QA accuracy, greedy agreement over 64 tokens with the
lossless run; the size each error target would take without cachegen's decorrelating
transform (per channel, as before it; size only), and on the ramp alone at the same error
target (size only; equal divergence predicted); then the summary lines of the issue's
targets and decode GB/s on one core vs the disk's raw read rate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec import Transform, chunks_of, int8_bytes, int8_roundtrip, serve_transformed  # noqa: E402
from common import best, raw_read_seconds  # noqa: E402
from quality.rag_qa import MAX_TOKENS, make_examples  # noqa: E402

from lmkv.codec import cachegen, native  # noqa: E402
from lmkv.codec.calibrate import full_chunks, measure_sensitivity  # noqa: E402
from lmkv.codec.calibration import CacheGenTable, CalibrationSettings, calibrate  # noqa: E402
from lmkv.config import load_config  # noqa: E402
from lmkv.ops_torch import rerotate_keys  # noqa: E402
from lmkv_engines.minimal.default_model import resolve_model  # noqa: E402
from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import SamplingParams  # noqa: E402

GEN = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def roundtrip(table: CacheGenTable) -> Transform:
    def fn(x: torch.Tensor, position: int) -> torch.Tensor:
        out = torch.empty_like(x)
        cachegen.decode_into(cachegen.encode(x, table, position=position), out, table)
        return out
    return fn


def pre_rope_chunks(llm: LLM, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """The full chunks of ``ids``'s KV with the keys before RoPE (what ``engine calibrate``
    measures)."""
    return full_chunks(llm.engine.compute_kv([ids], pre_rope=True)[0], chunk)


def rotated(chunks: list[torch.Tensor], inv_freq: torch.Tensor) -> list[torch.Tensor]:
    """Chunks of one prompt (keys before RoPE) with their keys rotated to their positions."""
    out = []
    for i, c in enumerate(chunks):
        t = c.shape[2]
        out.append(c.clone())
        rerotate_keys(out[-1][0], torch.arange(i * t, (i + 1) * t), inv_freq)
    return out


def reply(llm: LLM, ids: list[int]) -> str:
    """The answer as rag_qa reads it: up to MAX_TOKENS tokens, cut at end of sequence."""
    eos = llm.tokenizer.eos_token_ids
    out = []
    for t in ids[:MAX_TOKENS]:
        if t in eos:
            break
        out.append(t)
    return llm.tokenizer.decode(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a directory or .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--n", type=int, default=100, help="held-out prompts")
    ap.add_argument("--skip", type=int, default=0,
                    help="start after this many held-out prompts (a fresh sample of the split)")
    ap.add_argument("--calib", type=int, default=4, help="dev prompts to calibrate on")
    ap.add_argument("--errors", type=float, nargs="+", default=[0.03, 0.06, 0.12])
    ap.add_argument("--deep-ratio", type=float, default=CalibrationSettings().deep_ratio,
                    help="the last layer's error target relative to the first's, for every target")
    ap.add_argument("--value-ratio", type=float, default=CalibrationSettings().value_ratio,
                    help="V's error target relative to K's, for every error target")
    ap.add_argument("--ramp", action="store_true",
                    help="targets on the ramp alone, not weighed by each layer's measured effect")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=0, help="stop adding prompts after this")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode speed line (a minute instead of ~10 s a prompt)")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_model(args.model)
    cfg = load_config(env={}, chunk_size=args.chunk, max_local_cpu_size=1.0, codec_check_every=0)
    llm = LLM(str(path), lmkv_config=cfg, kv_cache_memory=512 << 20, enable_prefix_caching=False)
    tok = llm.tokenizer

    def encode(e) -> list[int]:
        return tok.encode(tok.apply_chat_template(e.messages()))

    count = lambda t: len(tok.encode(t))  # noqa: E731
    rope = llm.engine.rope_inv_freq
    calib, calib_rotated, dev_ids = [], [], []
    for e in make_examples(args.calib, "dev", count, seed=1):
        dev_ids.append(encode(e))
        chunks = pre_rope_chunks(llm, dev_ids[-1], args.chunk)
        calib += chunks
        calib_rotated += rotated(chunks, rope)
    vr = args.value_ratio
    dr = args.deep_ratio
    profile = dict(deep_ratio=dr, value_ratio=vr, weigh_layers=not args.ramp)
    ramp = {err: calibrate(calib, CalibrationSettings(error=err, **profile), rope=rope)
            for err in args.errors}  # the targets before weighing the layers
    sensitivity = None
    if not args.ramp:  # measured once (per squared target), as engine calibrate does
        sensitivity = measure_sensitivity(llm.engine, next(iter(ramp.values())), dev_ids, args.chunk)
    tables = ramp if sensitivity is None else {
        err: calibrate(calib, CalibrationSettings(error=err, **profile), rope=rope,
                       sensitivity=sensitivity) for err in args.errors}
    print(f"calibrated on {args.calib} dev prompts ({len(calib)} chunks): errors {args.errors}, "
          f"V's target {vr:g}x K's, the last layer's {dr:g}x the first's, "
          + ("on that ramp" if args.ramp else "then weighed by each layer's measured sensitivity"),
          flush=True)
    for err, t in tables.items():
        print(f"targets at {err:g} per layer, K: " + " ".join(f"{x:.2g}" for x in t.target[0].tolist())
              + "; V: " + " ".join(f"{x:.2g}" for x in t.target[1].tolist()), flush=True)
    default_error = CalibrationSettings().error
    default_error = default_error if default_error in tables else next(iter(tables))
    default = tables[default_error]
    if args.decode_only:
        kv_sample = []
        for e in make_examples(2, "heldout", count):
            ids = encode(e)
            llm.generate([ids], FIRST)
            kv_sample += list(enumerate(chunks_of(llm, ids)))
        llm.close()
        decode_speed(default_error, default, kv_sample[:8], args.chunk)
        return
    per_channel = {err: calibrate(calib, CalibrationSettings(error=err, **profile, transform=False),
                                  rope=rope, sensitivity=sensitivity)
                   for err in args.errors}  # size only: what the transform saves
    as_rotated = {err: calibrate(calib_rotated, CalibrationSettings(error=err, **profile),
                                 sensitivity=sensitivity)
                  for err in args.errors}  # size only: what coding keys un-rotated saves

    settings: dict[str, Transform] = {"int8": int8_roundtrip}
    settings |= {f"cachegen {err:g}": roundtrip(t) for err, t in tables.items()}
    correct = {"lossless": 0} | {s: 0 for s in settings}
    agree = {s: 0 for s in settings}
    size = {"fp16": 0, "int8": 0} | {f"{kind} {err:g}": 0 for err in tables
                                       for kind in ("cachegen", "per-channel", "as-rotated", "ramp")}
    examples = make_examples(args.skip + args.n, "heldout", count)[args.skip:]
    lengths, kv_sample = [], []
    start = time.perf_counter()
    done = 0
    for i, e in enumerate(examples):
        ids = encode(e)
        lengths.append(len(ids))
        ref = llm.generate([ids], GEN)[0].output_token_ids  # cold: full prefill, chunks stored
        correct["lossless"] += e.is_correct(reply(llm, ref))
        kv = chunks_of(llm, ids)
        if len(kv_sample) < 8:
            kv_sample += list(enumerate(kv))[: 8 - len(kv_sample)]
        size["fp16"] += sum(c.numel() * 2 for c in kv)
        size["int8"] += sum(int8_bytes(c) for c in kv)
        for err, t in tables.items():
            for j, c in enumerate(kv):
                pos = j * args.chunk
                size[f"cachegen {err:g}"] += len(cachegen.encode(c, t, position=pos))
                size[f"per-channel {err:g}"] += len(cachegen.encode(c, per_channel[err], position=pos))
                size[f"as-rotated {err:g}"] += len(cachegen.encode(c, as_rotated[err]))
                if sensitivity is not None:  # the size on the ramp, only where it differs
                    size[f"ramp {err:g}"] += len(cachegen.encode(c, ramp[err], position=pos))
        exact: dict[str, torch.Tensor] = {}
        for name, fn in settings.items():
            out = serve_transformed(llm, ids, GEN, fn, exact).output_token_ids
            correct[name] += e.is_correct(reply(llm, out))
            agree[name] += sum(a == b for a, b in zip(out, ref, strict=True))
        done = i + 1
        elapsed = time.perf_counter() - start
        print(f"[{done}/{args.n}] {len(ids)} tokens, {elapsed:.0f}s: " + ", ".join(
            f"{k} {v}" for k, v in correct.items()), flush=True)
        if args.seconds and elapsed > args.seconds:
            break
    llm.close()

    acc = {k: 100 * v / done for k, v in correct.items()}
    agr = {k: v / (64 * done) for k, v in agree.items()}
    which = f" (numbers {args.skip + 1}-{args.skip + done} of the split)" if args.skip else ""
    print(f"model {path.name}: {done} held-out RAG QA prompts{which} ({min(lengths)}-{max(lengths)} "
          f"tokens, mean {sum(lengths) / done:.0f}), chunks of {args.chunk}; lossless (full "
          f"prefill) accuracy {acc['lossless']:.1f}%")
    for name in settings:
        print(f"{name}: {size[name] / 1e6:.1f} MB vs fp16 {size['fp16'] / 1e6:.1f} MB, QA accuracy "
              f"{acc[name]:.1f}% (lossless {acc['lossless']:.1f}%), agreement {agr[name]:.1%} over "
              f"64 tokens: size vs fp16 = {size['fp16'] / size[name]:.2f}x")
    for err, t in tables.items():
        name = f"cachegen {err:g}"
        print(f"{name} ({'with' if t.basis is not None else 'without'} the transform) vs the same "
              f"error target per channel: {size[f'per-channel {err:g}'] / 1e6:.1f} MB vs "
              f"{size[name] / 1e6:.1f} MB: per-channel/cachegen = "
              f"{size[f'per-channel {err:g}'] / size[name]:.2f}x")
        print(f"{name} (keys coded un-rotated) vs the same error target calibrated on keys as "
              f"rotated: {size[f'as-rotated {err:g}'] / 1e6:.1f} MB vs {size[name] / 1e6:.1f} MB: "
              f"as-rotated/cachegen = {size[f'as-rotated {err:g}'] / size[name]:.2f}x")
        if sensitivity is not None:
            print(f"{name} (targets weighed by layer sensitivity) vs the same error target on "
                  f"the ramp (at most its predicted divergence): {size[f'ramp {err:g}'] / 1e6:.1f} MB vs "
                  f"{size[name] / 1e6:.1f} MB: ramp/cachegen = {size[f'ramp {err:g}'] / size[name]:.2f}x")
    within = [err for err in tables if acc[f"cachegen {err:g}"] >= acc["lossless"] - 1]
    if within:
        best_err = max(within)
        name = f"cachegen {best_err:g}"
        print(f"largest cachegen error within 1 point of lossless: {best_err:g} ({acc[name]:.1f}% "
              f"vs {acc['lossless']:.1f}%): size vs fp16 = {size['fp16'] / size[name]:.2f}x")
    else:
        print("no cachegen error target within 1 point of lossless accuracy")
    eq = [err for err in tables if acc[f"cachegen {err:g}"] >= acc["int8"]]
    if eq:
        name = f"cachegen {max(eq):g}"
        print(f"per-token int8 vs {name} (accuracy {acc['int8']:.1f}% vs {acc[name]:.1f}%): "
              f"{size['int8'] / 1e6:.1f} MB vs {size[name] / 1e6:.1f} MB: "
              f"int8/cachegen = {size['int8'] / size[name]:.2f}x")
    else:
        print(f"no cachegen error target at or above per-token int8's accuracy {acc['int8']:.1f}%")

    decode_speed(default_error, default, kv_sample, args.chunk)


def decode_speed(error: float, table: CacheGenTable, sample: list[tuple[int, torch.Tensor]],
                 chunk: int) -> None:
    """The decode speed of ``table`` on one core vs the disk's raw read rate of the same KV
    (chunks with their index in their prompt)."""
    kv_sample = [c for _, c in sample]
    payloads = [cachegen.encode(c, table, position=i * chunk) for i, c in sample]
    outs = [torch.empty_like(c) for c in kv_sample]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dec_s = best(lambda: [cachegen.decode_into(b, o, table)
                          for b, o in zip(payloads, outs, strict=True)], repeats=5)
    torch.set_num_threads(threads)
    model_bytes = sum(c.numel() * c.element_size() for c in kv_sample)
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, c in enumerate(kv_sample):
            p = Path(tmp) / f"chunk{i}"
            p.write_bytes(c.contiguous().view(torch.uint8).numpy().tobytes())
            files.append(p)
        secs, nbytes = raw_read_seconds(files)
    dec, disk = model_bytes / dec_s / 1e9, nbytes / secs / 1e9
    lib = native.library()
    channels = kv_sample[0].shape[3] * kv_sample[0].shape[4]
    product = str(cachegen.product_dtype(channels)).removeprefix("torch.")
    how = (f"torch, {product} products" if lib is None else "native, AMX" if lib.lmkv_amx()
           else f"native, {product} products")
    print(f"cachegen {error:g} decode vs disk read (one core, {how}, "
          f"{len(kv_sample)} chunks): {dec:.2f} GB/s of KV produced vs {disk:.2f} GB/s raw read: "
          f"{dec / disk:.2f}x")


if __name__ == "__main__":
    main()
