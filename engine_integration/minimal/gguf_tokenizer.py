"""The byte-level BPE tokenizer a GGUF file describes in its ``tokenizer.*`` metadata
(vocabulary, merges, pre-tokenizer style, special tokens, BOS policy, chat template),
built with the ``tokenizers`` library to split text as the model's own tokenizer does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from .tokenizer import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4

# Llama 3's split (llama.cpp pre-tokenizer "llama-bpe"): case-insensitive contractions,
# words with one leading non-letter, digits in runs of up to 3, punctuation, newlines
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_STYLES = ("llama-bpe", "llama3", "llama-v3")
_GPT2_STYLES = ("default", "gpt2", "gpt-2")
_SMOLLM_STYLES = ("smollm",)  # GPT-2's split after every digit is isolated
PRE_TOKENIZER_STYLES = _LLAMA3_STYLES + _GPT2_STYLES + _SMOLLM_STYLES


def tokenizer_from_gguf(field: Callable[..., Any], where: str) -> Tokenizer:
    """Build the tokenizer from metadata; ``field(key, default)`` reads one key of the file
    named ``where``. Raises ValueError naming an unsupported tokenizer model or style."""
    kind = field("tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise ValueError(f"GGUF file {where} has tokenizer model {kind!r}; this engine reads "
                         "byte-level BPE tokenizers ('gpt2')")
    style = field("tokenizer.ggml.pre", "default")
    if style not in PRE_TOKENIZER_STYLES:
        raise ValueError(f"GGUF file {where} has pre-tokenizer {style!r}; this engine splits "
                         f"text as {', '.join(PRE_TOKENIZER_STYLES)}")
    tokens: list[str] = field("tokenizer.ggml.tokens", None, list)
    merges: list[str] = field("tokenizer.ggml.merges", None, list)
    if not tokens or merges is None:
        raise ValueError(f"GGUF file {where} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types: list[int] = field("tokenizer.ggml.token_type", None, list) or [1] * len(tokens)
    if not all(isinstance(t, str) for t in tokens) or len(types) != len(tokens) \
            or not all(isinstance(m, str) and " " in m for m in merges):
        raise ValueError(f"GGUF file {where}: tokenizer.ggml.tokens must be strings, "
                         "tokenizer.ggml.token_type one per token, and each of "
                         "tokenizer.ggml.merges two tokens joined by a space")

    def token_id(key: str) -> int | None:
        i = field(f"tokenizer.ggml.{key}_token_id", None, int)
        if i is not None and not 0 <= i < len(tokens):
            raise ValueError(f"GGUF file {where}: tokenizer.ggml.{key}_token_id {i} is not "
                             f"among its {len(tokens)} tokens")
        return i

    bos_id, eos_id = token_id("bos"), token_id("eos")
    stop_ids = tuple(i for i in (eos_id, token_id("eot"), token_id("eom")) if i is not None)
    template = field("tokenizer.chat_template", None, str)
    try:  # the library's own complaints (a merge of tokens not in the vocabulary, ...)
        tok = HFTokenizer(models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            ignore_merges=style in _LLAMA3_STYLES,  # as Llama 3's own tokenizer.json
        ))
        tok.pre_tokenizer = _pre_tokenizer(style)
        tok.decoder = decoders.ByteLevel()
        # control tokens (<|im_start|>) are matched whole and dropped when decoding;
        # user-defined ones are matched whole and kept
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
        bos = tokens[bos_id] if bos_id is not None else ""
        eos = tokens[eos_id] if eos_id is not None else ""
        if field("tokenizer.ggml.add_bos_token", False) and bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)])
    except Exception as e:
        raise ValueError(f"GGUF file {where}: its tokenizer cannot be built: {e}") from e
    return Tokenizer(tok, template, bos, eos, stop_ids)


def _pre_tokenizer(style: str):
    if style in _LLAMA3_STYLES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style in _SMOLLM_STYLES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
