"""The OpenAI-compatible HTTP API on an `Engine`: FastAPI routes, their errors and streams.

    POST /v1/completions        prompt: a string, token ids, or a list of either (one choice
                                each, times n); echo; stream (server-sent events)
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models, /health, /metrics (Prometheus text)

Every refusal is a 4xx with OpenAI's error body, raised before anything is submitted: bodies
are read with a size bound and checked field by field (protocol.py); prompts longer than the
server's context, token ids outside the vocabulary and unknown models are named. Past
`max_queue` waiting choices a request is refused at once with 503 and Retry-After. A
client that disconnects cancels its choices (streaming or not); an engine failure fails the
requests it touched with a 500 and the server goes on. `api_key`: every /v1 route wants
`Authorization: Bearer KEY` (compared in constant time).

No request field reaches the file system or loads anything: the models, tokenizer and
template are the server's, fixed at start. It knows HTTP and OpenAI's shapes; nothing of
JAX (the engine computes; generation.py bridges its thread to the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
import uuid

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specjax.models import check_token_ids
from specjax.sampling import check_logit_bias
from specjax.serve.generation import EngineFailure, Generation, Settings
from specjax.serve.metrics import Metrics
from specjax.serve.protocol import (PENALTIES, ApiError, ChatRequest, CompletionRequest, constraint, logit_bias,
                                    parse)
from specjax.serve.structured import Constraints
from specjax.text import encode_prompts

MAX_BODY = 1 << 20  # bytes of a request body (a 1,024-token prompt of ids is ~6 KB)
DISCONNECT_POLL = 0.25  # seconds between checks that a waiting (non-streaming) client is still there


class Server:
    """What the routes share: the engine (started and stopped by whoever made it, or by the
    app's lifespan when `owns_engine`), the tokenizer, and the server's limits."""

    def __init__(self, engine, tokenizer, model_name: str, *, max_model_len: int | None = None,
                 api_key: str | None = None, max_queue: int | None = None, stop_ids=(), max_body: int = MAX_BODY):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len = int(max_model_len or engine.max_len)
        if self.max_model_len > engine.max_len:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the engine's max_len ({engine.max_len})")
        self.api_key = api_key
        self.max_queue = 4 * engine.slots if max_queue is None else int(max_queue)
        self.stop_ids = tuple(stop_ids or ())
        self.max_body = max_body
        self.vocab_size = engine.target.config.vocab_size
        self.constraints = Constraints(tokenizer, self.vocab_size, self.stop_ids[0] if self.stop_ids else None,
                                       engine.limits.grammar)
        self.metrics = Metrics(engine, model_name)
        self.created = int(time.time())

    # ---- checks -------------------------------------------------------------------------

    def check_auth(self, request: Request):
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def read(self, request: Request, kind):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"the body has {length} bytes; the server takes up to {self.max_body}")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body:
                raise ApiError(413, f"the body exceeds {self.max_body} bytes")
        return parse(bytes(raw), kind)

    def settings(self, body, prompt_lens: list[int], default_max: int | None) -> Settings:
        longest = max(prompt_lens)
        if longest >= self.max_model_len:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {longest}", param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        max_tokens = body.max_tokens
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = default_max or self.max_model_len - longest
        if longest + max_tokens > self.max_model_len:
            raise ApiError(400, f"this model's maximum context length is {self.max_model_len} tokens; {longest} in "
                                f"the prompt and max_tokens={max_tokens} exceed it", param="max_tokens",
                           code="context_length_exceeded")
        stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        extra = tuple(body.stop_token_ids or ())
        for i in extra:
            if not 0 <= i < self.vocab_size:
                raise ApiError(400, f"stop_token_ids: {i} is outside the vocabulary [0, {self.vocab_size})",
                               param="stop_token_ids")
        stop_ids = tuple(dict.fromkeys(extra + (() if body.ignore_eos else self.stop_ids)))
        width = self.engine.programs.stop_width
        if len(stop_ids) > width:
            raise ApiError(400, f"{len(stop_ids)} stop ids (the model's EOS included); this server takes {width}",
                           param="stop_token_ids")
        top_k = body.top_k or 0
        try:  # (the engine's own check, named as the field)
            bias = check_logit_bias(logit_bias(body), self.vocab_size, self.engine.limits.bias_width)
        except ValueError as e:
            raise ApiError(400, str(e), param="logit_bias", code="invalid_value") from None
        return Settings(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else float(body.temperature),
                        logprobs=self._logprobs(body),
                        top_k=0 if top_k < 0 else top_k, top_p=1.0 if body.top_p is None else float(body.top_p),
                        min_p=float(body.min_p or 0.0), logit_bias=bias, stop_ids=stop_ids, stop=stop, seed=body.seed,
                        penalties={name: float(getattr(body, name)) for name in PENALTIES
                                   if getattr(body, name) is not None})

    def _logprobs(self, body) -> int | None:
        """The top alternatives each token's logprobs list (None: no logprobs), checked against
        what the engine scores (`Engine(max_logprobs=...)`)."""
        if isinstance(body, ChatRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
            n, param = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
        else:
            n, param = body.logprobs, "logprobs"
        most = self.engine.limits.logprobs
        if n is not None and (most is None or n > most):
            raise ApiError(400, f"{param}={n}: this server lists up to {most} alternatives (--max-logprobs)"
                           if most is not None else "this server scores no tokens (started with --no-logprobs)",
                           param=param, code="invalid_value")
        return n

    def admit(self, choices: int):
        """Refuses at once what neither a slot nor the queue has room for (a request waits in
        the engine's queue until the device thread gives it a slot: a burst counts as waiting)."""
        running, waiting = self.engine.load()
        if running + waiting + choices > self.engine.slots + self.max_queue:
            raise ApiError(503, f"the server is at capacity ({running} running, {waiting} waiting, queue of "
                                f"{self.max_queue}): retry later", code="server_overloaded",
                           headers={"Retry-After": "1"})

    # ---- prompts ------------------------------------------------------------------------

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            return encode_prompts(self.tokenizer, texts)
        rows = [prompt] if not prompt or isinstance(prompt[0], int) else prompt
        for row in rows:
            if not row:
                raise ApiError(400, "prompt: a list of token ids must not be empty", param="prompt")
            try:
                check_token_ids(np.asarray(row, np.int64), self.vocab_size)
            except ValueError as e:
                raise ApiError(400, f"prompt: {e}", param="prompt") from None
        return [list(row) for row in rows]

    def completion_prompts_and_echoes(self, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """(`completion_prompts`, each prompt's text to echo: "" unless body.echo)."""
        prompts = self.completion_prompts(body)
        return prompts, [self.tokenizer.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"the model {self.model_name!r} has no chat template (its tokenizer_config.json or "
                                f"chat_template.jinja): use /v1/completions", param="messages",
                           code="chat_template_missing")
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages.{i}.content: only text parts are supported, got "
                                            f"{json.dumps(part)[:80]}", param="messages")
                    parts.append(part["text"])
                content = "".join(parts)
            messages.append({"role": m.role, "content": content or ""})
        try:  # the template is the checkpoint's, sandboxed by transformers; it may refuse a conversation
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        except Exception as e:  # noqa: BLE001 -- jinja2's errors, or what the template raises
            raise ApiError(400, f"the chat template refuses these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        return list(ids) or [self.tokenizer.bos_token_id or 0]


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(server: Server, owns_engine: bool = False) -> FastAPI:
    """The FastAPI app of `server`. owns_engine: the app's lifespan starts the engine and, at
    shutdown (after uvicorn has let in-flight requests finish, bounded), cancels what is left
    and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if owns_engine:
            server.engine.start()
        try:
            yield
        finally:
            server.constraints.close()
            if owns_engine:
                server.engine.cancel_all()
                await asyncio.to_thread(server.engine.close)

    app = FastAPI(title="specjax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return _error_response(ApiError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    # A dependency of every /v1 route, not a middleware: Starlette's middleware wraps `receive`
    # and hides a client's disconnect from the route.
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.check_auth)])

    @app.get("/health")
    async def health():
        engine = server.engine
        if not engine.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if engine.warming:  # it serves; programs are still compiling in the background
            stats = engine.stats()
            return JSONResponse({"status": "warming", "compiling": stats["compiling"],
                                 "programs_compiling": stats["programs_compiling"]})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "specjax", "max_model_len": server.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = await server.read(request, CompletionRequest)
        server.check_model(body.model)
        # Tokenizing (and decoding an echo) runs beside the event loop: a large body stalls no stream.
        prompts, echoes = await asyncio.to_thread(server.completion_prompts_and_echoes, body)
        settings = server.settings(body, [len(p) for p in prompts], default_max=16)
        settings.grammar = await _grammar(server, body)
        score = settings.logprobs if body.echo else None  # the prompts' own, scored once admitted
        return await _respond(server, request, body, prompts, settings, chat=False, echoes=echoes, score=score)

    @v1.post("/chat/completions")
    async def chat(request: Request):
        body = await server.read(request, ChatRequest)
        server.check_model(body.model)
        prompt = await asyncio.to_thread(server.chat_prompt, body)  # its template and tokenizer, beside the loop
        settings = server.settings(body, [len(prompt)], default_max=None)
        settings.grammar = await _grammar(server, body)
        return await _respond(server, request, body, [prompt], settings, chat=True, echoes=[""])

    app.include_router(v1)
    return app


async def _grammar(server: Server, body):
    """The body's structured-output grammar (None: none), compiled beside the event loop."""
    found = constraint(body)
    if found is not None and body.ignore_eos:
        raise ApiError(400, "ignore_eos: a constrained reply ends at EOS once complete", param="ignore_eos")
    return None if found is None else await server.constraints.grammar(found)


async def _echoed_logprobs(server: Server, prompts: list, echoes: list, top: int) -> list[tuple[str, dict]]:
    """Each echoed prompt's (text, completions' logprobs of its tokens): none for the first,
    which nothing predicts (OpenAI's and vLLM's null), then each token's given those before
    it and the `top` likeliest there, scored by the engine's thread in its turn
    (`Engine.score`: one pass at a time, its memory counted beside the state)."""
    out = []
    for prompt, text in zip(prompts, echoes):
        try:
            chosen, top_ids, top_lp = await asyncio.wrap_future(server.engine.score(prompt, top))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:  # the engine is not running, or the pass failed
            raise ApiError(503, str(e), headers={"Retry-After": "1"}) from None
        scores = [(float(x), [(int(i), float(y)) for i, y in zip(ids, lps)])
                  for x, ids, lps in zip(chosen[1:], top_ids[1:], top_lp[1:])]
        out.append((text, _completion_logprobs(server.tokenizer, list(zip(prompt, [(None, None)] + scores)), 0)[0]))
    return out


def _echo(echoes: list, c, n: int) -> tuple[str, dict | None]:
    """A choice's echo: its prompt's text and, where the prompt was scored (`_echoed_logprobs`),
    its logprobs, the choice's own text offsets moved past them."""
    echo = echoes[c.index // n]
    if isinstance(echo, str):
        return echo, None
    text, scored = echo
    c.offset = sum(len(t) for t in scored["tokens"])
    return text, scored


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Completions' logprobs of an echo, then of the tokens after it."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in first}


async def _respond(server: Server, request: Request, body, prompts, settings: Settings, chat: bool, echoes,
                   score: int | None = None):
    """The response to one request, once admitted (`Server.admit`: 503 at capacity); score:
    its echoed prompts' logprobs with this many alternatives (None: none) first."""
    server.admit(len(prompts) * body.n)
    if score is not None:
        echoes = await _echoed_logprobs(server, prompts, echoes, score)
    generation = Generation(server.engine, server.tokenizer, prompts, body.n, settings)
    try:
        generation.submit()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except RuntimeError as e:  # the engine is not running (stopping, or its thread failed)
        raise ApiError(503, str(e), headers={"Retry-After": "1"}) from None
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    meta = {"id": ident, "created": int(time.time()), "model": server.model_name}
    if body.stream:
        return StreamingResponse(_stream(server, generation, body, meta, chat, echoes), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collect = asyncio.ensure_future(_collect(generation))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: nothing to answer
            collect.cancel()
            return Response(status_code=499)
        collect.result()
    except EngineFailure as e:
        raise ApiError(500, f"the engine failed this request: {e}", type="server_error") from None
    finally:
        gone.cancel()
        generation.close()
        _record(server, generation)
    choices = []
    for c in generation.choices:
        echo, echoed = _echo(echoes, c, body.n)
        text = echo + "".join(c.text)
        logprobs = _joined(echoed, _logprobs(server.tokenizer, c, chat))
        if chat:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": _usage(generation, body.n)}


def _logprobs(tokenizer, c, chat: bool) -> dict | None:
    """OpenAI's logprobs of a choice's tokens not yet reported (`Choice.take_scores`): chat's
    {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {tokens,
    token_logprobs, top_logprobs, text_offset}; None where the request asked for none.
    A token is its own text (`decode` of it alone)."""
    taken = c.take_scores()
    if taken is None:
        return None
    if chat:
        def entry(token, lp):
            text = _piece(tokenizer, token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in top]}
                            for t, (lp, top) in taken]}
    found, c.offset = _completion_logprobs(tokenizer, taken, c.offset)
    return found


def _completion_logprobs(tokenizer, taken: list, offset: int) -> tuple[dict, int]:
    """Completions' {tokens, token_logprobs, top_logprobs, text_offset} of taken [(token id,
    (its logprob, [(id, logprob)] of the likeliest)), ...] (None, None: a token nothing
    scores, an echo's first) whose text begins at `offset`, and the offset after them."""
    tokens = [_piece(tokenizer, t) for t, _ in taken]
    offsets = list(itertools.accumulate((len(p) for p in tokens), initial=offset))
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in taken],
            "top_logprobs": [None if top is None else {_piece(tokenizer, i): x for i, x in top}
                             for _, (_, top) in taken],
            "text_offset": offsets[:-1]}, offsets[-1]


