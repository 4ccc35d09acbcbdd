"""The OpenAI wire format: request bodies in, response and chunk bodies out.

Requests parse with pydantic (unknown fields are ignored, as OpenAI-compatible servers
do); what this engine cannot honour is refused with a ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictInt, field_validator, model_validator

from .outputs import RequestOutput
from .sampling_params import MAX_STOP_TOKEN_IDS, MAX_STOPS, SamplingParams

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy
# fields that OpenAI clients send as null to mean "the default"
_NULL_IS_DEFAULT = {"n", "stream", "echo", "ignore_eos", "return_token_ids",
                    "include_stop_str_in_output", "min_tokens", "skip_special_tokens",
                    "add_generation_prompt", "continue_final_message"}
# vLLM's extensions this server lacks -> the value that asks for nothing (None: unset)
_NEUTRAL = {"min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0.0, "skip_special_tokens": True,
            "bad_words": None, "allowed_token_ids": None, "prompt_logprobs": None,
            "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None,
            "guided_choice": None, "guided_grammar": None, "structured_outputs": None,
            "logits_processors": None}

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(x) is int for x in value)


def _shape_error(field: str, expected: str) -> ValueError:
    return ValueError(f"{field} must be {expected}")


def _check_text(name: str, value: str) -> None:
    """Raise ValueError naming the field when ``value`` is not valid Unicode (JSON lets a
    lone surrogate through: "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode (a lone surrogate)") from None


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):  # OpenAI lets these be null: their defaults
            data = {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}
        return data

    @model_validator(mode="after")
    def _valid_text(self):
        for name, value in self.strings():
            _check_text(name, value)
        return self

    def strings(self) -> Iterator[tuple[str, str]]:
        """(field, text) of every string this server reads (token-id lists are not looked
        at: a prompt of millions of ids costs nothing here)."""
        if self.model is not None:
            yield "model", self.model
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        for i, stop in enumerate(stops):
            yield f"stop[{i}]", stop

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, lt=2**31)  # (beyond any context: refused)
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    # (the bound on the list alone: on the union it would count a string's characters)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    n: int = 1
    stream: bool = False
    echo: bool = False
    # OpenAI features this server does not have: refused when asked for
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    stream_options: StreamOptions | None = None
    # extensions, as in vLLM
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's extensions this server does not have (they would change the output): refused
    # unless left at the value that changes nothing
    min_tokens: int = 0
    repetition_penalty: FiniteFloat | None = None
    min_p: FiniteFloat | None = None
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None
    # a per-tenant salt of the prefix cache: the engine's prefix cache and lmkv are shared by
    # every client of this server (docs/engine.md "Security"), so it is refused, not ignored
    cache_salt: str | None = None
    # accepted for compatibility, refused unless left at values that change nothing
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    logit_bias: dict[str, Any] | None = None  # (refused when set: its values are not looked at)

    def check_supported(self) -> None:
        """Raise ValueError naming the first requested feature this server lacks."""
        if self.n != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.cache_salt is not None:
            raise ValueError("cache_salt is not supported: the prefix cache and lmkv's cache are "
                             "shared by every client of this server")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise ValueError("tools (function calling) are not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not "
                             "supported: this server returns plain text")
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value != neutral and not (neutral is None and value in ([], {})):
                raise ValueError(f"{name} is not supported by this server")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """SamplingParams from the fields set; ``max_tokens`` when the request has none."""
        temperature = self.temperature
        if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
            temperature = 0.0  # as vLLM does: dividing by it would overflow the logits
        given: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
        }
        given = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output, **given)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One pass over the prompt's items, one error: pydantic's own check of a union of
        list types reports every bad item once per alternative (an 8 MB body of nulls held
        the event loop for over a minute)."""
        if (isinstance(value, str) or _is_ids(value)
                or isinstance(value, list) and (all(isinstance(x, str) for x in value)
                                                or all(_is_ids(x) for x in value))):
            return value
        raise _shape_error("prompt", "a string, a list of token ids, or a list of strings or "
                           "of token-id lists")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.suffix:
            raise ValueError("suffix is not supported")

    def strings(self) -> Iterator[tuple[str, str]]:
        yield from super().strings()
        if isinstance(self.prompt, str):
            yield "prompt", self.prompt
        elif self.prompt and isinstance(self.prompt[0], str):
            for i, p in enumerate(self.prompt):
                yield f"prompt[{i}]", p
        if self.suffix:
            yield "suffix", self.suffix

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list of strings or of token-id lists
        (answered as the choice of that index)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"message content of type {part.type!r} is not supported")
            if part.text is None:
                raise ValueError("a message content part of type 'text' has no text")
            parts.append(part.text)
        return "\n".join(parts)  # (as vLLM joins them)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, lt=2**31)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's chat extensions: refused unless left at their defaults (the model's own
    # template, the assistant's turn opened after the messages)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_shape(cls, value: Any) -> Any:
        """One pass over the messages, one error (as for a completion's prompt)."""
        def ok(m: Any) -> bool:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return False
            content = m.get("content")
            return (content is None or isinstance(content, str) or isinstance(content, list)
                    and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                            and isinstance(p.get("text"), str | None) for p in content))

        if isinstance(value, list) and all(ok(m) for m in value):
            return value
        raise _shape_error("messages", "a list of objects, each with a string role and a "
                           "content that is a string, null, or a list of {type, text} parts")

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.logprobs or self.top_logprobs is not None:
            raise ValueError("logprobs is not supported")
        if not self.add_generation_prompt or self.continue_final_message:
            raise ValueError("add_generation_prompt false and continue_final_message are not "
                             "supported: the assistant's turn is opened after the messages")
        if self.chat_template or self.chat_template_kwargs:
            raise ValueError("chat_template and chat_template_kwargs are not supported: the "
                             "model's own template is used")

    def strings(self) -> Iterator[tuple[str, str]]:
        yield from super().strings()
        for i, m in enumerate(self.messages):
            yield f"messages[{i}].role", m.role
            if isinstance(m.content, str):
                yield f"messages[{i}].content", m.content
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.text is not None:
                    yield f"messages[{i}].content[{j}].text", part.text

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ------------------------------------------------------------------------
def usage(*outs: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage, over all of a request's prompts; its cached prompt tokens are those
    the engine's prefix cache served and those lmkv loaded (for a blended prompt, the
    reused ones: some of them recomputed)."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(out.num_output_tokens for out in outs)
    cached = sum(out.num_cached_tokens + out.num_external_tokens for out in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(
    rid: str, created: int, model: str, outs: list[RequestOutput], token_ids: bool
) -> dict[str, Any]:
    """One choice per prompt, at its index."""
    choices = []
    for i, out in enumerate(outs):
        choice: dict[str, Any] = {
            "index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
        }
        if token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.output_token_ids
        choices.append(choice)
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": usage(*outs),
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None,
    token_ids: list[int] | None, index: int = 0,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [choice],
    }


def chat_response(
    rid: str, created: int, model: str, out: RequestOutput, token_ids: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": None,
        "finish_reason": out.finish_reason,
    }
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [choice], "usage": usage(out),
    }
    if token_ids:
        choice["token_ids"] = out.output_token_ids
        body["prompt_token_ids"] = out.prompt_token_ids
    return body


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None,
    token_ids: list[int] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [choice],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, outs: list[RequestOutput]) -> dict:
    return {
        "id": rid, "object": obj, "created": created, "model": model, "choices": [],
        "usage": usage(*outs),
    }
