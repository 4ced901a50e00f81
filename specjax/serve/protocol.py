"""The OpenAI API's request bodies as specjax serves them, checked, and its error shape.

Every body is read here: its size bounded, parsed as JSON (nesting bounded), typed field by
field (strictly: "5" is not an int, true is not a number) and ranged; whatever fails is an
`ApiError` with OpenAI's body `{"error": {"message", "type", "param", "code"}}` naming the
field. Fields OpenAI defines that specjax does not implement (logprobs, penalties, logit
bias, suffix, tools, ...) are refused by name rather than ignored; unknown fields are
ignored, as OpenAI's server does.

It knows pydantic and JSON; nothing of engines, tokenizers or HTTP frameworks.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

MAX_DEPTH = 64  # JSON bodies nest no deeper than this (OpenAI's nest a few levels)


class ApiError(Exception):
    """A request the server refuses: HTTP status, and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


Number = StrictFloat | StrictInt
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # vLLM's extension; -1 and 0: off
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=16)] | None = None  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model's EOS
    seed: Annotated[StrictInt, Field(ge=0, lt=2 ** 32)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    user: StrictStr | None = None
    # Defined by OpenAI, not implemented here: refused by name (`refuse_unsupported`).
    logprobs: object = None
    top_logprobs: object = None
    logit_bias: object = None
    presence_penalty: object = None
    frequency_penalty: object = None
    best_of: object = None
    suffix: object = None
    tools: object = None
    tool_choice: object = None
    response_format: object = None


class CompletionRequest(Sampling):
    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1)]
    echo: StrictBool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


# fields of several types -> what they may be, said when none fits
UNIONS = {"prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
          "stop": "a string or a list of up to 16 strings"}

# field -> what a request may give it and still be served (None, or OpenAI's "off" value)
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"})}


def refuse_unsupported(body: Sampling):
    for name, allowed in UNSUPPORTED.items():
        value = getattr(body, name)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ApiError(400, f"{name} is not supported by specjax's server (given {json.dumps(value)[:80]})",
                           param=name, code="unsupported_parameter")


def _depth(text: str) -> int:
    """The deepest nesting of brackets in a JSON text, outside strings."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """A body's bytes as `model`, or an ApiError saying what is wrong and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text") from None
    if _depth(text) > MAX_DEPTH:
        raise ApiError(400, f"the body's JSON nests deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        given = json.dumps(data.get(param) if param else data, default=str)[:80]
        if errors[0]["type"] == "missing":
            message = f"{'.'.join(str(p) for p in errors[0]['loc'])} is required"
        elif param in UNIONS:  # one error per alternative: say what the field may be instead
            message = f"{param} must be {UNIONS[param]}"
        else:
            where = ".".join(str(p) for p in errors[0]["loc"])
            message = f"{where}: {errors[0]['msg']}"
        raise ApiError(400, f"{message} (given {given})", param=param, code="invalid_value") from None
    if isinstance(body, Sampling):
        refuse_unsupported(body)
    return body