def _piece(tokenizer, token: int) -> str:
    """A token's own text (`decode` of it alone), as logprobs name it."""
    return tokenizer.decode([int(token)])


async def _collect(generation: Generation):
    async for _ in generation.events():
        pass


async def _disconnected(request: Request):
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)


def _usage(generation: Generation, n: int) -> dict:
    prompt = sum(len(c.prompt) for c in generation.choices[::n])
    completion = sum(c.tokens for c in generation.choices)
    cached = sum(c.request.cached_tokens for c in generation.choices[::n] if c.request is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # (a paged engine's prefix cache: OpenAI's field)


def _record(server: Server, generation: Generation):
    end = time.perf_counter()
    for c in generation.choices:
        reason = c.finish_reason or ("error" if c.request is not None and c.request.error is not None else "abort")
        server.metrics.finished(reason, len(c.prompt), c.chunk_times, generation.arrival, end)


async def _stream(server: Server, generation: Generation, body, meta: dict, chat: bool, echoes):
    """Server-sent events in OpenAI's chunk shapes, ending with `data: [DONE]`. The client
    leaving cancels this generator (Starlette listens for the disconnect): `close` then
    cancels the choices."""
    usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if usage else {}
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index, text=None, finish=None, role=False, logprobs=None):
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return _sse({**meta, "object": obj, "choices": [choice], **extra})

    try:
        for c in generation.choices:
            echo, echoed = _echo(echoes, c, body.n)
            if chat:
                yield chunk(c.index, role=True)
            elif echo or echoed:
                yield chunk(c.index, echo, logprobs=echoed)
        try:
            async for c, text in generation.events():  # each chunk with its new tokens' logprobs
                logprobs = _logprobs(server.tokenizer, c, chat)
                yield (chunk(c.index, text, logprobs=logprobs) if text is not None
                       else chunk(c.index, finish=c.finish_reason, logprobs=logprobs))
        except EngineFailure as e:
            yield _sse(ApiError(500, f"the engine failed this request: {e}", type="server_error").body())
        else:
            if usage:
                yield _sse({**meta, "object": obj, "choices": [], "usage": _usage(generation, body.n)})
        yield "data: [DONE]\n\n"
    finally:
        generation.close()
        _record(server, generation)
