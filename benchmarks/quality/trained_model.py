"""A small Llama trained on CPU, with its own BPE tokenizer: a model whose attention is
meant to mean something, on which lossy KV paths (codecs, CacheBlend) can be measured
(benchmarks/quality).

It is trained (plain PyTorch) on a mix of Python's documentation topics, a synthetic
multi-document question-answering task (qa_data.py) and two drills that teach copying
from the context, and saved as a Hugging Face Llama directory (fp16 safetensors,
config.json, tokenizer.json, tokenizer_config.json):

    python -m benchmarks.quality.trained_model --out DIR [--seed S] [--scale F]
        [--init DIR [--layers N] --phases NAME ...]

Training runs in phases (RECIPE): "induction" (the copy drill alone, 64-token rows),
"mix" (all four row kinds, 256 tokens, questions may repeat within a row), "long-qa" and
"long-qa-2" (1024-token rows, QA with filler between facts, distinct questions; the second
starts as a restart). "deep-qa" (not in the default run) goes on from a trained model grown
by ``--layers`` (new layers on top, starting as the identity), with half the questions
about a neighbor's fact; "linked-qa" and "continued-qa" (neither in the default run) add
documents that need the one before them. Held-out
QA accuracy (its own prompts, not the benchmarks') is printed every 500 steps; the saved
model is the last phase's best of those evaluations. A token of loss weight w < 1 is
supervised with probability w, and logits are computed only for supervised tokens (most of
a 0.8M-parameter model's compute is its 4096-way output layer): ~20k tokens/s on two cores.

The shipped models (benchmarks/quality/models) are rebuilt bit for bit by this script; how
the recipe was found, what was tried and what each phase measured is in
docs/trained_model.md.
``--device cuda`` trains the same recipe on a GPU where one exists.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from . import qa_data
from .train_llama import TrainLlama, pose_positions

KINDS = ("text", "recall", "copy", "qa")  # the row kinds of Batches


@dataclass(frozen=True)
class Phase:
    """A stretch of training with one batch shape, learning rate and mix of row kinds."""

    name: str
    steps: int
    seq_len: int
    batch_size: int
    lr: float
    mix: tuple[tuple[str, float], ...]  # (kind, fraction) of KINDS
    decay: float = 0.0  # cosine decay to lr/10 over this last fraction of the steps (0: held)
    copy_qa_words: bool = True  # the copy drill also draws the QA task's words
    distinct_questions: bool = True  # False: a QA row may ask a question twice (copyable)
    # begin as a run resumed from the saved model would (``--init`` with ``--seed`` + 1):
    # weights rounded to fp16, a fresh optimizer, the data streams reseeded (see RECIPE)
    restart: bool = False
    two_doc: float = 0.3  # fraction of QA questions about a neighbor's fact (two documents)
    linked: float = 0.0  # chance a QA document is introduced as an earlier one's neighbor
    continued: float = 0.0  # chance a QA document is two paragraphs, the second saying "it"

    def __post_init__(self) -> None:
        kinds = {k for k, _ in self.mix}
        if not kinds <= set(KINDS) or abs(sum(f for _, f in self.mix) - 1) > 1e-6:
            raise ValueError(f"phase {self.name}: mix {self.mix} must be fractions of "
                             f"{', '.join(KINDS)} summing to 1")
        if self.steps < 1 or self.seq_len < 16 or self.batch_size < 1 or not 0 <= self.decay <= 1:
            raise ValueError(f"bad phase {self}")

    def lr_at(self, step: int, warmup: int) -> float:
        """Learning rate at ``step`` (1-based) of this phase."""
        lr = self.lr * min(1.0, step / warmup) if warmup else self.lr
        held = self.steps * (1 - self.decay)
        if step > held:
            frac = (step - held) / (self.steps - held)
            lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        return lr


# The recipe (CPU; what it reached and how it was run is in the module docstring): first
# the copy drill alone until content-based induction appears (loss at chance for ~2000
# steps, then a drop), then everything at 256 tokens with questions that may repeat in a
# row (a repeat is answered by copying the earlier question line: the easy form of the
# lookup the QA task needs), then long QA rows with filler so that retrieval works across
# thousands of tokens of distractors; the QA answers appear in the second long phase.
RECIPE = (
    Phase("induction", steps=2500, seq_len=64, batch_size=32, lr=3e-3, mix=(("copy", 1.0),),
          copy_qa_words=False),
    Phase("mix", steps=6000, seq_len=256, batch_size=16, lr=2e-3, distinct_questions=False,
          mix=(("text", 0.05), ("recall", 0.3), ("copy", 0.3), ("qa", 0.35))),
    Phase("long-qa", steps=3000, seq_len=1024, batch_size=4, lr=2e-3, decay=0.2,
          mix=(("text", 0.05), ("recall", 0.1), ("copy", 0.15), ("qa", 0.7))),
    Phase("long-qa-2", steps=1000, seq_len=1024, batch_size=4, lr=2e-3, restart=True,
          mix=(("text", 0.05), ("recall", 0.1), ("copy", 0.15), ("qa", 0.7))),
)
# Not part of the default run: on a grown model (--init a 2-layer one, --layers 4), long QA
# rows with more questions about a neighbor's fact, which need two lookups in sequence
DEEP = Phase("deep-qa", steps=2400, seq_len=1024, batch_size=4, lr=1e-3, decay=0.2, two_doc=0.5,
             mix=(("text", 0.05), ("recall", 0.05), ("copy", 0.05), ("qa", 0.85)))
# Also not in the default run: documents that are introduced only as an earlier document's
# neighbor ("The capital of it is ..."), whose facts need that document to mean anything:
# the case where a chunk's KV depends on the chunks before it (CacheBlend's)
LINKED = Phase("linked-qa", steps=2400, seq_len=1024, batch_size=4, lr=1e-3, decay=0.2, linked=0.5,
               mix=(("text", 0.05), ("recall", 0.05), ("copy", 0.05), ("qa", 0.85)))
# Also not in the default run: documents written as two paragraphs (two RAG chunks), the
# second saying "it", so that its facts are about the country the first one names
CONTINUED = Phase("continued-qa", steps=3000, seq_len=1024, batch_size=4, lr=2e-3, decay=0.2,
                  continued=1.0, mix=(("text", 0.05), ("recall", 0.05), ("copy", 0.05), ("qa", 0.85)))
PHASES = (*RECIPE, DEEP, LINKED, CONTINUED)


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096  # RoPE positions seen in training (skips, see pose_positions)
    rope_theta: float = 10000.0
    phases: tuple[Phase, ...] = RECIPE
    warmup: int = 20  # steps of linear warm-up at the start of each phase
    weight_decay: float = 0.1
    copy_vocab: int = 512  # distinct tokens the copy drill draws from (without repeats)
    qa_docs: tuple[int, int] = (2, 8)  # documents per QA row (fewer when they do not fit)
    qa_filler: tuple[int, ...] = (0, 0, 1, 2, 3)  # most filler sentences per fact, drawn per row
    context_weight: float = 0.1  # loss weight of QA tokens other than answers (answers: 1)
    seed: int = 0
    threads: int = 2
    eval_questions: int = 40  # held-out questions per QA evaluation (those with filler: 2/5)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def scaled(self, factor: float) -> TrainConfig:
        """The same recipe with every phase's steps times ``factor`` (quick trial runs)."""
        return replace(self, phases=tuple(replace(p, steps=max(1, round(p.steps * factor)))
                                          for p in self.phases))


