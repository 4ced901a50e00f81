"""One API request's generations on the engine, as an asyncio stream of text.

A request has one or more choices (its prompts, times n); each is an engine request whose
chunks the engine's thread hands over to the event loop (`Engine.submit(listener=...)` ->
`loop.call_soon_threadsafe`), where a `Detokenizer` turns them into text and ends the choice
at a stop string (cancelling its engine request, so its slot frees at once). `Generation.
events` yields (choice, text) as text becomes final and (choice, None) when a choice ends.
Whoever consumes it cancels what is left with `close` (a client gone, a handler failing).

It knows the engine's requests, tokenizers and asyncio; nothing of HTTP or OpenAI's shapes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specjax.serve.detokenize import Detokenizer


class EngineFailure(Exception):
    """The engine failed a choice's request (a device call failed), or cancelled it (the
    server is stopping)."""


@dataclass
class Choice:
    index: int
    prompt: list[int]
    detokenizer: Detokenizer
    request: object = None  # the engine's Request
    finish_reason: str | None = None  # "stop", "length", or None while it runs
    text: list[str] = field(default_factory=list)
    chunk_times: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) per chunk
    scored: int = 0  # of its tokens, those whose logprobs were reported (`take_scores`)
    offset: int = 0  # characters of the tokens reported (completions' text_offset)

    def take_scores(self) -> list | None:
        """(token id, its `Request.scores` entry) of the tokens up to the end of its text not
        reported yet; None where the request asked for no logprobs."""
        if self.request is None or self.request.logprobs is None:
            return None
        end = self.tokens
        taken = list(zip(self.request.tokens[self.scored:end], self.request.scores[self.scored:end]))
        self.scored = end
        return taken

    @property
    def tokens(self) -> int:
        """Generated tokens up to the end of its text: through the token that completed its
        stop string, if one did (a speculative chunk holds several: those after it are not
        the reply's, in its usage or its logprobs)."""
        emitted = sum(n for _, n in self.chunk_times)
        return min(emitted, self.detokenizer.used) if self.detokenizer.stopped else emitted


@dataclass
class Settings:
    """What the engine needs for each choice."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logit_bias: dict  # token id -> bias
    logprobs: int | None  # the top alternatives each token's logprobs list; None: no logprobs
    stop_ids: tuple[int, ...]
    stop: tuple[str, ...]
    seed: int | None
    penalties: dict = field(default_factory=dict)  # presence_penalty, frequency_penalty, repetition_penalty
    grammar: object = None  # a specjax.Grammar every choice must match (structured output), or None


class Generation:
    """The choices of one API request: prompts (token ids) x n, submitted together."""

    def __init__(self, engine, tokenizer, prompts: list[list[int]], n: int, settings: Settings):
        self.engine, self.settings = engine, settings
        self.arrival = time.perf_counter()
        self.choices = [Choice(i * n + j, prompt, Detokenizer(tokenizer, settings.stop))
                        for i, prompt in enumerate(prompts) for j in range(n)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._n = n

    def submit(self):
        """Submits every choice (ValueError: refused by the engine; none is left running)."""
        loop = asyncio.get_running_loop()
        s = self.settings
        try:
            for c in self.choices:
                seed = None if s.seed is None else (s.seed + c.index % self._n) % 2 ** 32
                c.request = self.engine.submit(
                    c.prompt, max_new_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                    min_p=s.min_p, logit_bias=s.logit_bias, logprobs=s.logprobs, stop_token_ids=s.stop_ids, seed=seed,
                    grammar=s.grammar, **s.penalties,
                    listener=lambda tokens, c=c: loop.call_soon_threadsafe(self._queue.put_nowait, (c, tokens)))
        except BaseException:
            self.close()
            raise

    async def events(self):
        """(choice, text) as a choice's text becomes final, (choice, None) when it ends.
        Raises EngineFailure when the engine fails a choice."""
        running = len(self.choices)
        while running:
            c, tokens = await self._queue.get()
            if c.finish_reason is not None:
                continue  # chunks that came after a stop string
            if tokens is not None:
                c.chunk_times.append((time.perf_counter(), len(tokens)))
                text = await asyncio.to_thread(c.detokenizer.push, tokens)  # beside the event loop
                if c.detokenizer.stopped:
                    c.request.cancel()
                    c.finish_reason = "stop"
                if text:
                    c.text.append(text)
                    yield c, text
                if c.finish_reason is None:
                    continue
            else:
                if c.request.error is not None:
                    raise EngineFailure(str(c.request.error))
                if c.request.finish_reason == "cancelled":  # not by us: the server is stopping
                    raise EngineFailure("the request was cancelled: the server is shutting down")
                text = await asyncio.to_thread(c.detokenizer.finish)
                c.finish_reason = "stop" if c.request.finish_reason == "stop" else "length"
                if text:
                    c.text.append(text)
                    yield c, text
            running -= 1
            yield c, None

    def close(self):
        """Cancels every choice still running (their slots free at the engine's next call)."""
        for c in self.choices:
            if c.request is not None and not c.request.finished:
                c.request.cancel()
