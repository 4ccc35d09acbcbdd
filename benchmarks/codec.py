"""KV codecs side by side, in one run: size, agreement, speed, TTFT from disk.

On a model directory (--model; default: the trained QA model shipped in
benchmarks/quality/models when present, else the random-weight demo model) and long prompts
(--text FILE; default with a model: long multi-document QA examples, cut into windows):
- cachegen bytes vs fp16 bytes of the same KV (target >= 4x) at greedy-token agreement
  >= 99% over 64 generated tokens, with the stored KV replaced by its decoded copy;
- vs per-token int8 (one fp16 scale per token, layer, K/V; target: >= 2x smaller at equal or
  better agreement), compared only at equal or better quality on the same prompts: the
  error target is halved from --error (--match-steps times at most) until cachegen's
  agreement reaches int8's, and the smallest cachegen level tried (those and --also-error)
  at or above int8's agreement (and, with QA prompts, at or above int8's QA accuracy) is
  the one compared; vs zstd on the fp16 bytes (lossless);
- the agreement of the KV merely rounded to bfloat16: the floor of the agreement measure on
  these prompts (a model at near-ties flips on any rounding);
- cachegen decode and encode GB/s on one core (KV bytes in the model's dtype produced /
  consumed) vs the disk tier's raw read GB/s (target decode >= 1x);
- rANS (lmkv.codec.rans) as the entropy stage instead of zstd: size and decode speed;
- TTFT with the prompt's chunks on disk (dropped from the page cache): cachegen vs raw;
- with a trained model: QA accuracy on held-out long prompts when the documents' KV is
  served decoded (lossless, int8, cachegen at each error target): whether answers survive,
  which free-running continuations (the agreement figure) overstate.
Every line ends with its ratio. Calibration uses other prompts than the measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best, drop_page_cache, raw_read_seconds, trained_model_dir  # noqa: E402

from lmkv.codec import cachegen  # noqa: E402
from lmkv.codec.calibrate import calibration_prompts  # noqa: E402
from lmkv.codec.calibration import CacheGenTable, CalibrationSettings, calibrate  # noqa: E402
from lmkv.config import load_config  # noqa: E402
from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import SamplingParams  # noqa: E402

GEN = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def hot_llm(model: str | None, chunk: int, **lmkv) -> LLM:
    cfg = load_config(env={}, chunk_size=chunk, max_local_cpu_size=0.6, **lmkv)
    return LLM(model, lmkv_config=cfg, kv_cache_memory=256 << 20, enable_prefix_caching=False)


def chunks_of(llm: LLM, prompt: list[int]) -> list[torch.Tensor]:
    eng = llm.engine.kv_connector.cache
    bufs = eng.fetch(eng.keys(prompt))
    out = [b.kv.clone() for b in bufs]
    for b in bufs:
        b.release()
    return out


Transform = Callable[[torch.Tensor, int], torch.Tensor]  # (chunk kv, its first position) -> kv


def serve_transformed(llm: LLM, prompt: list[int], params: SamplingParams,
                      transform: Transform, exact: dict[str, torch.Tensor]):
    """Generate for ``prompt`` with its stored chunks replaced by transform(kv, position) and
    served from the hot cache (no prefix caching). ``exact`` keeps the original KV per key."""
    eng = llm.engine.kv_connector.cache
    keys = eng.keys(prompt)
    bufs = eng.fetch(keys)
    assert len(bufs) == len(keys), "the hot cache lost chunks: raise max_local_cpu_size"
    for i, (key, b) in enumerate(zip(keys, bufs, strict=True)):
        b.kv.copy_(transform(exact.setdefault(key, b.kv.clone()), i * eng.chunk_size))
        b.release()
    out = llm.generate([prompt], params)[0]
    assert out.num_external_tokens > 0
    return out


def agreement(llm: LLM, prompts: list[list[int]], refs: list[list[int]],
              transform: Transform, exact: dict[str, torch.Tensor]) -> float:
    """Greedy-token agreement with each prompt's stored KV replaced by transform(kv)."""
    same = total = 0
    for p, ref in zip(prompts, refs, strict=True):
        out = serve_transformed(llm, p, GEN, transform, exact)
        same += sum(a == b for a, b in zip(out.output_token_ids, ref, strict=True))
        total += len(ref)
    return same / total


def qa_accuracy(llm: LLM, prompts: list, transform: Transform,
                exact: dict[str, torch.Tensor]) -> float:
    """Fraction of held-out QA prompts answered right with their stored KV replaced by
    transform(kv) (the question, in the prompt's last partial chunk, is always computed)."""
    from quality import metrics

    answers = []
    for p in prompts:
        out = serve_transformed(llm, llm.tokenizer.encode(p.text), ANSWER, transform, exact)
        answers.append(llm.tokenizer.decode(out.output_token_ids))
    return metrics.qa_accuracy(answers, [p.answer for p in prompts]).accuracy


