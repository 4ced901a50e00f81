"""The OpenAI API's request bodies as specjax serves them, checked, and its error shape.

Every body is read here: its size bounded, parsed as JSON (nesting bounded), typed field by
field (strictly: "5" is not an int, true is not a number) and ranged; whatever fails is an
`ApiError` with OpenAI's body `{"error": {"message", "type", "param", "code"}}` naming the
field (a structured-output constraint: `constraint`). Fields OpenAI or vLLM define that
specjax does not implement (context-free grammars, tools, beam search, ...) are refused by name unless they hold their
"off" value; fields that change nothing served (user, metadata, store, ...) are accepted;
any other field is refused by name, as OpenAI's server refuses an unrecognized argument:
nothing a client sends is dropped without a word.

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


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):  # OpenAI's
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):  # vLLM's
    model_config = ConfigDict(extra="forbid")
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    json_object: StrictBool | None = None
    grammar: StrictStr | None = None  # (a context-free grammar: refused by name, `constraint`)
    whitespace_pattern: StrictStr | None = None


class Sampling(BaseModel):
    """The fields completions and chat share (others are kept in `model_extra`, and refused
    by `refuse_unsupported` unless IGNORED)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # vLLM's extension; -1 and 0: off
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None  # vLLM's extension; 0: off
    # OpenAI's: token id (as a string, JSON's keys) -> bias in [-100, 100]; read by `logit_bias`
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None  # 0: off
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None  # 0: off
    repetition_penalty: Annotated[Number, Field(gt=0, le=1e6)] | None = None  # vLLM's extension; 1: off
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=16)] | None = None  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens whatever the model's EOS
    seed: Annotated[StrictInt, Field(ge=0, lt=2 ** 32)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    user: StrictStr | None = None
    # Structured output (`constraint`): OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_whitespace_pattern: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # `Sampling`'s, passed on by name
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=20)]


class CompletionRequest(Sampling):
    prompt: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1)]
    echo: StrictBool = False
    logprobs: TopLogprobs | None = None  # each token's, and this many likeliest (vLLM's bound: 20)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None  # with logprobs: this many likeliest per token


# fields of several types -> what they may be, said when none fits
UNIONS = {"prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
          "stop": "a string or a list of up to 16 strings"}

# Defined by OpenAI or vLLM, not implemented here: field -> the values a request may give it
# and still be served (absent, null, or the field's "off" value).
OFF = (None,)
UNSUPPORTED = {
    # OpenAI
    "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": OFF,
    "function_call": (None, "none"), "modalities": (None, ["text"]),
    "audio": OFF, "prediction": OFF, "reasoning_effort": OFF, "web_search_options": OFF,
    # vLLM's extensions
    "length_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0), "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
    "bad_words": (None, []), "allowed_token_ids": OFF, "prompt_logprobs": OFF, "truncate_prompt_tokens": OFF,
    "guided_grammar": OFF, "guided_decoding_backend": OFF,
    "logits_processors": OFF, "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "add_special_tokens": OFF, "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": OFF, "chat_template_kwargs": (None, {}), "documents": OFF,
    "return_tokens_as_token_ids": (None, False), "priority": (None, 0), "echo": (None, False),  # chat's echo
}
# Fields that change nothing this server computes or returns: accepted, whatever they hold.
IGNORED = {"metadata", "store", "service_tier", "parallel_tool_calls", "request_id"}


def constraint(body: Sampling) -> tuple[str, object, str | None, str] | None:
    """The body's structured-output constraint, or None: (kind "regex", "choice" or
    "json_schema", its spec (a pattern, a list, a schema), whitespace pattern or None, the
    field that gave it). More than one is an ApiError naming the second; a JSON schema
    given as text that is not a JSON object, and a context-free grammar, likewise."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("json_schema", {"type": "object"}, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
        found.append(("json_schema", rf.json_schema.schema_, "response_format"))
    so = body.structured_outputs or StructuredOutputs()
    if so.grammar is not None:
        raise ApiError(400, "structured_outputs.grammar (a context-free grammar) is not supported: specjax holds "
                            "finite automata on the device (a regex, a JSON schema, choices)",
                       param="structured_outputs", code="unsupported_parameter")
    for value, kind, param in ((body.guided_json, "json_schema", "guided_json"),
                               (body.guided_regex, "regex", "guided_regex"),
                               (body.guided_choice, "choice", "guided_choice"),
                               (so.json_, "json_schema", "structured_outputs"),
                               (so.regex, "regex", "structured_outputs"), (so.choice, "choice", "structured_outputs"),
                               ({"type": "object"} if so.json_object else None, "json_schema", "structured_outputs")):
        if value is not None:
            found.append((kind, value, param))
    if len(found) > 1:
        raise ApiError(400, f"{found[1][2]}: one structured-output constraint a request, and {found[0][2]} gives one",
                       param=found[1][2], code="invalid_value")
    if not found:
        return None
    kind, spec, param = found[0]
    if kind == "json_schema" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            spec = None
        if not isinstance(spec, dict):
            raise ApiError(400, f"{param}: a JSON schema must be a JSON object", param=param, code="invalid_value")
    return kind, spec, body.guided_whitespace_pattern or so.whitespace_pattern, param


def logit_bias(body: Sampling) -> dict[int, float]:
    """The body's logit_bias with its keys read as token ids (JSON's keys are strings: OpenAI's
    "50256"); a key that is no decimal integer is an ApiError naming it."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise ApiError(400, f"logit_bias: {shown(key)} is not a token id (a decimal integer)", param="logit_bias",
                           code="invalid_value")
        bias[int(key)] = float(value)
    return bias


def shown(value, most: int = 80) -> str:
    """A value as JSON for an error message; a long one is cut, saying so."""
    text = json.dumps(value, default=str)
    return text if len(text) <= most else f"{text[:most - 20]}... ({len(text)} characters)"


def refuse_unsupported(body: Sampling):
    given = body.model_extra or {}
    for name, value in given.items():
        if name in IGNORED:
            continue
        if name not in UNSUPPORTED:
            raise ApiError(400, f"unrecognized request field {name!r} (given {shown(value)})", param=name,
                           code="unknown_parameter")
        if not any(value == a and type(value) is type(a) for a in UNSUPPORTED[name]):
            raise ApiError(400, f"{name} is not supported by specjax's server (given {shown(value)})",
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
        given = shown(data.get(param) if param else data)
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
