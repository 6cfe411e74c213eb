"""The OpenAI request bodies the server accepts, and its errors in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`, the message naming the field).

Bodies are parsed strictly: a wrong type (`"n": "2"`, `"max_tokens": 1.5`), an unknown field or malformed
JSON is a 400 naming it, never coerced or ignored (a setting silently dropped would change what is measured).
Fields evalkit's engine cannot honour are accepted only at their neutral value (`presence_penalty: 0`).
Extensions, as vLLM spells them: `top_k`, `min_tokens`, `add_special_tokens`, `add_generation_prompt`,
`continue_final_message`; and evalkit's own `budget` (KV entries per layer and head for this request).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class ApiError(Exception):
    """An HTTP error with OpenAI's body."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class Common(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: Any = None  # a string or strings (`_stop`; a union's error would name its branches)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    user: str | None = None  # the caller's tag: not used
    # not supported: accepted at their neutral value only (`unsupported`)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    budget: int | None = None  # evalkit: KV entries per layer and head for this request (the method's own)
    top_k: int = Field(0, ge=-1)  # vLLM: 0 or -1 is off
    min_tokens: int = Field(0, ge=0)  # vLLM: EOS is suppressed until this many tokens

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str) or _strings(value):
            return value
        raise ValueError(f"stop must be a string or a list of strings (got {value!r})")


class CompletionBody(Common):
    prompt: Any  # a string, strings, token ids or lists of them (`prompts`): checked by hand for one message
    max_tokens: int | None = 16  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's default for completions (the tokenizer's BOS, where it adds one)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # a string, or text parts [{"type": "text", "text": ...}] (`_content`)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        if isinstance(value, str):
            return value
        parts = value if isinstance(value, list) else []
        text = [
            p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text" and len(p) == 2
        ]
        if parts and len(text) == len(parts) and _strings(text):
            return "".join(text)
        raise ValueError("content must be a string or a list of text parts ({'type': 'text', 'text': ...})")

    def text(self) -> str:
        return self.content


class ChatBody(Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # continue the last (assistant) message instead of a new turn


NEUTRAL = {  # field: (its neutral values, why evalkit has no other)
    "frequency_penalty": ((0, 0.0), "the engine samples as transformers does, without penalties"),
    "presence_penalty": ((0, 0.0), "the engine samples as transformers does, without penalties"),
    "logit_bias": ((None, {}), "the engine samples as transformers does, without logit biases"),
    "echo": ((False,), "the engine computes no prompt logprobs (run loglikelihood tasks in process)"),
    "suffix": ((None,), "the engine only continues a prompt"),
    "tools": ((None, []), "evalkit's server has no tool calling"),
    "tool_choice": ((None, "none"), "evalkit's server has no tool calling"),
}


def parse(cls: type[Common], raw: bytes) -> Common:
    """The body as `cls`, or an ApiError(400) naming the first bad field."""
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        raise _bad_body(cls, e.errors(include_url=False)[0]) from None
    for name, (neutral, why) in NEUTRAL.items():
        if name not in cls.model_fields:
            continue
        value = getattr(body, name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise ApiError(400, f"{name}={value!r} is not supported: {why}", name, "unsupported_parameter")
    if getattr(body, "best_of", None) not in (None, body.n):
        raise ApiError(400, "best_of is not supported (each choice is returned): leave it unset", "best_of")
    fmt = getattr(body, "response_format", None)
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: only {'type': 'text'} is supported", "response_format")
    return body


def _bad_body(cls, error: dict) -> ApiError:
    kind, loc = error["type"], ".".join(str(x) for x in error["loc"])
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {error['ctx']['error']}", None, "invalid_json")
    if kind == "model_type" and not loc:
        return ApiError(400, "the body must be a JSON object", None, "invalid_json")
    if kind == "missing":
        return ApiError(400, f"missing required field {loc!r}", loc, "missing_field")
    if kind == "extra_forbidden":
        fields = ", ".join(sorted(cls.model_fields))
        return ApiError(400, f"unknown field {loc!r}; this endpoint takes: {fields}", loc, "unknown_field")
    if kind == "value_error":  # our own validators' messages name the rule already
        return ApiError(400, str(error["ctx"]["error"]), loc, "invalid_value")
    got = error.get("input")
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    return ApiError(400, f"{loc}: {error['msg']} (got {shown})", loc, "invalid_value")


def prompts(value: Any) -> list[str | list[int]]:
    """The prompts of a completions body: a string or token ids, or a list of either (one choice set each)."""
    if isinstance(value, str) or _ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or _ids(p) for p in value):
        return value
    raise ApiError(
        400,
        "prompt must be a non-empty string, a list of token ids, or a non-empty list of either",
        "prompt",
    )


def _ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def stops(value: str | list[str] | None) -> list[str]:
    """The stop strings (empty ones dropped, as lm-eval's `until`)."""
    listed = [value] if isinstance(value, str) else value or []
    return [s for s in listed if s]
