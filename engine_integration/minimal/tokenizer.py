"""The model's tokenizer and chat template, from a ``tokenizer.json`` directory or built by a
loader (gguf_tokenizer.py); chat templates render as Hugging Face transformers renders them."""

from __future__ import annotations

import datetime
import functools
import json
import logging
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# Used when the checkpoint ships no chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None = None,
                 bos_token: str = "", eos_token: str = "", eos_token_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        self.chat_template: str = chat_template or FALLBACK_CHAT_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos = set(eos_token_ids)
        if eos_token and (tid := tokenizer.token_to_id(eos_token)) is not None:
            eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_dir(cls, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no tokenizer.json")
        extra = _read_json(model_dir / "tokenizer_config.json")
        return cls(HFTokenizer.from_file(str(path)), extra.get("chat_template"),
                   _token_text(extra.get("bos_token")) or "",
                   _token_text(extra.get("eos_token")) or "", eos_token_ids)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """With a decoder that falls back to bytes (SentencePiece style, Llama 2's): the ids
        of byte tokens ("<0xE6>"), and of the special tokens that decoding skips (the bytes
        on both sides of one decode as one run). A run of them decodes to text that the next
        byte token can change (a byte run that is not valid UTF-8 becomes one U+FFFD per
        byte, the valid ones before it included), so streamed text waits for the run's end.
        Empty for other decoders."""
        if '"ByteFallback"' not in self._tok.to_str():
            return frozenset()
        held = {i for t, i in self._tok.get_vocab(with_added_tokens=False).items()
                if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t)}
        held.update(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return frozenset(held)

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The texts of the special tokens (a chat template's turn markers among them):
        text that holds one is tokenized to that control token."""
        return tuple(sorted(t.content for t in self._tok.get_added_tokens_decoder().values()
                            if t.special and t.content))

    @functools.cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The special tokens a chat prompt gives a meaning: those the chat template writes
        (in its text, or in what it renders for a conversation of each role: turn markers
        made from a role's name), BOS and EOS. Others (SmolLM2's ``<filename>``) are only
        rare tokens to a chat."""
        seen = [self.chat_template, self.bos_token, self.eos_token]
        for roles in (("system", "user", "assistant", "user"), ("user", "assistant", "user")):
            try:  # (some templates refuse a system message, or one not alternating)
                seen.append(self.apply_chat_template([{"role": r, "content": "x"} for r in roles]))
            except ValueError:
                continue
        text = "\n".join(seen)
        return tuple(t for t in self.special_tokens if t in text)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string's length: a byte
        of byte-level BPE is one character there): a text of n characters is at least
        n / max_token_chars tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened, rendered in
        the sandboxed Jinja environment transformers uses (blocks trimmed, loop controls,
        ``raise_exception``, ``tojson``, ``strftime_now``). A template that fails on them
        (any error inside it) is a ValueError."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as e:  # the template is the model's, its errors the request's
            raise ValueError(f"chat template failed on these messages: {e}") from e


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return {}


def _token_text(tok: str | dict | None) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
