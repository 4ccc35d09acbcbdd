"""The training script (a few steps): its directory loads in the engine and in transformers
with the same logits and token ids; the quality probe on the engine."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from benchmarks.quality import metrics
from benchmarks.quality.probe import greedy, open_llm, prefill
from benchmarks.quality.qa import heldout_prompts
from benchmarks.quality.trained_model import Phase, TrainConfig, train
from lmkv_engines.minimal.llm import LLM

MIX = (("text", 0.25), ("recall", 0.25), ("copy", 0.25), ("qa", 0.25))
TINY = TrainConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                   num_kv_heads=1, max_position_embeddings=512, eval_questions=5,
                   phases=(Phase("a", steps=1, seq_len=64, batch_size=2, lr=1e-3, mix=(("copy", 1.0),)),
                           Phase("b", steps=1, seq_len=96, batch_size=2, lr=1e-3, mix=MIX, decay=1.0)))


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train(TINY, out, log_every=1)
    return out


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_training_writes_a_hugging_face_llama_directory(tiny_trained):
    config = json.loads((tiny_trained / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 1, 32)
    info = json.loads((tiny_trained / "training.json").read_text())
    assert info["steps"] == 2 and info["loss"] > 0 and info["kept_step"] == 2
    assert [p["name"] for p in info["phases"]] == ["a", "b"]
    assert 0 <= info["qa_short"] <= 1 and 0 <= info["qa_long"] <= 1
    names = {p.name for p in tiny_trained.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names


def test_engine_and_transformers_load_it_with_the_same_logits_and_tokens(tiny_trained):
    from transformers import AutoTokenizer

    text = heldout_prompts(1, 3, 2, seed=3)[0].text
    with LLM(str(tiny_trained), kv_cache_memory=4 << 20, max_model_len=512) as llm:
        ids = llm.tokenizer.encode(text)
        assert AutoTokenizer.from_pretrained(tiny_trained)(text)["input_ids"] == ids
        got = prefill(llm, ids).logits
    torch.testing.assert_close(got, _hf_logits(tiny_trained, ids), atol=1e-4, rtol=1e-4)


def test_training_goes_on_from_a_saved_model(tiny_trained, tmp_path):
    train(TINY, tmp_path, log_every=1, init=tiny_trained)
    a = json.loads((tiny_trained / "tokenizer.json").read_text())
    b = json.loads((tmp_path / "tokenizer.json").read_text())
    assert a["model"]["vocab"] == b["model"]["vocab"]  # the tokenizer is kept


def test_two_identical_runs_measure_as_identical(tiny_model_dir):
    with open_llm(str(tiny_model_dir), max_len=1024, kv_cache_memory=16 << 20) as llm:
        mc = llm.engine.model_config
        ids = llm.tokenizer.encode(heldout_prompts(1, 3, 1, seed=9)[0].text)
        a, b = prefill(llm, ids), prefill(llm, ids)
        assert a.logits.shape == (len(ids), mc.vocab_size)
        assert a.kv[0].shape == (2, len(ids), mc.num_kv_heads, mc.head_dim)
        assert metrics.kl_divergence(a.logits, b.logits) == 0.0
        assert metrics.layer_relative_error(a.kv, b.kv) == [0.0] * mc.num_layers
        first, second = greedy(llm, [ids], 8), greedy(llm, [ids], 8)
        assert metrics.agreement(first[0], second[0]) == metrics.Agreement(1.0, None, 8)
        # causal: the KV of a prompt's first T-1 tokens does not depend on the T-th
        assert torch.equal(prefill(llm, ids[:-1]).kv[0], a.kv[0][:, :-1])


def test_copy_drill_supervises_only_a_repeat_found_by_content(tiny_trained):
    """Every supervised token of a copy row repeats the token that followed the same token
    earlier in the row (so only looking back by content predicts it); ids stay in the vocab."""
    from tokenizers import Tokenizer

    from benchmarks.quality.trained_model import Batches

    batches = Batches(TINY, Tokenizer.from_file(str(tiny_trained / "tokenizer.json")), seed=0)
    distances = set()
    for _ in range(50):
        ids, weights = batches._copy()
        assert len(ids) == len(weights) == TINY.phases[0].seq_len and max(ids) < TINY.vocab_size
        supervised = [t for t, w in enumerate(weights) if w == 1.0]
        assert supervised
        for t in supervised:
            earlier = ids.index(ids[t - 1])
            assert earlier < t - 1 and ids[earlier + 1] == ids[t]
            distances.add(t - 1 - earlier)
    assert len(distances) > 5  # not a fixed offset a positional shortcut could learn


def test_qa_rows_ask_each_question_once_and_supervise_only_answers(tiny_trained):
    from tokenizers import Tokenizer

    from benchmarks.quality.trained_model import Batches

    tok = Tokenizer.from_file(str(tiny_trained / "tokenizer.json"))
    batches = Batches(TINY, tok, seed=1)
    batches.phase = Phase("long", steps=1, seq_len=1024, batch_size=1, lr=1e-3, mix=(("qa", 1.0),))
    for _ in range(5):
        ids, weights = batches._qa()
        assert len(ids) == len(weights) == 1024
        lines = tok.decode(ids).split("\n")
        questions = [line.rsplit(" ", 1)[0] for line in lines if line.startswith("Q: ")][:-1]
        assert questions and len(questions) == len(set(questions))
        supervised = "".join(tok.decode([t]) if w == 1.0 else "|" for t, w in zip(ids, weights, strict=True))
        answers = [a.strip() for a in supervised.split("|") if a]  # runs of supervised tokens
        assert answers and all(a.isalpha() and a[0].isupper() for a in answers)


def test_the_last_phases_best_evaluation_is_kept(tmp_path, capsys):
    """Evaluated after every step of the last phase, the saved model is the best of those
    evaluations (the first, on a tie), and training.json says which step it was."""
    cfg = replace(TINY, phases=(TINY.phases[0], replace(TINY.phases[1], steps=4)))
    result = train(cfg, tmp_path, log_every=1, eval_every=1)
    scores = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"held-out QA after b step (\d+): single-document ([\d.]+) .*, ([\d.]+) \(6", line)
        if m:
            scores[int(m[1]) + 1] = (float(m[2]) + float(m[3])) / 2  # total steps = phase b's + 1
    assert sorted(scores) == [2, 3, 4, 5]
    kept = max(scores, key=lambda step: (scores[step], -step))
    info = json.loads((tmp_path / "training.json").read_text())
    assert result["kept_step"] == info["kept_step"] == kept
    assert (info["qa_short"] + info["qa_long"]) / 2 == pytest.approx(scores[kept], abs=0.01)


def test_questions_repeat_only_where_the_phase_allows_it(tiny_trained):
    from tokenizers import Tokenizer

    from benchmarks.quality.trained_model import Batches

    tok = Tokenizer.from_file(str(tiny_trained / "tokenizer.json"))
    batches = Batches(TINY, tok, seed=4)
    repeats = {}
    for distinct in (True, False):
        batches.phase = Phase("x", steps=1, seq_len=512, batch_size=1, lr=1e-3, mix=(("qa", 1.0),),
                              distinct_questions=distinct)
        repeats[distinct] = 0
        for _ in range(10):
            lines = tok.decode(batches._qa()[0]).split("\n")
            questions = [line.rsplit(" ", 1)[0] for line in lines if line.startswith("Q: ")][:-1]
            repeats[distinct] += len(questions) - len(set(questions))
    assert repeats[True] == 0 and repeats[False] > 0


def test_phase_validation_and_learning_rate_schedule():
    with pytest.raises(ValueError, match="mix"):
        Phase("x", steps=10, seq_len=64, batch_size=1, lr=1e-3, mix=(("copy", 0.5),))
    with pytest.raises(ValueError, match="mix"):
        Phase("x", steps=10, seq_len=64, batch_size=1, lr=1e-3, mix=(("chat", 1.0),))
    held = Phase("x", steps=100, seq_len=64, batch_size=1, lr=1e-3, mix=(("copy", 1.0),), decay=0.2)
    assert held.lr_at(1, warmup=10) == pytest.approx(1e-4)
    assert held.lr_at(50, warmup=10) == held.lr_at(80, warmup=10) == pytest.approx(1e-3)
    assert held.lr_at(100, warmup=10) == pytest.approx(1e-4)
    assert TrainConfig().scaled(0.1).steps == round(TrainConfig().steps * 0.1)


def test_a_restart_phase_trains_as_a_second_run_from_the_saved_model(tiny_trained, tmp_path):
    """A phase with ``restart`` in one run gives, bit for bit, the model that a second run
    (--init the first's output, --seed + 1) gives: how the shipped model was first made."""
    first, second = TINY.phases[0], replace(TINY.phases[1], restart=True, steps=3)
    train(replace(TINY, phases=(first, second)), tmp_path / "one", log_every=1)
    train(replace(TINY, phases=(first,)), tmp_path / "a", log_every=1)
    train(replace(TINY, phases=(second,), seed=TINY.seed + 1), tmp_path / "b", log_every=1,
          init=tmp_path / "a")
    one = (tmp_path / "one" / "model.safetensors").read_bytes()
    assert one == (tmp_path / "b" / "model.safetensors").read_bytes()
    # and the restart is not a no-op: without it the same phases end elsewhere
    train(replace(TINY, phases=(first, replace(second, restart=False))), tmp_path / "plain", log_every=1)
    assert one != (tmp_path / "plain" / "model.safetensors").read_bytes()


def test_a_grown_model_starts_with_the_same_logits(tiny_trained, tmp_path):
    """Layers added on top of a trained model start as the identity (then train); a model
    with more layers than configured is refused."""
    frozen = replace(TINY.phases[0], lr=0.0)  # weight decay scales with lr: nothing moves
    train(replace(TINY, num_layers=3, phases=(frozen,)), tmp_path, log_every=1, init=tiny_trained)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 3
    ids = heldout_prompts(1, 3, 1, seed=5)[0].text
    logits = []
    for d in (tiny_trained, tmp_path):
        with LLM(str(d), kv_cache_memory=4 << 20, max_model_len=512) as llm:
            logits.append(prefill(llm, llm.tokenizer.encode(ids)).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="3 layers, more than the 2"):
        train(TINY, tmp_path / "x", init=tmp_path)