class Level(NamedTuple):
    """cachegen at one calibration error target, measured on the test prompts."""
    error: float
    nbytes: int
    agreement: float
    bound: float  # worst per-layer relative error / its target
    table: CacheGenTable


def matched(levels: list[Level], quality: Callable[[Level], float], floor: float) -> Level | None:
    """The smallest level whose quality is at least ``floor`` (None if no level reaches it)."""
    ok = [lv for lv in levels if quality(lv) >= floor]
    return min(ok, key=lambda lv: lv.nbytes) if ok else None


def int8_roundtrip(kv: torch.Tensor, position: int = 0) -> torch.Tensor:
    # per token: one scale per (kv, layer, token) over [H, D]
    scale = kv.float().abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-8) / 127
    return (torch.round(kv.float() / scale).clamp(-127, 127) * scale).to(kv.dtype)


def int8_bytes(kv: torch.Tensor) -> int:
    return kv.numel() + 2 * kv.shape[0] * kv.shape[1] * kv.shape[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (default: the shipped trained model if "
                    "present, else the demo model)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--error", type=float, default=CalibrationSettings().error)
    ap.add_argument("--deep-ratio", type=float, default=CalibrationSettings().deep_ratio)
    ap.add_argument("--value-ratio", type=float, default=CalibrationSettings().value_ratio)
    ap.add_argument("--also-error", type=float, nargs="*", default=[0.002],
                    help="further calibration error targets to report size and agreement for")
    ap.add_argument("--match-steps", type=int, default=6,
                    help="times the error target is halved from --error while cachegen's "
                    "agreement stays below int8's")
    ap.add_argument("--repeats", type=int, default=3, help="TTFT measurements per codec")
    ap.add_argument("--qa-prompts", type=int, default=None,
                    help="held-out long single-document QA prompts answered with each codec's "
                    "KV (default 30 with a trained model, else 0)")
    ap.add_argument("--text", help="text file for prompts (default: long QA examples with the "
                    "trained model, random tokens with the demo model)")
    args = ap.parse_args()
    if args.model is None and (shipped := trained_model_dir()) is not None:
        args.model = str(shipped)
    if args.qa_prompts is None:
        args.qa_prompts = 30 if args.model else 0
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        llm = hot_llm(args.model, args.chunk)
        vocab = llm.engine.model_config.vocab_size
        text = Path(args.text).read_text() if args.text else None
        if text is None and args.model:  # a trained model: prompts like the QA benchmark's
            from quality.qa import qa_text

            text = qa_text(40)
        tok = llm.engine.tokenizer.encode
        half = len(text) // 2 if text else 0  # text: measure on the first half, calibrate on the rest
        calib_p = calibration_prompts(vocab, 4, args.length, seed=1000,
                                      text=text[half:] if text else None, tokenize=tok)
        test_p = calibration_prompts(vocab, args.prompts, args.length, seed=1,
                                     text=text[:half] if text else None, tokenize=tok)
        calib = [c for p in calib_p if llm.generate([p], FIRST) for c in chunks_of(llm, p)]

        def make_table(err: float) -> CacheGenTable:
            path = root / f"table-{err:g}.safetensors"
            calibrate(calib, CalibrationSettings(error=err, deep_ratio=args.deep_ratio,
                                                   value_ratio=args.value_ratio)).save(path)
            return CacheGenTable.load(path)

        table, table_path = make_table(args.error), root / f"table-{args.error:g}.safetensors"

        refs = [o.output_token_ids for o in llm.generate(test_p, GEN)]  # no lmkv hit: cold
        kv = [c for p in test_p for c in chunks_of(llm, p)]
        dtype = kv[0].dtype
        model_bytes = sum(c.numel() * c.element_size() for c in kv)
        fp16 = sum(c.numel() * 2 for c in kv)
        cg = [cachegen.encode(c, table) for c in kv]
        cg_bytes = sum(len(b) for b in cg)
        i8 = sum(int8_bytes(c) for c in kv)
        import zstandard

        zc = zstandard.ZstdCompressor(level=1)
        zs = sum(len(zc.compress(c.half().numpy().tobytes())) for c in kv)
        rans_bytes = sum(len(cachegen.encode(c, table, "rans")) for c in kv[:4])
        cg4 = sum(len(b) for b in cg[:4])

        def roundtrip(t: CacheGenTable) -> Transform:
            def fn(x: torch.Tensor, position: int = 0) -> torch.Tensor:  # no rope: unused
                out = torch.empty_like(x)
                cachegen.decode_into(cachegen.encode(x, t), out, t)
                return out
            return fn

        exact: dict[str, torch.Tensor] = {}

        def level(t: CacheGenTable) -> Level:
            rt = roundtrip(t)
            size = sum(len(cachegen.encode(c, t)) for c in kv)
            errs = torch.stack([((rt(c).float() - c.float()).square().sum(dim=(2, 3, 4))
                                 / c.float().square().sum(dim=(2, 3, 4))).sqrt() for c in kv])
            return Level(t.target[0, 0].item(), size, agreement(llm, test_p, refs, rt, exact),
                         (errs.amax(0) / t.target).max().item(), t)

        agree_i8 = agreement(llm, test_p, refs, int8_roundtrip, exact)
        levels = [level(table)] + [level(make_table(err)) for err in args.also_error]
        agree_cg = levels[0].agreement
        err, last = args.error, levels[0]
        for _ in range(args.match_steps):  # halve the error until int8's agreement is reached
            if last.agreement >= agree_i8:
                break
            err /= 2
            last = level(make_table(err))
            levels.append(last)
        levels.sort(key=lambda lv: -lv.error)
        # the floor of the agreement measure: the same KV only rounded to bfloat16 (~0.17%
        # error); where this is below 99%, no lossy codec can reach 99% on these prompts
        agree_bf16 = agreement(llm, test_p, refs, lambda x, _: x.to(torch.bfloat16).to(x.dtype), exact)
        qa: dict[str, float] = {}
        if args.qa_prompts:
            from quality.qa import LONG_FILLER, heldout_prompts

            qa_p = heldout_prompts(args.qa_prompts, 6, 1, LONG_FILLER)
            llm.generate([llm.tokenizer.encode(p.text) for p in qa_p], FIRST)  # stores their chunks
            qa["lossless"] = qa_accuracy(llm, qa_p, lambda x, _: x, exact)
            qa["int8"] = qa_accuracy(llm, qa_p, int8_roundtrip, exact)
            for lv in levels:
                qa[f"cachegen {lv.error:g}"] = qa_accuracy(llm, qa_p, roundtrip(lv.table), exact)
        llm.engine.close()

        torch.set_num_threads(1)
        outs = [torch.empty_like(c) for c in kv]
        dec_s = best(lambda: [cachegen.decode_into(b, o, table) for b, o in zip(cg, outs, strict=True)])
        enc_s = best(lambda: [cachegen.encode(c, table) for c in kv], repeats=3)
        rans_p = [cachegen.encode(c, table, "rans") for c in kv[:2]]
        rans_s = best(lambda: [cachegen.decode_into(b, o, table)
                               for b, o in zip(rans_p, outs[:2], strict=True)], repeats=1)
        rans_gbps = sum(c.numel() * c.element_size() for c in kv[:2]) / rans_s / 1e9
        torch.set_num_threads(os.cpu_count() or 1)

        # TTFT from disk: raw frames vs cachegen frames, page cache dropped; the two codecs
        # alternate and the best of each is kept (the machine is shared: medians drift)
        disks, extras = {}, {}
        for codec in ("raw", "cachegen"):
            disk = root / f"disk-{codec}"
            extras[codec] = dict(local_disk=str(disk), max_local_disk_size=8.0,
                                 local_disk_codec=codec, cachegen_calibration=str(table_path),
                                 enable_prefetch=False)
            w = hot_llm(args.model, args.chunk, **extras[codec])
            w.generate(test_p, FIRST)
            w.engine.close()
            disks[codec] = [p for p in disk.rglob("*") if p.is_file()]
        secs, nbytes = raw_read_seconds(disks["raw"])
        disk_read = nbytes / secs / 1e9
        ttft: dict[str, list[float]] = {"raw": [], "cachegen": []}
        load: dict[str, list[float]] = {"raw": [], "cachegen": []}
        for _ in range(args.repeats):
            for codec in ("raw", "cachegen"):
                r = hot_llm(args.model, args.chunk, **extras[codec])
                r.generate([test_p[0][: args.chunk]], FIRST)  # warm up the model, no hit
                drop_page_cache(disks[codec])
                start = time.perf_counter()
                out = r.generate([test_p[0]], FIRST)[0]
                ttft[codec].append(time.perf_counter() - start)
                assert out.num_external_tokens > 0
                load[codec].append(r.engine.metrics.registry.get_sample_value(
                    "lmkv_tier_seconds_sum", {"tier": "disk", "op": "get"}))
                r.engine.close()

    dec_gbps = model_bytes / dec_s / 1e9
    enc_gbps = model_bytes / enc_s / 1e9
    n = len(kv)
    print(f"model {args.model or 'demo'}: {len(test_p)} prompts x {args.length} tokens, {n} chunks of "
          f"{args.chunk}, KV dtype {str(dtype).removeprefix('torch.')}, calibration error "
          f"{args.error} (x{args.deep_ratio} at the last layer, x{args.value_ratio} for V)")
    print(f"cachegen size vs fp16: {cg_bytes / 1e6:.2f} MB vs {fp16 / 1e6:.2f} MB at agreement "
          f"{agree_cg:.2%} (64 greedy tokens): {fp16 / cg_bytes:.2f}x")
    same = matched(levels, lambda lv: lv.agreement, agree_i8)
    if same is None:
        top = max(levels, key=lambda lv: lv.agreement)
        print(f"per-token int8 vs cachegen size at equal or better agreement: no error target "
              f"tried (down to {levels[-1].error:g}) reaches int8's agreement {agree_i8:.2%} "
              f"(best {top.agreement:.2%} at {top.error:g}, {top.nbytes / 1e6:.2f} MB vs int8 "
              f"{i8 / 1e6:.2f} MB): not comparable")
    else:
        print(f"per-token int8 vs cachegen size at equal or better agreement: {i8 / 1e6:.2f} MB "
              f"(agreement {agree_i8:.2%}) vs cachegen at error target {same.error:g} "
              f"{same.nbytes / 1e6:.2f} MB (agreement {same.agreement:.2%}): "
              f"{i8 / same.nbytes:.2f}x")
    print(f"KV rounded to bfloat16 (the size of fp16, ~0.17% error): agreement "
          f"{agree_bf16:.2%} vs cachegen {agree_cg:.2%}: {agree_cg / max(agree_bf16, 1e-9):.2f}x")
    print(f"zstd-only (lossless) on fp16 vs cachegen size: {zs / 1e6:.2f} MB (fp16/zstd "
          f"{fp16 / zs:.2f}x) vs {cg_bytes / 1e6:.2f} MB: {zs / cg_bytes:.2f}x")
    for lv in levels:
        print(f"cachegen at error target {lv.error:g}: {lv.nbytes / 1e6:.2f} MB, agreement "
              f"{lv.agreement:.2%}, worst per-layer relative error {lv.bound:.2f}x of its target; "
              f"size vs fp16: {fp16 / lv.nbytes:.2f}x")
    if qa:
        default = f"cachegen {args.error:g}"
        print(f"QA accuracy with the stored KV decoded ({args.qa_prompts} long single-document "
              f"prompts): " + ", ".join(f"{k} {v:.1%}" for k, v in qa.items())
              + f": {default} - lossless = {100 * (qa[default] - qa['lossless']):+.1f} points")
        same_qa = matched(levels, lambda lv: qa[f"cachegen {lv.error:g}"], qa["int8"])
        if same_qa is None:
            print(f"per-token int8 vs cachegen size at equal or better QA accuracy: no error "
                  f"target tried reaches int8's {qa['int8']:.1%}: not comparable")
        else:
            print(f"per-token int8 vs cachegen size at equal or better QA accuracy: "
                  f"{i8 / 1e6:.2f} MB (QA {qa['int8']:.1%}) vs cachegen at error target "
                  f"{same_qa.error:g} {same_qa.nbytes / 1e6:.2f} MB (QA "
                  f"{qa[f'cachegen {same_qa.error:g}']:.1%}): {i8 / same_qa.nbytes:.2f}x")
    print(f"cachegen decode vs disk read (one core): {dec_gbps:.2f} GB/s of KV produced vs "
          f"{disk_read:.2f} GB/s raw read: {dec_gbps / disk_read:.2f}x")
    print(f"cachegen encode vs disk read (one core): {enc_gbps:.2f} GB/s of KV consumed vs "
          f"{disk_read:.2f} GB/s: {enc_gbps / disk_read:.2f}x")
    print(f"entropy stage rANS vs zstd, size (4 chunks): {rans_bytes / 1e6:.3f} MB vs "
          f"{cg4 / 1e6:.3f} MB: {cg4 / rans_bytes:.3f}x")
    print(f"entropy stage rANS vs zstd, decode (one core): {rans_gbps:.3f} GB/s vs "
          f"{dec_gbps:.2f} GB/s: {rans_gbps / dec_gbps:.3f}x")
    print(f"disk-tier load time of the prompt's chunks, raw vs cachegen: "
          f"{min(load['raw']) * 1e3:.1f} ms vs {min(load['cachegen']) * 1e3:.1f} ms: "
          f"{min(load['raw']) / min(load['cachegen']):.2f}x")
    print(f"TTFT from disk, raw vs cachegen (page cache dropped, best of {args.repeats}): "
          f"{min(ttft['raw']) * 1e3:.1f} ms vs {min(ttft['cachegen']) * 1e3:.1f} ms: "
          f"{min(ttft['raw']) / min(ttft['cachegen']):.2f}x")


if __name__ == "__main__":
    main()
