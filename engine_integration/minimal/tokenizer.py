"""The model's tokenizer (``tokenizer.json``) and chat template."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

# Used when the checkpoint ships no chat template.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        extra = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str = extra.get("chat_template") or FALLBACK_CHAT_TEMPLATE
        self.bos_token: str = _token_text(extra.get("bos_token")) or ""
        self.eos_token: str = _token_text(extra.get("eos_token")) or ""
        eos = set(eos_token_ids)
        if self.eos_token and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
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
