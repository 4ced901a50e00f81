"""`Engine`: continuous batching with speculation kept on the device.

A fixed batch of `slots` rows lives on the device (loop.py's `SlotState`, sized for
`max_len` and the deepest draft the engine runs), and one host thread serves it a turn at a
time. Three parts, each owning its state:

    Engine     the thread, the public API (submit, cancel, stats), delivery of tokens
      -> Scheduler (scheduler.py, host only)  queues, pages, preemption, chunks: plans a `Turn`
      -> Runner    (runner.py)  the device state and the table it last sent: applies the Turn

A turn: the scheduler plans (rows stopped, groups admitted into free slots, a long prompt's
chunk, the rows that run, the page table), the runner makes its device calls in that order,
and the engine reads the previous call's tokens while this one runs (call N+1 is dispatched
before call N is read; a row that finished stays frozen on the device meanwhile, writing
only to the null page once its turn is over). A call runs the steps that last about
policy.CALL_MS where `compile_all` timed them, at most `steps_per_call`; at most OPEN_STEPS
when a slot was free as it started; one step when rows were just admitted (their first
tokens go out at once). The call in flight is read first where pages ran out (a preempted
request resumes from all its tokens), and once after a row finished while none waits (its
client's next request then goes ahead of the next call: docs/bench/serve_against_read_first.txt).
K follows the number of live rows (`KPolicy`), among a few programs compiled over the same state.

The engine knows requests, the scheduler, the runner and a thread; nothing of HTTP or text
(a server sits on it), what a step computes (loop.py) or how programs are shaped (programs.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from typing import Sequence

import jax
import numpy as np

from specjax import sharding
from specjax.drafters import DraftModel, Eagle, EarlyExit, Lookahead, Medusa, PromptLookup, Retrieval
from specjax.drafters.base import Drafter
from specjax.models import Model
from specjax.request import deterministic_target, logprobs_setting
from specjax.sampling import FILTERED, MAX_LOGIT_BIAS, kind_of_rows
from specjax.serve import sizing, timing
from specjax.serve.policy import KPolicy
from specjax.serve.programs import Emitted, Programs
from specjax.serve.requests import Limits, Request
from specjax.serve.runner import Runner
from specjax.serve.scheduler import Admission, Reach, Scheduler, Scoring, Turn
from specjax.serve.warmup import Warmup

# Steps a call runs at most when a slot is free as it starts: a request that arrives during a
# call waits for its end before it is prefilled (docs/bench/open_steps.txt).
OPEN_STEPS = 2
# A slot's positions unless max_len says otherwise: the target's, at most this many (a 128k-position
# model's 8 slots would otherwise hold a dense cache of a million positions).
DEFAULT_MAX_LEN = 2048


def default_max_len(config) -> int:
    """A slot's positions where none are given: the model's (a ModelConfig's), at most
    `DEFAULT_MAX_LEN` (Engine, `specjax serve`, `specjax plan --serve`)."""
    return min(config.max_position_embeddings, DEFAULT_MAX_LEN)


# Drafters whose state the engine can hold per row and refill (Eagle covers Eagle3; Medusa reads
# the target's features, kept per row; Retrieval each row's text; Lookahead's state is per row).
SUPPORTED_DRAFTERS = (DraftModel, PromptLookup, Eagle, EarlyExit, Medusa, Retrieval, Lookahead)


@dataclasses.dataclass
class Call:
    """One run call in flight: the rows it ran and what it returns (read by `Engine._deliver`)."""

    owners: dict  # slot -> Request, the live rows as the call started
    K: int
    emitted: Emitted


def _failure(error: BaseException) -> RuntimeError:
    """What a request that a failed device call takes with it learns."""
    return RuntimeError(f"the engine's device call failed: {error!r}")


def _supported(draft):
    """The drafter for `draft` (None, a Model or a drafter), refused by name where the engine
    cannot hold its state per row."""
    if draft is None:
        return None
    drafter = DraftModel(draft) if isinstance(draft, Model) else draft
    if not isinstance(drafter, Drafter):
        raise TypeError(f"draft must be None, a specjax.Model or a drafter, got {type(draft).__name__}")
    if not isinstance(drafter, SUPPORTED_DRAFTERS):
        raise ValueError(f"the engine does not hold {type(drafter).__name__}'s state per row yet (it runs "
                         f"{', '.join(t.__name__ for t in SUPPORTED_DRAFTERS)}, Eagle3): use generate for it")
    return drafter


class Engine:
    """Serves requests that arrive one at a time from `slots` rows of `max_len` positions.

        engine = specjax.Engine(target, draft=draft, slots=8)   # max_len: the target's, at most 2,048
        with engine:                      # starts the device thread; drains and stops on exit
            req = engine.submit(prompt_ids, max_new_tokens=64, temperature=0.0, stop_token_ids=(eos,))
            for chunk in req: ...         # lists of new token ids
            req.result(); req.finish_reason

    draft: None (plain decoding), a draft `Model` (drafting from the vocabulary saved beside it
        if loaded with `DraftModel.load`), or a drafter: DraftModel, PromptLookup, Eagle, Eagle3,
        EarlyExit, Medusa, Retrieval, Lookahead (each tested against `generate`); a drafter of
        another class is refused by name.
    max_len: a slot's positions, prompt and reply together (None: the target's
        max_position_embeddings, at most `DEFAULT_MAX_LEN`).
    num_draft_tokens: K for every step (an int); K by the number of live rows (a sequence of
        `slots` ints, the n-th for n live rows; 0: speculation off); or None: that table from
        `cost_profile` (a CostProfile, a path, or None: the profile shipped for this backend;
        K = 4 where there is none), chosen again among its Ks and 0 at the steps' own costs
        once `compile_all` has timed them, and as the traffic shows how well it is drafted
        (`acceptance`). A drafter with its own Tree always drafts that tree.
    mesh: a `specjax.make_mesh` mesh, the models sharded on it (`shard_model`): slots lie over
        `data` (a multiple of it), the caches' heads over `model` by the target's rules.
    deterministic: as `generate`'s: a request's output does not depend on its neighbours.
    steps_per_call: the most steps a device call runs before the host looks; where
        `compile_all` timed the steps, a call runs those that last about policy.CALL_MS (a
        request that arrives at a full batch waits one to two calls).
    max_stop_ids: how many stop ids a request may carry.
    max_logit_bias: the most entries a request's logit_bias may hold (OpenAI's 300), per row.
    max_logprobs: None, or the most top alternatives a request's logprobs may list (0-20):
        then a call with a row that asks for logprobs runs a filtered program that also
        scores its tokens (`generate`'s logprobs, of `logprobs_mode`: "raw" or "processed"),
        one more run program per K and width; `Request.logprobs` holds them.
    max_grammar_states, max_grammar_masks, max_grammar_edges: each slot holds a grammar
        (specjax.grammar) of up to this many states, distinct token masks (V/8 bytes each)
        and exceptional moves, written with its row (states 0: none; larger: refused at
        submit, naming the argument; None: `sizing.grammar_capacity`: 8,192 states, the masks
        4 MiB hold (256-1,024) and 65,536 moves, 1.1 MiB a slot at 4k tokens, 5.1 MiB at
        128k; a JSON object of five strings of up to 20-50 characters fits), counted in the
        state's bytes (`stats()`'s state_bytes, which the memory check weighs).
    kv_pages: None (each slot holds max_len positions of keys and values), or every cache (the
        target's, and a draft model's or an EAGLE layer's: one page id a page of each) in pools
        of this many pages of `page_size` positions that the rows share (PagedAttention): a
        running request holds the pages its next two calls can write (`_reach`), grown before
        each call; a waiting one is admitted when its pages are free; when growth runs out of
        pages the request that arrived last is preempted (its pages freed; it waits with its
        tokens and resumes by prefilling them, its output unchanged); a request gives its pages
        back when it ends; so slots can exceed what max_len-sized rows would fit. A request
        larger than the whole pool is refused at `submit`. On a mesh the pools split as the
        caches' heads do, the tables' rows over `data`; deterministic=True: bits as unpaged.
    kv_cache_bytes: the pool sized from a budget instead of kv_pages: bytes ("4GiB", "2GB", an
        int), as many pages as fit (every cache's share of a page and the null page counted);
        or "auto": sizing.KV_MEMORY_FRACTION of the device's free memory now, less the state's
        other arrays and the most any program needs beside its arguments (`Programs.temporaries`,
        XLA's `memory_analysis()`), where a device reports its memory (not a CPU); at most what
        every slot at max_len holds (`stats()`).
    prefix_caching: paged, whether a request's row takes the cached pages of its context's
        longest run of full pages that an earlier request's row wrote with the same tokens
        before them (`pages.page_keys`: its prompt's, and once it finished, its output's as
        far as every cache of its row holds them, `Drafter.held`), for every cache, and
        prefills only the rest into its own pages; a cached page no request holds is kept
        until pages run out (least recently used first). None (the default): on where paged.
        Its output is what a fresh prefill gives (greedy: token for token; deterministic: bit
        for bit). stats(): tokens looked up and found, `prefix_cache_queries`, `prefix_cache_hits`.
    prefill_chunk: paged, the most prompt tokens one device call prefills (None: 64 on a CPU,
        512 elsewhere: `sizing.default_chunk`; rounded down to a bucket): a longer prompt's row
        holds a slot and its pages while its chunks are prefilled a call apiece between the
        live rows' calls, which go on streaming, and is placed with its last.
    """

    def __init__(self, target: Model, draft=None, slots: int = 8, max_len: int | None = None, *,
                 num_draft_tokens: int | None = None, cost_profile=None, mesh=None, deterministic: bool = False,
                 steps_per_call: int = 8, max_stop_ids: int = 8, draft_threshold: float = 0.0,
                 kv_pages: int | None = None, kv_cache_bytes: int | str | None = None, page_size: int = 16,
                 prefix_caching: bool | None = None, prefill_chunk: int | None = None,
                 max_logit_bias: int = MAX_LOGIT_BIAS, max_logprobs: int | None = None, logprobs_mode: str = "raw",
                 max_grammar_states: int | None = None, max_grammar_edges: int | None = None,
                 max_grammar_masks: int | None = None):
        if not isinstance(target, Model):
            raise TypeError(f"target must be a specjax.Model, got {type(target).__name__}")
        if max_len is None:
            max_len = default_max_len(target.config)
        sizes = (("slots", slots), ("max_len", max_len), ("steps_per_call", steps_per_call),
                 ("max_stop_ids", max_stop_ids), ("page_size", page_size))
        for name, value in sizes + ((("kv_pages", kv_pages),) if kv_pages is not None else ()):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(max_logit_bias, (int, np.integer)) or isinstance(max_logit_bias, bool) or max_logit_bias < 0:
            raise ValueError(f"max_logit_bias must be an int >= 0, got {max_logit_bias!r}")
        grammar = sizing.grammar_capacity(max_grammar_states, max_grammar_edges, target.config.vocab_size,
                                          max_grammar_masks)
        scoring = logprobs_setting(max_logprobs, logprobs_mode, "max_logprobs")  # (top, mode) or None
        if max_len > target.config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the target's max_position_embeddings "
                             f"({target.config.max_position_embeddings})")
        rules = None
        if mesh is not None:
            data = mesh.shape["data"]
            if slots % data:
                raise ValueError(f"slots={slots} must be a multiple of the mesh's data axis ({data}): rows lie over it")
            rules = tuple(target.rules or sharding.DEFAULT_RULES)  # the cache follows the target's rules
        if deterministic:
            target = deterministic_target(target, mesh)
        self.target, self.slots, self.max_len = target, int(slots), int(max_len)
        base = _supported(draft)
        self.policy = KPolicy(base, num_draft_tokens, cost_profile, self.slots, target.config)
        if base is not None:  # bound once: every K's drafter shares its weights (cast once, if at all)
            base = base.bind(target)
            base.check_lengths(1, max_len - 1)
        own = base is not None and (base.tree is not None or base.fixed_shape)
        off = {0} if self.policy.may_turn_off else set()  # K = 0 compiled too: the drafter may skip steps
        drafters = {K: None if base is None or K == 0 else base.resolve(None if own else K)
                    for K in sorted(set(self.policy.table) | off)}
        if kv_pages is not None and kv_cache_bytes is not None:
            raise ValueError("give kv_pages or kv_cache_bytes (the pool in pages, or in bytes), not both")
        paged = kv_pages is not None or kv_cache_bytes is not None
        # The pool's page 0 is its null page, never handed out: kv_pages more are (a budget's
        # pages are counted once the state's shapes are known: 2 until then).
        self.programs = Programs(target, drafters, self.slots, self.max_len, int(max_stop_ids),
                                 int(steps_per_call), draft_threshold, mesh, rules, deterministic, OPEN_STEPS,
                                 paging=(2 if kv_pages is None else int(kv_pages) + 1, int(page_size)) if paged else None,
                                 prefill_chunk=(sizing.default_chunk(mesh) if paged and prefill_chunk is None
                                                else prefill_chunk), bias_width=int(max_logit_bias), logprobs=scoring,
                                 grammar=grammar)
        # What a request may hold (`submit`'s checks).
        self.limits = Limits(target.config.vocab_size, self.max_len, self.programs.stop_width, int(max_logit_bias),
                             None if scoring is None else scoring[0], grammar)
        self.pages, self.kv_budget = sizing.page_pool(self.programs, kv_pages, kv_cache_bytes, page_size, mesh)
        if prefix_caching and not paged:
            raise ValueError("prefix_caching shares pages of the KV cache: give kv_pages or kv_cache_bytes")
        self.prefix_caching = paged if prefix_caching is None else bool(prefix_caching)
        self.policy.bind(self.programs.drafters, self.programs.width)
        self.memory = sizing.check_memory(self.programs, target)
        depth = 0 if self.programs.deepest is None else self.programs.deepest.tree.depth
        # What decides a page's contents beside its tokens (`page_keys`' salt): fixed per engine.
        salt = f"{target.config}|{target.dtype}|{deterministic}|{type(self.programs.deepest)}".encode()
        reach = Reach(self.programs.steps_per_call, depth, self.programs.room)
        self.scheduler = Scheduler(self.slots, self.pages, reach, self._partition, self.programs.chunk,
                                   self.prefix_caching, salt, self.programs.table_width if paged else 0)
        self.runner = Runner(self.programs)
        self._lock = threading.Condition()  # guards the scheduler (submit and cancel come from other threads)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._finished = False  # a row finished in the call read last (its client may send its next request)
        self._started: set = set()  # ids of the requests whose admission call this turn has made (`_recover`)
        self.calls = collections.Counter()  # device calls per K
        self.steps = collections.Counter()  # steps per K
        self.k_in_use = self.policy.table[0]  # the K of the last device call
        self.failures = 0  # device calls that failed (their requests failed; the engine went on)
        self.warmup = Warmup()  # the grouped prefills compiled in the background (compile_all)

    # ---- construction -------------------------------------------------------------------

    @property
    def k_table(self) -> tuple[int, ...]:
        """K by live rows now (`policy.table`: entry n - 1 for n live rows)."""
        return self.policy.table

    def acceptance(self) -> tuple[float, ...] | None:
        """P(draft position i accepted | those before were): `KPolicy.acceptance`."""
        return self.policy.acceptance()

    @property
    def step_ms(self) -> dict | None:
        """The steps' costs `compile_all` timed ({K: {width: ms}}; None: untimed)."""
        return self.policy.step_ms

    # ---- requests -----------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, stop_token_ids: Sequence[int] = (),
               seed: int | None = None, listener=None, *, min_p: float = 0.0, logit_bias=None,
               logprobs: int | None = None, presence_penalty=0.0, frequency_penalty=0.0,
               repetition_penalty=1.0, grammar=None) -> Request:
        """Queues a request; refuses at once (ValueError) what cannot run. Sampling as `generate`'s
        (min_p, penalties, grammar; logit_bias {token id: bias}, up to `max_logit_bias` entries). seed: its samples'
        seed (None: a fresh one, kept in `Request.seed`); a seeded request's output does not
        depend on its slot or neighbours, and equals `generate` on it alone with
        key=jax.random.key(seed). listener: None, or a function the engine's thread calls
        with each chunk (a list of token ids) and with None once the request has finished
        (a server's bridge to its event loop; it must not block)."""
        prompt, settings, stops, seed = self.limits.check(prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                                          min_p, logit_bias, stop_token_ids, seed, logprobs,
                                                          (presence_penalty, frequency_penalty, repetition_penalty),
                                                          grammar)
        room = self.programs.room  # a last step's in-flight tokens (`_reach`)
        if self.pages is not None and not self.pages.fits(len(prompt) + max_new_tokens + room):
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens})"
                             f"{f' + {room} in flight' if room else ''} needs more than the engine's whole page pool "
                             f"({self.pages.capacity_tokens} tokens in {self.pages.num_pages - 1} pages of "
                             f"{self.pages.page_size})")
        request = Request(self, prompt, int(max_new_tokens), settings, stops, seed, listener, logprobs, grammar)
        with self._lock:
            if self._thread is None or self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine is not running: use `with engine:` (or engine.start()); "
                                   "if it was, its device thread failed (see its requests' errors)")
            self.scheduler.submit(request)
            self._lock.notify()
        return request

    def score(self, prompt_ids: Sequence[int], top: int) -> concurrent.futures.Future:
        """A prompt's own log-probabilities, as `generate`'s prompt_logprobs gives them, by
        the device thread in its turn (a pass of its own; counted in `Programs.temporaries`):
        a future of (each token's given those before it [P], 0 at position 0; the `top`
        likeliest ids there and theirs [P, top]). ValueError: what it cannot score."""
        prompt, top = self.limits.prompt(prompt_ids), self.limits.top_logprobs(top)
        if prompt.size > self.max_len:
            raise ValueError(f"a prompt of {prompt.size} tokens exceeds the engine's max_len ({self.max_len})")
        future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine is not running: use `with engine:` (or engine.start())")
            self.scheduler.score(Scoring(tuple(int(t) for t in prompt), top, future))
            self._lock.notify()
        return future

    def cancel(self, request: Request):
        """Stops a request of this engine: a waiting one at once, a running one at the next
        device call (`Request.cancel`)."""
        with self._lock:
            if request.finished:
                return
            if self.scheduler.cancel(request):
                request._finish("cancelled")
            self._lock.notify()

    # ---- the device thread --------------------------------------------------------------

    def compile_all(self, groups_later: bool = False, progress=None, background: bool = False) -> "Engine":
        """Compiles every program the engine may run (`stats()["programs"]`) now, so that no
        request waits for a compile; seconds to minutes, once per process and shape.

        groups_later: the prefills of several waiting requests at once (and their inserts),
        about half the programs, compile afterwards in a background thread instead, so that
        the engine can serve sooner (docs/bench/serve_startup.txt); until a group size's
        programs for a bucket are compiled, its requests are prefilled in the sizes that
        are (one at a time at least). `stats()["compiling"]` counts those still to come,
        `warming` says whether the thread runs, and `stop_compiling` (or `close`) stops it.
        progress: None, or a function called with the number of programs just compiled,
        after each (from the background thread too).

        background: every program compiles in that thread, the engine serving at once: a
        request meanwhile compiles the programs it needs itself (jit's own path, on the
        engine's thread), most of all a first request's few, so that a cold server answers
        in seconds where compiling all takes minutes (docs/bench/serve_first_answer.txt).
        The thread runs each program once on a state of its own beside the engine's, so
        only where memory is the host's (a CPU); elsewhere it is `groups_later`.

        Then each K's step at each width is timed over live rows (`timing.step_costs`,
        about a second; `stats()["step_ms"]`): calls run the steps that last about
        policy.CALL_MS at those costs (`KPolicy.call_steps`), and a table the cost profile
        chose is chosen again at them (the profile timed generate's loop, maybe elsewhere)."""
        self.wait_warm()  # an earlier call's background compile ends first
        later = self.programs.groups() if groups_later or background else []
        self.warmup.pending = set(later)
        if background and self.compiles_while_serving:
            def everything_else(tick):
                layout = self.programs.compile_all(skip=self.warmup.pending, progress=tick)
                self.policy.price(timing.step_costs(self.programs), self.programs.widths)
                return layout

            first = len(self.programs.listing()) - len(later) * len(self.programs.admissions)
            self.warmup.start(self.programs, later, everything_else, progress, programs_first=first)
            return self
        layout = self.programs.compile_all(skip=self.warmup.pending, progress=progress)
        self.policy.price(timing.step_costs(self.programs), self.programs.widths)
        if later:
            self.warmup.start(self.programs, later, layout, progress)
        return self

    @property
    def compiles_while_serving(self) -> bool:
        """Whether `compile_all(background=True)` compiles every program while serving (a CPU:
        its thread's state of its own fits beside the engine's), or only grouped prefills."""
        return self.programs.backend.platform == "cpu"

    @property
    def warming(self) -> bool:
        """Whether the background compile of `compile_all(groups_later=True)` still runs."""
        return self.warmup.running

    @property
    def compile_error(self) -> Exception | None:
        """Why the background compile stopped early, if it did (its groups stay unused)."""
        return self.warmup.error

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Waits for the background compile to end (finished, failed or stopped); whether it has."""
        return self.warmup.wait(timeout)

    def stop_compiling(self):
        """Stops the background compile after the program it is compiling and waits for it;
        the groups not compiled stay unused (their requests are prefilled in smaller groups)."""
        self.warmup.stop()

    def close(self):
        """`stop`, then `stop_compiling`: what a process does before it exits."""
        self.stop()
        self.stop_compiling()

    def start(self) -> "Engine":
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the engine is already running")
            if self.runner.state is None:
                self.runner.reset()
            self._stopping = False
            self._thread = threading.Thread(target=self._serve, name="specjax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        """Stops taking requests, finishes those submitted, and stops the thread."""
        with self._lock:
            thread, self._stopping = self._thread, True
            self._lock.notify()
        if thread is not None:
            thread.join()
        with self._lock:
            self._thread = None

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _partition(self, lengths: list[int]) -> list[int]:
        """The sizes of the groups waiting prompts of `lengths` (ascending) are prefilled in."""
        return self.programs.partition(lengths, self.programs.call_tokens, skip=self.warmup.pending)

    def _serve(self):
        """The device thread: a turn at a time, each planned by the scheduler (`Turn`) and
        applied by the runner; the call in flight is read while the next one runs."""
        pending = None  # the call dispatched last turn, not read yet
        while True:
            with self._lock:
                while not (self.scheduler.busy or pending or self._stopping):
                    self._lock.wait()  # idle: blocks, using no CPU
                if self._stopping and not (self.scheduler.busy or pending):
                    return
            turn = None
            try:
                # Read the call in flight first where pages ran out (a preempted request resumes
                # from every token it has), or once after a row finished while none waits (its
                # client's next request then goes ahead of the next call).
                with self._lock:
                    first = pending is not None and (not self.scheduler.grows()
                                                     or (self._finished and not self.scheduler.waiting))
                if first:
                    self._deliver(pending)
                    pending = None
                with self._lock:
                    turn = self.scheduler.schedule()
                out = self._apply(turn)
                if pending is not None:  # the call before this one: read while this one runs
                    self._deliver(pending)
                pending = out
            except Exception as e:  # noqa: BLE001 - a device call failed: its rows' requests learn why
                pending = None
                self._recover(e, turn)
            except BaseException as e:  # interpreter exit: every request learns why
                with self._lock:
                    everyone = self.scheduler.everyone()
                self._fail(everyone, e, scoring=True)
                raise
            if self.turn_hook is not None:
                self.turn_hook(self)

    turn_hook = None  # tests: called with the engine after every turn, on its thread (the rules' checks)

    def _apply(self, turn: Turn) -> Call | None:
        """Applies a turn's device calls in order; -> the run call dispatched (None: no row
        runs). Each admission's requests are marked started as its call into the state is
        made (`_started`: `_recover` puts those not started back in the queue)."""
        for request in turn.cancelled:
            request._finish("cancelled")
        self.runner.stop(turn.stopped)
        self._started = set()
        for admission in turn.admissions:
            self._place(admission, turn.table)
        if turn.chunk is not None:
            self.runner.prefill_chunk(turn.chunk.slot, turn.chunk.request, turn.chunk.start, turn.table)
        with self._lock:
            owners = dict(self.scheduler.live)  # (an admitted request that failed to prepare has left)
        call = self._dispatch(owners, fresh=bool(turn.admissions), table=turn.table)
        if turn.score is not None:  # (behind the call just dispatched: the state is not its)
            try:
                turn.score.future.set_result(self.runner.score(turn.score.prompt, turn.score.top))
            except Exception as e:  # noqa: BLE001 - its own pass failed: its caller learns why, nobody else
                turn.score.future.set_exception(e)
        return call

    def _place(self, admission: Admission, table):
        """One admission's call (paged: into the state's pages; unpaged: a prefill, then its
        rows' insert). Unpaged, a request whose preparation fails fails alone: a group that
        fails is prepared again one request at a time. A failing call into the state raises
        (the state is suspect: `_recover`)."""
        if self.pages is not None:
            self._started.update(map(id, admission.requests))
            self.runner.admit(admission.slots, admission.requests, table)
            return
        try:
            rows = self.runner.prefill(admission.requests)
        except Exception as e:  # noqa: BLE001 - these requests' preparation, not the engine's state
            if len(admission.requests) > 1:
                for slot, request in zip(admission.slots, admission.requests):
                    self._place(Admission((slot,), (request,)), table)
                return
            request = admission.requests[0]
            with self._lock:
                self.scheduler.unprepared(request)
            request._finish(None, e)
            return
        self._started.update(map(id, admission.requests))
        self.runner.insert(admission.slots, rows)

    def _fail(self, requests: list[Request], error: BaseException, scoring: bool = False):
        """These requests fail with `error`; scoring: the prompts waiting to be scored too
        (the thread stops)."""
        with self._lock:
            self.scheduler.fail(requests)
            jobs = list(self.scheduler.scoring) if scoring else []
            if scoring:
                self.scheduler.scoring.clear()
        failure = _failure(error)
        for request in requests:
            request._finish(None, failure)
        for job in jobs:
            job.future.set_exception(failure)

    def _recover(self, error: Exception, turn: Turn | None):
        """A device call failed: the requests in the state (its rows, those of the turn's
        admissions made so far, a long prompt's being chunked) fail with it, the admissions
        not made yet go back to the front of the queue, the state starts empty, and the
        engine serves the waiting requests. If even an empty state cannot be made, every
        request fails and the thread stops."""
        self.failures += 1
        not_started = [r for r in (turn.admitted if turn is not None else ()) if id(r) not in self._started]
        with self._lock:
            gone = self.scheduler.recover(not_started)
        for request in gone:
            request._finish(None, _failure(error))
        try:
            self.runner.reset()
        except Exception:
            with self._lock:
                everyone, self._stopping = self.scheduler.everyone(), True
            self._fail(everyone, error, scoring=True)
            raise

    def _dispatch(self, owners: dict, fresh: bool, table) -> Call | None:
        """Runs the live rows one call (one step when `fresh`: rows were just admitted)."""
        if not owners:
            return None
        K = self.k_table[len(owners) - 1]
        kind = kind_of_rows([r.sampling for r in owners.values()])  # greedy rows alone: a greedy program
        scoring = any(r.logprobs is not None for r in owners.values())  # then the filtered run that scores
        kind = FILTERED if scoring else kind
        # New requests take the lowest free slot, so live rows gather at the front.
        steps = 1 if fresh else self.policy.call_steps(max(owners) + 1, K, self.programs.steps_per_call)
        emitted = self.runner.run(set(owners), K, kind, steps, scoring, table)
        with self._lock:
            self.calls[K] += 1
        jax.tree.map(lambda x: x.copy_to_host_async(), emitted)  # `_deliver`
        return Call(owners, K, emitted)

    def _deliver(self, call: Call):
        """A call's tokens (and scores) to its requests; a row that finished leaves (its pages
        cached where its caches hold them, then back), its request finished whatever a device
        call here does."""
        owners, K, self._finished = call.owners, call.K, False
        out = jax.device_get(call.emitted)
        taken = int(out.taken)
        with self._lock:  # (`stats` reads the counters at once)
            self.steps[K] += taken
            self.k_in_use = K
            if K:
                emitted = out.counts[:taken, sorted(owners)]  # [steps, live rows]: each drafted step's tokens
                self.policy.record(K, emitted[emitted > 0] - 1)  # drafted tokens the target accepted, per drafted step
        for slot, request in owners.items():
            if request.finished:
                continue
            new = [int(t) for s in range(taken) for t in out.tokens[s, slot, :out.counts[s, slot]]]
            if new and request.logprobs is not None:  # (before the listener hears of the tokens)
                n, scored = request.logprobs, out.logprobs
                request.scores.extend((float(scored.chosen[s, slot, j]), list(zip(
                    scored.top_ids[s, slot, j, :n].tolist(), scored.top[s, slot, j, :n].tolist())))
                    for s in range(taken) for j in range(out.counts[s, slot]))
            if new:
                request._emit(new)
            if out.done[slot]:
                self._finished = True
                self._end(slot, request, int(out.held[slot]))

    def _end(self, slot: int, request: Request, held: int):
        """A finished row's request: its pages cached below `held` (a draft that lagged the row
        fed first: a device call) and given back, and the request finished, even where that
        call fails (its error then goes on to `_recover`)."""
        stopped = bool(request.tokens) and request.tokens[-1] in request.stop_token_ids
        caught_up = None
        try:
            if self.pages is not None and self.prefix_caching:
                with self._lock:
                    pages = self.scheduler.pages.pages(request)
                caught_up = self.runner.catch_up(request.context, held, pages)
        finally:
            with self._lock:
                self.scheduler.finished(slot, request, caught_up)
            request._finish("stop" if stopped else "length")

    @property
    def running(self) -> bool:
        """Whether the device thread runs (it stops with `stop`, or if even an empty state cannot
        be made after a failure)."""
        return self._thread is not None and self._thread.is_alive()

    def load(self) -> tuple[int, int]:
        """(running, waiting): requests in slots (long prompts' being prefilled too), and queued."""
        with self._lock:
            return self.scheduler.load()

    def cancel_all(self):
        """Cancels every request, waiting or running (a server's bounded drain)."""
        with self._lock:
            everyone = self.scheduler.everyone()
        for request in everyone:
            request.cancel()

    def stats(self) -> dict:
        """Device calls and steps per K, the draft's catch-ups after calls at K = 0, K by live rows
        and the acceptance it was chosen from, speculation's counts, a prefill call's cost beyond
        its tokens (`Programs.partition`), `step_ms`, the requests running and waiting, the pages':
        one snapshot, under the engine's lock."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        policy = self.policy
        acceptance = policy.acceptance()
        running, waiting = self.load()
        return {"running": running, "waiting": waiting, "calls": dict(self.calls), "steps": dict(self.steps),
                "syncs": self.runner.syncs,
                "k_table": list(policy.table), "k_in_use": self.k_in_use, "drafts": policy.drafts,
                "acceptance": None if acceptance is None else [round(a, 4) for a in acceptance],
                "draft_tokens": policy.draft_tokens, "accepted": policy.accepted,
                "accepted_per_position": [n for _, n in sorted(policy.accepted_per_position.items())],
                "failures": self.failures, "preemptions": self.scheduler.preemptions,
                "prefix_caching": self.prefix_caching,
                "programs": self.programs.listing(), "step_ms": self.step_ms,
                "compiling": len(self.warmup.pending), "programs_compiling": self.warmup.left if self.warming else 0,
                "prefill_call_tokens": self.programs.call_tokens,
                **({} if self.pages is None else {**self.pages.stats(), **self.kv_budget}), **self.memory}

