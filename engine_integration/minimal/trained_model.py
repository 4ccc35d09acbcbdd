"""A small Llama trained on CPU, with its own BPE tokenizer: a model whose attention is
meant to mean something, on which lossy KV paths (codecs, CacheBlend) can be measured
(benchmarks/quality).

It is trained (plain PyTorch) on a mix of Python's documentation topics and a synthetic
multi-document question-answering task (qa_data.py), and saved as a Hugging Face Llama
directory (fp16 safetensors, config.json, tokenizer.json, tokenizer_config.json):

    python -m lmkv_engines.minimal.trained_model --out DIR [--steps N] [--seed S] [--init DIR]

The default recipe (TrainConfig: 4.2M parameters, 1500 steps of 16x256 tokens, ~4.5k
tokens/s on two idle cores, ~25 minutes) mixes documentation text, QA prompts and two
drills meant to teach copying from the context. It is not enough, and the model is not the
engine's default: measured on CPU (session 2), the model learns text (held-out perplexity
~57, random ~4000) but not to answer (0/20 single-document questions). What was found:
- a copy drill whose repeat sits at a fixed distance is learned in ~500 steps, but as a
  positional shortcut ("copy from 128 tokens back"), useless for retrieval;
- with the repeat at a random distance (content-based induction), neither this model nor
  a 4-layer 128-wide one learned it in 400-2500 steps on CPU (cosine-decayed learning rate);
- a 2-layer 128-wide model on the copy drill alone (64-token rows, distinct tokens from a
  512-token pool, learning rate held at 3e-3) did: loss at chance until step ~2000, then
  copying by content at 0.97-0.99 by step 3000 (~6 minutes), also on 256-token rows. The
  circuit is specific to the tokens it was drilled on: the recall drill and QA answers (other
  tokens) stayed at chance; drilling on the QA words too then restarts the climb slowly
  (copy 0.33, QA answer tokens 0.07 after 600 more steps).
  Holding the learning rate at 2e-3 with recall and copy at 0.3 each then broke through:
  recall 0.91 and QA answer tokens 0.75 by 1800 more steps; after 5600, held-out QA 7/20
  single-document and 4/20 two-document (chance ~1/80).
So: drill copying on the QA vocabulary from the start, and expect thousands of steps;
``--device cuda`` trains the same recipe on a GPU where one exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import qa_data
from .demo_model import build_atomically, default_cache_dir
from .train_llama import TrainLlama, pose_positions

log = logging.getLogger(__name__)


def ensure_trained_model(cache_dir: Path | None = None, cfg: TrainConfig | None = None) -> Path:
    """The trained model's directory under ``cache_dir`` (default $LMKV_CACHE_DIR/models or
    ~/.cache/lmkv/models), training it on first use: tens of minutes."""
    cfg = cfg or TrainConfig()
    cache_dir = cache_dir or default_cache_dir()
    tag = hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:10]
    path = cache_dir / f"lmkv-tiny-qa-{tag}"
    if (path / "model.safetensors").is_file():
        return path
    log.warning("training the small QA model in %s (first use only; tens of minutes)", path)
    return build_atomically(path, lambda out: train(cfg, out))


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096  # RoPE positions seen in training (skips, see pose_positions)
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 40
    weight_decay: float = 0.1
    text_fraction: float = 0.1  # sequences of documentation text
    recall_fraction: float = 0.2  # key-value recall drills (teach copying from context)
    copy_fraction: float = 0.2  # a random span repeated at a random distance
    copy_vocab: int = 512  # distinct tokens the copy drill draws from (without repeats)
    question_tokens: int = 96  # QA sequences keep at least this much room for questions
    qa_filler: tuple[int, ...] = (0, 0, 1)  # most filler sentences per fact, drawn per sequence
    context_weight: float = 0.1  # loss weight of QA tokens other than answers (answers: 1)
    seed: int = 0
    threads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def train_tokenizer(cfg: TrainConfig):
    """Byte-level BPE on the training topics plus QA prompts, so the made-up words of the
    closed vocabularies become (mostly) single tokens."""
    from .demo_model import train_tokenizer as bpe

    rng = random.Random(cfg.seed + 1)
    filler = qa_data.filler_sentences("train")
    qa = [qa_data.training_text(qa_data.make_example(rng, 8, 8, filler, (0, 1))) for _ in range(400)]
    return bpe(cfg.vocab_size, qa_data.pydoc_topics("train") + qa)


class Batches:
    """Training sequences of exactly ``seq_len`` tokens: documentation text windows, and QA
    prompts (as many documents as fit, then question/answer lines up to the length)."""

    def __init__(self, cfg: TrainConfig, tokenizer, seed: int):
        self.cfg = cfg
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.filler = qa_data.filler_sentences("train")
        eos = tokenizer.token_to_id("<|eos|>")
        # the copy drill's tokens: the QA task's words (the circuit learned on some tokens
        # does not carry over to tokens it never copied) and a block of other ids
        vocab = qa_data.vocabulary()
        words = [*vocab.countries, *(w for ws in vocab.values.values() for w in ws)]
        pool = {t for w in words for t in tokenizer.encode(f" {w}").ids}
        pool |= set(range(256, min(256 + cfg.copy_vocab, cfg.vocab_size)))
        self.copy_pool = sorted(pool)
        self.text: list[int] = []
        for topic in qa_data.pydoc_topics("train"):
            self.text += tokenizer.encode(topic).ids + [eos]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] and the loss weight of each token [B, T]."""
        cfg = self.cfg
        mix = {"text": cfg.text_fraction, "recall": cfg.recall_fraction, "copy": cfg.copy_fraction}
        mix["qa"] = 1.0 - sum(mix.values())
        self.kinds = self.rng.choices(list(mix), weights=list(mix.values()), k=cfg.batch_size)
        rows = [getattr(self, f"_{kind}")() for kind in self.kinds]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    def _text(self) -> tuple[list[int], list[float]]:
        start = self.rng.randrange(len(self.text) - self.cfg.seq_len)
        return self.text[start : start + self.cfg.seq_len], [1.0] * self.cfg.seq_len

    def _copy(self) -> tuple[list[int], list[float]]:
        """Random tokens with one span of them repeated, at a random distance: the repeat is
        predictable only by looking back for the current token and copying what followed."""
        n = self.cfg.seq_len
        pool = self.copy_pool
        ids = self.rng.sample(pool, n) if len(pool) >= n else self.rng.choices(pool, k=n)
        length = self.rng.randint(8, n // 3)
        src = self.rng.randrange(0, n - 2 * length)
        dst = self.rng.randrange(src + length, n - length)
        ids[dst : dst + length] = ids[src : src + length]
        weights = [0.0] * n
        weights[dst + 1 : dst + length] = [1.0] * (length - 1)
        return ids, weights

    def _recall(self) -> tuple[list[int], list[float]]:
        """"Zorvia Melk. Tarnia Dun. ..." then the same keys, in another order, each
        followed by its value: the plainest form of copying an answer from the context."""
        vocab = qa_data.vocabulary()
        n = self.cfg.seq_len
        pairs = []
        ids: list[int] = []
        while len(ids) < n // 2:
            key = self.rng.choice(vocab.countries)
            value = self.rng.choice(vocab.values[self.rng.choice(qa_data.ATTRIBUTES)])
            pairs.append((self.tok.encode(f" {key}").ids, self.tok.encode(f" {value}.").ids))
            ids += pairs[-1][0] + pairs[-1][1]
        weights = [self.cfg.context_weight] * len(ids)
        while len(ids) < n:
            key, value = self.rng.choice(pairs)
            ids += key + value
            weights += [self.cfg.context_weight] * len(key) + [1.0] * (len(value) - 1) + [0.1]
        return ids[:n], weights[:n]

    def _qa(self) -> tuple[list[int], list[float]]:
        n = self.cfg.seq_len
        filler_hi = self.rng.choice(self.cfg.qa_filler)
        num_docs = self.rng.randint(2, 10)
        budget = max(n // 4, n - self.cfg.question_tokens)  # the rest is for questions
        while True:
            ex = qa_data.make_example(self.rng, num_docs, 40, self.filler, (0, filler_hi))
            ids = self.tok.encode(ex.context()).ids
            if len(ids) <= budget or (num_docs == 2 and filler_hi == 0):
                break
            if num_docs > 2:
                num_docs -= 1
            else:
                filler_hi = 0
        weights = [self.cfg.context_weight] * len(ids)
        newline = self.tok.encode("\n").ids
        for q in ex.questions:
            question = self.tok.encode(q.text).ids
            answer = self.tok.encode(f" {q.answer}").ids
            ids += question + answer + newline
            weights += [self.cfg.context_weight] * len(question) + [1.0] * len(answer)
            weights += [self.cfg.context_weight] * len(newline)
            if len(ids) >= n:
                break
        return ids[:n], weights[:n]


def train(cfg: TrainConfig, out_dir: Path, log_every: int = 25, save_every: int = 0,
          init: Path | None = None, device: str = "cpu") -> dict:
    """Train from scratch, or go on from the model saved in ``init`` (same geometry; its
    tokenizer is kept). ``device``: "cpu" or a CUDA device (same recipe, bf16 autocast)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    dev = torch.device(device)
    model = TrainLlama(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                       cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta)
    if init is None:
        tok = train_tokenizer(cfg)
    else:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(init / "tokenizer.json"))
        state = {k: v.float() for k, v in load_file(str(init / "model.safetensors")).items()}
        result = model.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
            raise ValueError(f"{init} does not match the configured geometry: {result}")
    model.to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    batches = Batches(cfg, tok, cfg.seed + 2)
    pos_rng = torch.Generator().manual_seed(cfg.seed + 3)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"training {nparams / 1e6:.2f}M parameters for {cfg.steps} steps of "
          f"{cfg.batch_size}x{cfg.seq_len} tokens", flush=True)
    start = time.perf_counter()
    smooth = smooth_acc = None
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * min(1.0, step / cfg.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        ids, weights = next(batches)
        positions = pose_positions(ids.shape, cfg.max_position_embeddings, pos_rng).to(dev)
        ids, weights = ids.to(dev), weights.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1], positions[:, :-1])
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="none")
        w = weights[:, 1:].flatten()
        loss = (nll * w).sum() / w.sum()
        qa_rows = torch.tensor([k == "qa" for k in batches.kinds], device=dev)
        answers = (w == 1.0) & qa_rows[:, None].expand_as(weights[:, 1:]).flatten()
        hits = (logits.detach().argmax(-1).flatten() == ids[:, 1:].flatten())[answers]
        acc = hits.float().mean().item() if hits.numel() else 0.0
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
        smooth_acc = acc if smooth_acc is None else 0.9 * smooth_acc + 0.1 * acc
        if step % log_every == 0 or step == cfg.steps:
            took = time.perf_counter() - start
            rate = step * cfg.batch_size * cfg.seq_len / took
            print(f"step {step}/{cfg.steps} loss {smooth:.3f} QA answer-token acc {smooth_acc:.2f} "
                  f"lr {lr:.2e} {rate:.0f} tok/s {took / 60:.1f} min", flush=True)
        if save_every and step % save_every == 0 and step < cfg.steps:
            save(model, tok, cfg, out_dir, {"step": step, "final_loss": round(smooth, 4)})
    seconds = time.perf_counter() - start
    save(model, tok, cfg, out_dir, {"train_seconds": round(seconds), "final_loss": round(smooth, 4)})
    return {"seconds": seconds, "loss": smooth}


def save(model: TrainLlama, tokenizer, cfg: TrainConfig, out_dir: Path, info: dict) -> None:
    """A Hugging Face Llama directory: fp16 safetensors, config.json, tokenizer files."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float16",
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": tokenizer.token_to_id("<|eos|>"),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "model_max_length": cfg.max_position_embeddings,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    (out_dir / "training.json").write_text(json.dumps({**asdict(cfg), **info}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lmkv_engines.minimal.trained_model",
                                description="Train the small QA Llama (CPU) and save it as a "
                                            "Hugging Face directory.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--init", type=Path, help="go on from this saved model (same geometry)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] where a GPU exists")
    args = p.parse_args(argv)
    cfg = TrainConfig(steps=args.steps, seed=args.seed, threads=args.threads)
    result = train(cfg, args.out, args.log_every, args.save_every, args.init, args.device)
    print(f"saved {args.out} after {result['seconds'] / 60:.1f} min, loss {result['loss']:.3f}")


if __name__ == "__main__":
    main()
