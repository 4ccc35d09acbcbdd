"""The pieces of streaming and of the command line that need no server."""

from __future__ import annotations

import argparse
import re

import pytest

from lmkv.sizes import size as parse_size
from lmkv_engines.minimal.outputs import hold_back


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        ("hello wor", ("world",), "hello "),  # "wor" may become "world"
        ("hello w", ("world", "wx"), "hello "),
        ("hello", ("world",), "hello"),
        ("hello", (), "hello"),
        ("abab", ("abc",), "ab"),  # the longest tail that is a prefix: "ab"
        ("end.", (".",), "end."),  # a complete stop is the engine's to cut, not held
        ("", ("x",), ""),
        ("caf\ufffd", (), "caf"),  # "é" half decoded: held until its second byte arrives
        ("a\ufffd\ufffd", ("b",), "a"),
        ("\ufffdx", (), "\ufffdx"),  # an invalid byte inside the text stays as decoded
    ],
)
def test_hold_back_keeps_only_text_that_cannot_start_a_stop(text, stops, want):
    assert hold_back(text, stops) == want


def test_hold_back_is_the_longest_tail_that_starts_a_stop_string():
    """Against the definition, on random texts and stop strings over a small alphabet."""
    import random

    rng = random.Random(0)

    def naive(text, stops):
        text = text.rstrip("\ufffd")
        tails = [k for stop in stops for k in range(1, min(len(stop) - 1, len(text)) + 1)
                 if text.endswith(stop[:k])]
        return text[: len(text) - max(tails, default=0)]

    for _ in range(3000):
        word = lambda n: "".join(rng.choice("abc") for _ in range(n))  # noqa: E731
        text = word(rng.randrange(0, 12))
        stops = tuple(word(rng.randrange(1, 8)) for _ in range(rng.randrange(0, 4)))
        assert hold_back(text, stops) == naive(text, stops), (text, stops)


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4GB") == 4 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "lots", "2 parsecs", "-1GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def _byte_fallback_tokenizer():
    """A small SentencePiece-style tokenizer as Llama 2's tokenizer.json has it: BPE with
    byte fallback ("<0xE6>" tokens for what the vocabulary lacks), "▁" for spaces."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    from lmkv_engines.minimal.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "é", "▁é", "東", "京", "▁東"]:
        vocab[word] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é"), ("▁", "東")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(tok, None, "<s>", "</s>", (2,))


def _tokenizer(which: str, tiny_model_dir):
    if which == "byte-fallback":
        return _byte_fallback_tokenizer()
    if which == "smollm2":
        from lmkv_engines.minimal.default_model import resolve_model
        from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint

        try:
            return GGUFCheckpoint(resolve_model(None)).tokenizer()
        except (FileNotFoundError, ImportError, ValueError) as e:
            pytest.skip(f"SmolLM2 is not installed: {e}")
    from lmkv_engines.minimal.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model_dir)


def _outputs(tok, ids: list[int], kind, stop: tuple[str, ...], prompt: tuple[int, ...] = (1,)):
    """The outputs the engine gives for a request (of ``prompt``) that generates ``ids`` (or
    fewer: a stop)."""
    from lmkv_engines.minimal.llm_engine import LLMEngine
    from lmkv_engines.minimal.request import Request, RequestStatus
    from lmkv_engines.minimal.sampling_params import OutputKind, SamplingParams

    engine = LLMEngine.__new__(LLMEngine)  # only the tokenizer and the context length are used
    engine.tokenizer, engine.max_model_len = tok, 10_000
    req = Request("r", list(prompt), SamplingParams(max_tokens=len(ids), stop=stop, ignore_eos=True,
                                                    output_kind=kind))
    outs = []
    for token in ids:
        req.output_token_ids.append(token)
        reason = engine._check_stop(req, token)
        if reason is not None:
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if reason is not None or kind is not OutputKind.FINAL_ONLY:
            outs.append(engine._output(req))
        if reason is not None:
            return outs
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("which", ["demo", "smollm2", "byte-fallback"])
@pytest.mark.parametrize("stop", [(), ("naï",), ("é 😀 東 no", "京 —"), ("café",)])
def test_delta_outputs_add_up_to_the_final_text(which, stop, tiny_model_dir):
    """A streamed request's outputs hold only what is new (OutputKind.DELTA: O(new tokens)
    per step): their texts add up to the final text of a cumulative run (characters whose
    bytes span tokens, "東" of SmolLM2's byte-level BPE for one, are sent whole, never as
    U+FFFD; a stop string is never sent, nor any part of one), their token ids to all token
    ids; FINAL_ONLY gives one output, the same as the cumulative run's last."""
    from lmkv_engines.minimal.sampling_params import OutputKind

    tok = _tokenizer(which, tiny_model_dir)
    ids = tok.encode("Paris é 😀 東京 — naïve café, and more", add_special_tokens=False)
    cumulative = _outputs(tok, ids, OutputKind.CUMULATIVE, stop)
    final = cumulative[-1]
    assert final.finished and all(s not in final.text for s in stop)
    deltas = _outputs(tok, ids, OutputKind.DELTA, stop)
    assert len(deltas) == len(cumulative)
    assert "".join(d.text for d in deltas) == final.text
    assert not any("\ufffd" in d.text for d in deltas)
    assert [t for d in deltas for t in d.output_token_ids] == final.output_token_ids
    assert [d.num_output_tokens for d in deltas] == [len(c.output_token_ids) for c in cumulative]
    sent = ""
    for d, c in zip(deltas, cumulative, strict=True):  # never ahead of the cumulative text
        sent += d.text
        assert c.text.startswith(sent)
    (only,) = _outputs(tok, ids, OutputKind.FINAL_ONLY, stop)
    assert (only.text, only.output_token_ids, only.finish_reason) == (
        final.text, final.output_token_ids, final.finish_reason)


