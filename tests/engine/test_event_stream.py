"""The pieces of streaming and of the command line that need no server."""

from __future__ import annotations

import argparse

import pytest

from lmkv_engines.minimal.cli import parse_size
from lmkv_engines.minimal.event_stream import hold_back


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


def test_a_stream_sends_every_character_when_one_spans_tokens():
    """Decoded text ends in U+FFFD while a character's bytes span tokens ("東" of SmolLM2's
    byte-level BPE, for one): the stream holds it back, so the later text still continues
    what was sent and the deltas add up to the whole text (they used to stop at the first
    such character)."""
    import asyncio
    import json
    from types import SimpleNamespace

    from lmkv_engines.minimal.api_server import APIServer
    from lmkv_engines.minimal.outputs import RequestOutput

    texts = ["Paris é", "Paris é 😀 \ufffd", "Paris é 😀 東", "Paris é 😀 東\ufffd", "Paris é 😀 東京"]
    outs = [RequestOutput("r", [1], list(range(i + 1)), t, i == len(texts) - 1,
                          "stop" if i == len(texts) - 1 else None) for i, t in enumerate(texts)]

    async def rest():
        for out in outs[1:]:
            yield out

    async def collect():
        server = SimpleNamespace(model_name="m")
        body = SimpleNamespace(return_token_ids=False, include_usage=False)
        return [e async for e in APIServer._events(server, "r", 0, body, (), outs[0], rest(), False)]

    events = [e for e in asyncio.run(collect()) if e.strip() != "data: [DONE]"]
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events]
    assert "".join(deltas) == texts[-1] and not any("\ufffd" in d for d in deltas)


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

    if which == "smollm2":
        from lmkv_engines.minimal.default_model import resolve_model
        from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint

        try:
            tok = GGUFCheckpoint(resolve_model(None)).tokenizer()
        except (FileNotFoundError, ImportError, ValueError) as e:
            pytest.skip(f"SmolLM2 is not installed: {e}")
    else:
        from lmkv_engines.minimal.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(tiny_model_dir)
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
