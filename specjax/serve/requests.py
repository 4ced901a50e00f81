"""`Request`: one generation submitted to an `Engine`, as its caller and the engine's thread
share it: the chunks it emits, its tokens, how it finished, and the context a preempted
request resumes from; `Limits`: what an engine takes. It knows nothing of devices, slots or
pages."""

from __future__ import annotations

import queue
import threading
import time
from typing import NamedTuple

import numpy as np

from specjax.grammar import Capacity, Grammar
from specjax.models import check_token_ids
from specjax.request import fresh_seed
from specjax.sampling import Settings, check_logit_bias, check_penalties, validate

_END = object()  # the chunk queue's last item


class Limits(NamedTuple):
    """What one engine's requests may hold."""

    vocab_size: int
    max_len: int
    stop_width: int  # stop ids
    bias_width: int  # logit bias entries
    logprobs: int | None  # top alternatives a token's logprobs may list (None: no logprobs)
    grammar: Capacity | None = None  # what a row's grammar may hold (None: no grammars)

    def prompt(self, prompt_ids) -> np.ndarray:
        """The prompt's ids as an array, checked: a non-empty list of ids in the vocabulary."""
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        check_token_ids(prompt, self.vocab_size)
        return prompt

    def top_logprobs(self, n) -> int:
        """n checked as a count of top alternatives a token's logprobs may list."""
        most = self.logprobs
        if most is None or not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 0 <= n <= most:
            raise ValueError(f"logprobs must be None or an int in [0, {most}]" if most is not None else
                             "this engine scores no tokens: Engine(max_logprobs=...) (specjax serve --max-logprobs)")
        return int(n)

    def check(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, min_p, logit_bias, stop_token_ids, seed,
              logprobs, penalties=(0.0, 0.0, 1.0), grammar=None) -> tuple[tuple, Settings, tuple, int]:
        """`Engine.submit`'s arguments checked (ValueError names what is wrong): (prompt,
        its `Settings`, stop ids, seed: a fresh one where None). penalties: (presence,
        frequency, repetition); grammar: None or a `specjax.Grammar` that fits a row."""
        if grammar is not None:
            if self.grammar is None:
                raise ValueError("this engine holds no grammars: Engine(max_grammar_states=...)")
            if not isinstance(grammar, Grammar):
                raise ValueError(f"grammar must be a specjax.Grammar, got {type(grammar).__name__}")
            if grammar.vocab_ids < self.vocab_size:
                raise ValueError(f"{grammar.source} was compiled over {grammar.vocab_ids} ids; this engine's model "
                                 f"has {self.vocab_size}")
            why = self.grammar.refusal(grammar.source, grammar.num_states, grammar.num_masks, grammar.num_edges)
            if why:
                raise ValueError(why)
        prompt = self.prompt(prompt_ids)
        V = self.vocab_size
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if prompt.size + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt.size} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"engine's max_len ({self.max_len})")
        validate(temperature, top_k, top_p, min_p)
        if logprobs is not None:
            self.top_logprobs(logprobs)
        bias = check_logit_bias(logit_bias, V, self.bias_width)
        stops = tuple(int(i) for i in np.asarray(stop_token_ids, np.int64).reshape(-1))
        if len(stops) > self.stop_width:
            raise ValueError(f"{len(stops)} stop ids; this engine takes up to {self.stop_width} "
                             f"(Engine(max_stop_ids=...))")
        if any(not 0 <= i < V for i in stops):
            raise ValueError(f"stop ids must lie in [0, {V}), got {list(stops)}")
        if seed is None:
            seed = fresh_seed()
        elif not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed must be an int in [0, 2**32) or None, got {seed!r}")
        settings = Settings(float(temperature), int(top_k), float(top_p), float(min_p), tuple(bias.items()),
                            *check_penalties(*penalties), constrained=grammar is not None)
        return tuple(int(t) for t in prompt), settings, stops, int(seed)


class Request:
    """One generation submitted to an `Engine`. Iterate it for chunks (lists of new token
    ids, as the device emits them; one consumer), or wait for `result()`. `finish_reason`:
    "stop" (a stop id was emitted, and is the last token), "length" (max_new_tokens) or
    "cancelled"; None while it runs. Times (time.perf_counter) are kept for benchmarks."""

    def __init__(self, engine, prompt: tuple, max_new_tokens: int, sampling: tuple,
                 stop_ids: tuple, seed: int, listener=None, logprobs: int | None = None, grammar=None):
        self._engine, self._listener = engine, listener  # its Engine (for cancel)
        self.prompt, self.max_new_tokens, self.sampling = prompt, max_new_tokens, sampling
        self.stop_token_ids, self.seed, self.grammar = stop_ids, seed, grammar  # (grammar: a specjax.Grammar)
        self.tokens: list[int] = []
        self.logprobs = logprobs  # None, or the top alternatives each token's scores list
        # Per token of `tokens` where logprobs is asked for: (its log-probability, [(id, log-probability)
        # of the `logprobs` likeliest]), filled before the token's chunk is emitted.
        self.scores: list[tuple[float, list[tuple[int, float]]]] = []
        self.cached_tokens = 0  # of its context, those its row took from cached pages (prefix caching)
        self.prefilled = 0  # of its context, those its row's pages hold before its admission (cached, chunks)
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.chunk_times: list[tuple[float, int]] = []  # (when, tokens) per chunk
        self._chunks: queue.Queue = queue.Queue()
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def context(self) -> tuple:
        """What its row is prefilled from: its prompt, and the tokens it has generated (a
        request preempted for pages resumes from them)."""
        return self.prompt + tuple(self.tokens)

    def __iter__(self):
        while True:
            chunk = self._chunks.get()
            if chunk is _END:
                if self.error is not None:
                    raise self.error
                return
            yield chunk

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated token ids (a stop id included), once the request has finished."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def cancel(self):
        """Stops the request; its slot is freed at the engine's next device call."""
        self._engine.cancel(self)

    def _emit(self, tokens: list[int]):
        self.tokens.extend(tokens)
        self.chunk_times.append((time.perf_counter(), len(tokens)))
        self._chunks.put(tokens)
        self._tell(tokens)

    def _finish(self, reason: str | None, error: BaseException | None = None):
        if self.finished:
            return
        self.finish_reason, self.error = reason, error
        self._finished.set()
        self._chunks.put(_END)
        self._tell(None)

    def _tell(self, tokens):
        """The listener hears a chunk (or None: finished) on the engine's thread; what it
        raises is its own business, never the engine's."""
        if self._listener is not None:
            try:
                self._listener(tokens)
            except Exception:  # noqa: BLE001 - e.g. the server's event loop has closed
                pass