@pytest.mark.parametrize("which", ["demo", "smollm2"])
def test_incremental_detokenization_is_the_whole_decode(which, tiny_model_dir):
    """The engine decodes a few tokens per new token (llm_engine._new_text): after every
    token its text is the whole output decoded at once, less a trailing incomplete
    character, over random tokens (multi-byte characters split over tokens, leading spaces,
    special tokens) and over real text (byte-level BPE tokenizers)."""
    import random

    from lmkv_engines.minimal.llm_engine import LLMEngine
    from lmkv_engines.minimal.request import Request
    from lmkv_engines.minimal.sampling_params import SamplingParams

    tok = _tokenizer(which, tiny_model_dir)
    engine = LLMEngine.__new__(LLMEngine)  # only the tokenizer is used
    engine.tokenizer = tok
    rng = random.Random(1)
    texts = ["Paris é 😀 東京 — naïve café", "  two  spaces\nnew line\ttab", "x" * 40]
    sequences = [tok.encode(t, add_special_tokens=False) for t in texts]
    sequences += [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(20)]
    for ids in sequences:
        req = Request("r", [1], SamplingParams())
        for token in ids:
            req.output_token_ids.append(token)
            req.output_text += engine._new_text(req)
            whole = tok.decode(req.output_token_ids)
            assert req.output_text == whole.rstrip("\ufffd"), (ids, req.output_text, whole)


def test_streamed_text_waits_for_the_end_of_a_byte_fallback_run():
    """With a byte-fallback tokenizer a byte run's text changes when a byte that makes it
    invalid UTF-8 arrives ("<0x7F>" decodes to DEL, then "<0x7F><0x81>" to two U+FFFD), so
    the incremental text holds a trailing run back: after every token it is a prefix of the
    whole decode, and once a token that is not a byte follows, equal to it. Special tokens
    (skipped by decoding: the bytes around one are one run) do not end a run, and a stop
    string in a held run stops the request at the token that completes it."""
    import random

    from lmkv_engines.minimal.llm_engine import LLMEngine
    from lmkv_engines.minimal.request import Request
    from lmkv_engines.minimal.sampling_params import SamplingParams

    tok = _byte_fallback_tokenizer()
    assert len(tok.byte_fallback_ids) == 256 + 3
    engine = LLMEngine.__new__(LLMEngine)  # only the tokenizer (and the context) is used
    engine.tokenizer, engine.max_model_len = tok, 10_000
    rng = random.Random(0)
    words, last = range(259, tok.vocab_size), tok.encode("c", add_special_tokens=False)[-1]
    # ASCII and high bytes, words, special tokens
    pools = [range(3, 3 + 128), range(3 + 128, 3 + 256), words, range(3)]
    for _ in range(500):
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 12))] + [last]
        req = Request("r", [1], SamplingParams())
        for k, token in enumerate(ids):
            req.output_token_ids.append(token)
            req.output_text += engine._new_text(req)
            assert tok.decode(ids[: k + 1]).startswith(req.output_text), ids
        assert req.output_text == tok.decode(ids), ids

    stop = "。"  # three bytes in this vocabulary, then a long run of others
    ids = [3 + b for b in "日本。".encode()] + [3 + 0xE3] * 100
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), stop=(stop,), ignore_eos=True))
    for token in ids:
        req.output_token_ids.append(token)
        if engine._check_stop(req, token) is not None:
            break
    assert len(req.output_token_ids) == len("日本。".encode()) and req.output_text == "日本"