def train_tokenizer(cfg: TrainConfig):
    """Byte-level BPE on the training topics plus QA prompts, so the made-up words of the
    closed vocabularies become (mostly) single tokens."""
    from lmkv_engines.minimal.demo_model import train_tokenizer as bpe

    rng = random.Random(cfg.seed + 1)
    filler = qa_data.filler_sentences("train")
    qa = [qa_data.training_text(qa_data.make_example(rng, 8, 8, filler, (0, 1))) for _ in range(400)]
    return bpe(cfg.vocab_size, qa_data.pydoc_topics("train") + qa)


class Batches:
    """Training rows of exactly ``phase.seq_len`` tokens with a loss weight per token, of four
    kinds: documentation text windows; copy drills; key-value recall drills; QA rows (as many
    documents as fit, then distinct question/answer lines)."""

    def __init__(self, cfg: TrainConfig, tokenizer, seed: int):
        self.cfg = cfg
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.filler = qa_data.filler_sentences("train")
        self.phase = cfg.phases[0]
        eos = tokenizer.token_to_id("<|eos|>")
        # the copy drill's tokens: a block of ids and, after the first phase, the QA task's
        # words too (the circuit learned on some tokens does not carry over to others)
        vocab = qa_data.vocabulary()
        words = [*vocab.countries, *(w for ws in vocab.values.values() for w in ws)]
        qa_words = {t for w in words for t in tokenizer.encode(f" {w}").ids}
        id_block = range(256, min(256 + cfg.copy_vocab, cfg.vocab_size))
        self.copy_pools = {False: list(id_block), True: sorted(qa_words.union(id_block))}
        self.text: list[int] = []
        for topic in qa_data.pydoc_topics("train"):
            self.text += tokenizer.encode(topic).ids + [eos]

    @property
    def seq_len(self) -> int:
        return self.phase.seq_len

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] and the loss weight of each token [B, T]."""
        kinds, weights = zip(*self.phase.mix, strict=True)
        self.kinds = self.rng.choices(kinds, weights=weights, k=self.phase.batch_size)
        rows = [getattr(self, f"_{kind}")() for kind in self.kinds]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    def _text(self) -> tuple[list[int], list[float]]:
        start = self.rng.randrange(len(self.text) - self.seq_len)
        return self.text[start : start + self.seq_len], [1.0] * self.seq_len

    def _copy(self) -> tuple[list[int], list[float]]:
        """Random tokens with one span of them repeated, at a random distance: the repeat is
        predictable only by looking back for the current token and copying what followed."""
        n = self.seq_len
        pool = self.copy_pools[self.phase.copy_qa_words]
        ids = self.rng.sample(pool, n) if len(pool) >= n else self.rng.choices(pool, k=n)
        length = self.rng.randint(8, max(8, min(n // 3, 128)))
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
        n = self.seq_len
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
        """Documents, then distinct questions each followed by its answer; the rest of the
        row (when the questions run out) is documentation text that carries no loss."""
        n = self.seq_len
        docs = self.rng.randint(*self.cfg.qa_docs)
        filler_hi = self.rng.choice(self.cfg.qa_filler)
        while True:
            ex = qa_data.make_example(self.rng, docs, 5 * docs, self.filler, (0, filler_hi),
                                      two_doc_fraction=self.phase.two_doc,
                                      distinct=self.phase.distinct_questions,
                                      linked=self.phase.linked,
                                      continued=self.phase.continued)
            ids = self.tok.encode(ex.context()).ids
            if len(ids) <= n - 48 or (docs == 2 and filler_hi == 0):
                break
            if docs > 2:
                docs -= 1
            else:
                filler_hi -= 1
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
        if len(ids) < n:
            start = self.rng.randrange(len(self.text) - n)
            ids += self.text[start : start + n - len(ids)]
            weights += [0.0] * (n - len(weights))
        return ids[:n], weights[:n]


EVAL_SEED = 500  # held-out prompts watched during training (benchmarks.quality uses 1000+)


def qa_accuracy(model: TrainLlama, tok, n: int, num_documents: int,
                filler_per_fact: tuple[int, int], device: torch.device | None = None,
                two_doc: bool = False, linked: bool = False, continued: bool = False) -> float:
    """Fraction of ``n`` held-out single-document (``two_doc``: neighbor; ``linked``: about a
    document introduced as an earlier one's neighbor; ``continued``: about a fact in a
    document's second paragraph) questions whose answer's first token is the model's top
    prediction after the prompt (no sampling, no engine: a quick check)."""
    rng = random.Random(EVAL_SEED * 10 + num_documents + (100 if two_doc else 0) + (200 if linked else 0)
                        + (300 if continued else 0))
    filler = qa_data.filler_sentences("train") if filler_per_fact[1] else None
    was_training = model.training
    model.eval()
    hits = 0
    with torch.no_grad():
        for _ in range(n):
            if linked or continued:
                ex, q = qa_data.dependent_example(rng, num_documents, filler, filler_per_fact,
                                                  "linked" if linked else "continued")
            else:
                ex = qa_data.make_example(rng, num_documents, 1, filler, filler_per_fact,
                                          two_doc_fraction=float(two_doc))
                q = ex.questions[0]
            ids = torch.tensor([tok.encode(ex.context() + q.text).ids], device=device)
            logits = model(ids, torch.arange(ids.shape[1], device=device)[None])
            hits += int(logits[0, -1].argmax().item() == tok.encode(f" {q.answer}").ids[0])
    model.train(was_training)
    return hits / n


def train(cfg: TrainConfig, out_dir: Path, log_every: int = 25, save_every: int = 0,
          init: Path | None = None, device: str = "cpu", eval_every: int = 500,
          compiled: bool = False) -> dict:
    """Train from scratch, or go on from the model saved in ``init`` (same geometry; its
    tokenizer is kept), phase after phase. ``device``: "cpu" or a CUDA device (same recipe,
    bf16 autocast). Every ``eval_every`` steps and at the end of each phase, held-out QA
    accuracy (short and long prompts) is printed. ``compiled``: run the model's layers
    through torch.compile (one compilation per phase's batch shape; ~1.3x faster training
    on CPU, but other rounding: another trajectory), falling back to eager mode, with a
    message, where it cannot compile."""
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
        have = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
        if have > cfg.num_layers:
            raise ValueError(f"{init} has {have} layers, more than the {cfg.num_layers} configured")
        result = model.load_state_dict(state, strict=False)  # lm_head is tied to the embedding
        grown = tuple(f"model.layers.{i}." for i in range(have, cfg.num_layers))
        missing = {k for k in result.missing_keys if k != "lm_head.weight" and not k.startswith(grown)}
        if result.unexpected_keys or missing:
            raise ValueError(f"{init} does not match the configured geometry: {result}")
        with torch.no_grad():  # layers added on top start as the identity: same outputs
            for layer in model.model.layers[have:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        if grown:
            print(f"grew {init} from {have} to {cfg.num_layers} layers", flush=True)
    model.to(dev)

    def make_optimizer() -> torch.optim.Optimizer:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                  {"params": other, "weight_decay": 0.0}], betas=(0.9, 0.95))

    opt = make_optimizer()
    batches = Batches(cfg, tok, cfg.seed + 2)
    pos_rng = torch.Generator().manual_seed(cfg.seed + 3)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"training {nparams / 1e6:.2f}M parameters for {cfg.steps} steps in "
          f"{len(cfg.phases)} phases: " + ", ".join(
              f"{p.name} {p.steps}x{p.batch_size}x{p.seq_len}" for p in cfg.phases), flush=True)
    start = time.perf_counter()
    smooth = None
    done = tokens = 0
    evals: dict[str, float] = {}
    # the last phase's best held-out evaluation (its own prompts, not the benchmarks'): the
    # QA accuracy of this small model swings by tens of points between evaluations
    best: dict = {"score": -1.0}

    def evaluate(where: str, phase: Phase) -> None:
        n, n_long = cfg.eval_questions, max(1, cfg.eval_questions * 2 // 5)
        evals["qa_short"] = qa_accuracy(model, tok, n, 4, (0, 0), dev)
        evals["qa_long"] = qa_accuracy(model, tok, n_long, 6, (3, 3), dev)
        evals["qa_two_doc"] = qa_accuracy(model, tok, n, 4, (0, 0), dev, two_doc=True)
        linked = ""
        if phase.linked:
            evals["qa_linked"] = qa_accuracy(model, tok, n, 4, (0, 0), dev, linked=True)
            linked = f"; linked {evals['qa_linked']:.2f} (4 short documents)"
        if phase.continued:
            evals["qa_continued"] = qa_accuracy(model, tok, n, 4, (0, 0), dev, continued=True)
            evals["qa_continued_long"] = qa_accuracy(model, tok, n_long, 6, (3, 3), dev, continued=True)
            linked += (f"; second paragraphs {evals['qa_continued']:.2f} (4 short documents), "
                       f"{evals['qa_continued_long']:.2f} (6 documents with filler)")
        print(f"held-out QA after {where}: single-document {evals['qa_short']:.2f} (4 short "
              f"documents), {evals['qa_long']:.2f} (6 documents with filler); two-document "
              f"{evals['qa_two_doc']:.2f} (4 short documents){linked}", flush=True)
        # a phase mostly about neighbors' facts, or with linked documents, is judged on them too
        picked = ["qa_short", "qa_long"] + ["qa_two_doc"] * (phase.two_doc >= 0.5)
        picked += ["qa_linked"] * bool(phase.linked)
        picked += ["qa_continued", "qa_continued_long"] * bool(phase.continued)
        score = sum(evals[k] for k in picked) / len(picked)
        last_phase = phase is cfg.phases[-1]
        if last_phase and score > best["score"]:
            best.update(score=score, step=done, evals=dict(evals), loss=smooth,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})

    layers = model.hidden_states
    if compiled:
        layers = torch.compile(model.hidden_states, dynamic=False)

    for phase in cfg.phases:
        if phase.restart and phase is not cfg.phases[0]:
            # what a second process started with --init OUT --seed (seed + 1) does; the
            # first phase of a run starts that way already
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.half().float())
            opt = make_optimizer()
            batches = Batches(cfg, tok, cfg.seed + 1 + 2)
            pos_rng = torch.Generator().manual_seed(cfg.seed + 1 + 3)
        batches.phase = phase
        for step in range(1, phase.steps + 1):
            lr = phase.lr_at(step, cfg.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            ids, weights = next(batches)
            positions = pose_positions(ids.shape, cfg.max_position_embeddings, pos_rng).to(dev)
            ids, weights = ids.to(dev), weights.to(dev)
            # a token of loss weight w < 1 is supervised (at weight 1) with probability w: the
            # same loss in expectation, and logits only where supervised (~1/3 of the tokens)
            w = weights[:, 1:].flatten()
            keep = (torch.rand(w.shape, generator=pos_rng) < w.cpu()).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                try:
                    hidden = layers(ids[:, :-1], positions[:, :-1])
                except Exception as e:  # no C++ compiler, an unsupported platform, ...
                    if layers is model.hidden_states:
                        raise
                    print(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                          "training in eager mode", flush=True)
                    layers = model.hidden_states
                    hidden = layers(ids[:, :-1], positions[:, :-1])
                logits = model.lm_head(hidden.flatten(0, 1)[keep])
            loss = torch.nn.functional.cross_entropy(logits.float(), ids[:, 1:].flatten()[keep])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            done += 1
            tokens += ids.numel()
            smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
            if step % log_every == 0 or step == phase.steps:
                took = time.perf_counter() - start
                print(f"{phase.name} step {step}/{phase.steps} (total {done}/{cfg.steps}) loss "
                      f"{smooth:.3f} lr {lr:.2e} {tokens / took:.0f} tok/s {took / 60:.1f} min", flush=True)
            if step == phase.steps or (eval_every and done % eval_every == 0):
                evaluate(f"{phase.name} step {step}", phase)
            if save_every and done % save_every == 0 and done < cfg.steps:
                save(model, tok, cfg, out_dir / f"step-{done}",
                     {"step": done, "final_loss": round(smooth, 4), **evals})
    seconds = time.perf_counter() - start
    model.load_state_dict(best["state"])
    print(f"keeping the last phase's best held-out evaluation: step {best['step']} of {cfg.steps}",
          flush=True)
    save(model, tok, cfg, out_dir, {"steps": cfg.steps, "kept_step": best["step"],
                                    "train_seconds": round(seconds), "loss": round(best["loss"], 4),
                                    **{k: round(v, 3) for k, v in best["evals"].items()}})
    return {"seconds": seconds, "loss": best["loss"], "kept_step": best["step"], **best["evals"]}


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
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.trained_model",
                                description="Train the small QA Llama (CPU) and save it as a "
                                            "Hugging Face directory.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every phase's steps by this (e.g. 0.1 for a quick trial)")
    p.add_argument("--phases", nargs="+", metavar="NAME",
                   help="run only these phases of the recipe (with --init: go on from a checkpoint); "
                        f"the recipe is {' '.join(ph.name for ph in RECIPE)}; also {DEEP.name}, "
                        f"{LINKED.name}, {CONTINUED.name}")
    p.add_argument("--layers", type=int, default=TrainConfig.num_layers,
                   help="decoder layers; with --init of a model with fewer, the new layers go on "
                        "top and start as the identity")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--threads", type=int, default=TrainConfig.threads)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=0,
                   help="also save every N steps, to OUT/step-N (0: only the kept model, in OUT)")
    p.add_argument("--init", type=Path, help="go on from this saved model (same geometry)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] where a GPU exists")
    p.add_argument("--compile", action="store_true",
                   help="run the layers through torch.compile: ~1.3x faster on CPU, but other "
                        "rounding, so another trajectory than the eager runs the shipped model "
                        "came from (eager where compiling fails)")
    p.add_argument("--eval-every", type=int, default=500,
                   help="print held-out QA accuracy every N steps (and after each phase); OUT "
                        "gets the last phase's best of these")
    args = p.parse_args(argv)
    phases = RECIPE
    if args.phases:
        unknown = set(args.phases) - {ph.name for ph in PHASES}
        if unknown:
            p.error(f"unknown phase(s) {sorted(unknown)}; there are {[ph.name for ph in PHASES]}")
        phases = tuple(ph for ph in PHASES if ph.name in args.phases)
    cfg = TrainConfig(phases=phases, seed=args.seed, threads=args.threads,
                      num_layers=args.layers).scaled(args.scale)
    result = train(cfg, args.out, args.log_every, args.save_every, args.init, args.device,
                   args.eval_every, args.compile)
    print(f"saved {args.out} after {result['seconds'] / 60:.1f} min, loss {result['loss']:.3f}")


if __name__ == "__main__":
    main()