def test_a_stop_string_ends_at_the_token_that_completes_it_when_that_token_starts_a_character(
        tiny_model_dir):
    """SmolLM2 has tokens that are a space and the first byte of a multi-byte character: a
    stop string ending in that space stops the request at that token, as decoding the
    whole output would, not a token later or never."""
    from lmkv_engines.minimal.default_model import resolve_model
    from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint
    from lmkv_engines.minimal.llm_engine import LLMEngine
    from lmkv_engines.minimal.request import Request
    from lmkv_engines.minimal.sampling_params import SamplingParams

    try:
        tok = GGUFCheckpoint(resolve_model(None)).tokenizer()
    except (FileNotFoundError, ImportError, ValueError) as e:
        pytest.skip(f"SmolLM2 is not installed: {e}")
    lead = next(i for i in range(tok.vocab_size) if tok.decode([i]) == " \ufffd")
    engine = LLMEngine.__new__(LLMEngine)
    engine.tokenizer, engine.max_model_len = tok, 1000
    ids = [*tok.encode("Answer: yes", add_special_tokens=False), lead]
    for max_tokens in (len(ids), 50):  # the stop token is also the last allowed, or not
        req = Request("r", [1], SamplingParams(stop=("yes ",), max_tokens=max_tokens))
        reasons = []
        for token in ids:
            req.output_token_ids.append(token)
            reasons.append(engine._check_stop(req, token))
        assert reasons[:-1] == [None] * (len(ids) - 1) and reasons[-1] is not None
        assert reasons[-1].value == "stop" and req.output_text == "Answer: "


@pytest.mark.parametrize("which", ["demo", "smollm2"])
def test_an_output_cut_inside_a_character_ends_before_it(which, tiny_model_dir):
    """max_tokens reached between the tokens of one character ("東", "😀" in byte-level
    BPE): the final text leaves the incomplete character out (it ended in U+FFFD, streamed
    and not, where vLLM leaves it out), and the streamed deltas still add up to it."""
    from lmkv_engines.minimal.sampling_params import OutputKind

    tok = _tokenizer(which, tiny_model_dir)
    cut = None
    for text in ("Tokyo 東京", "smile 😀"):
        ids = tok.encode(text, add_special_tokens=False)
        for n in range(1, len(ids)):
            if tok.decode(ids[:n]).endswith("\ufffd"):
                cut = ids[:n]
                break
        if cut:
            break
    if cut is None:
        pytest.skip(f"the {which} tokenizer keeps these characters in one token")
    final = _outputs(tok, cut, OutputKind.CUMULATIVE, ())[-1]
    assert not final.text.endswith("\ufffd") and tok.decode(cut).startswith(final.text)
    deltas = _outputs(tok, cut, OutputKind.DELTA, ())
    assert "".join(d.text for d in deltas) == final.text


def test_a_completion_keeps_the_leading_space_of_its_first_token():
    """Review: with a SentencePiece-style decoder (Llama 2's, Mistral's, TinyLlama's
    tokenizer.json: decoders.Strip(" ", 1, 0)) the output alone decodes without its first
    token's "▁": prompt "b c" and output "▁ab ▁a" must read " ab a" (what decoding the
    prompt and output together adds, as vLLM's detokenizer gives it), so that prompt +
    completion is the text, and a stop string with a leading space can match."""
    from lmkv_engines.minimal.sampling_params import OutputKind

    tok = _byte_fallback_tokenizer()
    prompt = tok.encode("b c", add_special_tokens=False)
    output = tok.encode("ab a", add_special_tokens=False)  # ["▁ab", "▁a"]
    want = tok.decode(prompt + output)[len(tok.decode(prompt)):]
    assert want == " ab a"
    for kind in (OutputKind.FINAL_ONLY, OutputKind.DELTA):
        texts = [o.text for o in _outputs(tok, output, kind, (), tuple(prompt))]
        assert "".join(texts) == want, (kind, texts)


def test_a_chat_may_hold_special_tokens_that_mark_no_turn(tiny_model_dir):
    """From a review: SmolLM2's special tokens include <filename>, <reponame>, <gh_stars>...
    and a chat message holding any of them ("how do I run `cat <filename>`") was refused;
    only what the chat template gives a meaning (turn markers, BOS, EOS) is."""
    from types import SimpleNamespace

    from lmkv_engines.minimal.api_server import APIServer

    tok = _tokenizer("smollm2", tiny_model_dir)
    assert "<filename>" in tok.special_tokens
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok.control_tokens)
    assert "<filename>" not in tok.control_tokens
    fake = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, tokenize=tok.encode),
                           _check_chars=lambda chars: None)
    ids = APIServer._chat_prompt(fake, [{"role": "user", "content": "how do I run cat <filename>"}])
    assert tok.encode("<filename>", add_special_tokens=False)[0] in ids  # (as vLLM reads it)
    with pytest.raises(ValueError, match=re.escape("special token '<|im_end|>'")):
        APIServer._chat_prompt(fake, [{"role": "user", "content": "hi<|im_end|>"}])
