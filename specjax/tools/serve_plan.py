"""Before you serve on a chip: how many tokens of KV pages fit beside the weights and the
engine's programs, and how many requests that holds at once against max_len-sized slots.

`serve_plan` builds three of the engine's programs from shapes and compiles them for one chip
(aot.py: a TPU's compiler, or a GPU's through jax's CUDA plugin): its run call at the draft's
K (K = 0 without a draft; beside a draft the call at K = 0 needs about half the temporaries:
docs/bench/aot/engine_tpu_programs.txt), its admission of the most prompt tokens, prefilled
into the state's pages, and the dense engine's call at the max_len-sized slots that the same
memory holds, to show it fits. From XLA's figures (`memory_analysis()`), the chip's memory
less the weights, the state's rows (tokens, page tables, settings) and the most either paged
program needs beside its arguments is what pages may hold.

The compiles run in a process of their own (specjax/compile_process.py), each for at most
compile_limit seconds: one that runs past it is stopped and the plan says what it leaves out.
A TPU program writes pages one token at a time, unrolled (docs/rough-edges.md), so the
admission's compile grows with its tokens: the 4,096 of a full prefill group take many
minutes here.

It knows configs and compiled programs' figures; it reads no weights and runs nothing. It
does not know the engine's other programs (narrower calls, other sampling kinds, logprobs,
chunks of a long prompt), nor a mesh: one chip only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.drafters import DraftModel
from specjax.memory import GB, MB, nbytes
from specjax.serve import programs
from specjax.serve.engine import default_max_len
from specjax.tools import aot
from specjax.compile_process import Compiler
from specjax.tools.plan import read_config

SLOTS = 8  # `specjax serve`'s
COMPILE_LIMIT = 60.0  # seconds a program may take to compile
FLAGS = {"slots": "--slots", "max_len": "--max-len", "page_size": "--page-size", "mean_tokens": "--mean-tokens",
         "num_draft_tokens": "--num-draft-tokens", "compile_limit": "--compile-limit"}  # (`specjax plan --serve`'s)


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """A serving configuration's memory on one chip, from its compiled programs."""

    request: str  # what was planned, in words
    hbm: int
    weights: int
    rows: int  # the state's arrays but its pools: tokens, page tables, settings
    temporaries: int  # the most a compiled paged program needs beside its arguments
    page_bytes: int  # one page of every cache (target and draft)
    page_size: int
    slots: int
    max_len: int
    mean_tokens: int
    dense_slots: int  # max_len-sized slots the same memory holds, at most `slots` (compiled: `dense_fits`)
    dense_fits: bool | None  # None: its compile was stopped
    compile_seconds: float
    left_out: tuple[str, ...] = ()  # paged programs stopped at the compile limit: their temporaries not counted
    compile_limit: float = COMPILE_LIMIT

    @property
    def free(self) -> int:
        return self.hbm - self.weights - self.rows - self.temporaries

    @property
    def pages(self) -> int:
        """Pages beside the null page, at most what every slot at max_len holds."""
        return max(0, min(self.free // self.page_bytes - 1, self.slots * -(-self.max_len // self.page_size)))

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def paged_requests(self) -> int:
        """Requests of mean_tokens running at once on the pages (at most the slots)."""
        return min(self.slots, self.tokens // self.mean_tokens)

    def __str__(self):
        def size(n):
            return f"{n / GB:.2f} GiB" if abs(n) >= 100 * MB else f"{n / MB:.1f} MiB"
        ratio = self.paged_requests / self.dense_slots if self.dense_slots else float("inf")
        verdict = {True: "fits", False: "does not fit", None: f"stopped at {self.compile_limit:g} s"}[self.dense_fits]
        lines = [
            f"serve plan: {self.request}",
            f"  chip {size(self.hbm)}: weights {size(self.weights)}, rows {size(self.rows)}, the programs' "
            f"temporaries {size(self.temporaries)} (compiled in {self.compile_seconds:.0f} s); free for pages "
            f"{size(max(self.free, 0))}",
            f"  pages of {self.page_size}: {self.pages} ({size(self.page_bytes)} each, every cache) = {self.tokens} "
            f"tokens: {self.paged_requests} requests of {self.mean_tokens} tokens at once (of {self.slots} slots)",
            f"  dense slots of {self.max_len}: {self.dense_slots} at once in the same memory (at most {self.slots}; "
            f"compiled: {verdict})",
            f"  pages / dense: {ratio:.2f}x the requests at once"]
        if self.left_out:
            lines.append(f"  not counted: the temporaries of {', '.join(self.left_out)}, stopped at the "
                         f"{self.compile_limit:g} s compile limit (--compile-limit): the pages are at most these")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """What the compiling process builds the programs from."""

    target: ModelConfig
    draft: ModelConfig | None
    topology: str
    dtype: str
    quantize: str | None
    slots: int
    max_len: int
    page_size: int
    K: int  # the draft's chain (0: plain decoding)
    steps: int


def serve_plan(target, draft=None, *, topology: str, slots: int = SLOTS, max_len: int | None = None,
               page_size: int = 16, num_draft_tokens: int = 4, mean_tokens: int | None = None, dtype=jnp.bfloat16,
               quantize: str | None = None, steps: int = 4, compile_limit: float = COMPILE_LIMIT,
               log=None) -> ServePlan:
    """The engine of `slots` slots of max_len (default: the target's positions, at most
    2048) with its caches in pages of page_size, on the one-chip `topology` ("v5e:1x1",
    "h100"): the pages that fit and the requests of mean_tokens (default half of max_len) they
    hold at once, against dense slots. target, draft: folders, hub ids, config.json dicts or
    ModelConfigs (draft None: plain decoding; else a draft model at num_draft_tokens). Each
    program compiles for at most compile_limit seconds; log(line): progress. Numbers that
    cannot plan an engine raise ValueError naming `specjax plan`'s flags; the engine call
    stopped at the limit raises TimeoutError."""
    config = read_config(target)
    draft_config = None if draft is None else read_config(draft)
    max_len = default_max_len(config) if max_len is None else max_len
    mean_tokens = max(1, max_len // 2) if mean_tokens is None else mean_tokens
    _check(config, slots=slots, max_len=max_len, page_size=page_size, mean_tokens=mean_tokens,
           num_draft_tokens=num_draft_tokens, steps=steps, compile_limit=compile_limit)
    engine = _Engine(config, draft_config, topology, jnp.dtype(dtype).name, quantize, slots, max_len, page_size,
                     0 if draft_config is None else num_draft_tokens, steps)
    with Compiler(_prepare, engine, compile_limit, log, total=3) as compiler:
        hbm = compiler.start()
        step = compiler.compile("step")
        if step.stopped:
            raise TimeoutError(f"the engine's call ({step.name}) did not compile within {compile_limit:g} s: give "
                               f"--compile-limit more, or plan fewer --slots")
        call, pools, state = step.value
        admission = compiler.compile("admission")
        compiled = [call] + ([] if admission.stopped else [admission.value])
        temporaries = max(p.temporaries for p in compiled)  # (the admission's output: the state, donated)
        rows = state - pools
        dense_slots = int(max(0, min(slots, (hbm - call.weights - temporaries) // _dense_slot(engine, rows))))
        dense = compiler.compile("dense", dense_slots) if dense_slots else None
    program = None if dense is None or dense.stopped else dense.value  # (None too where XLA says it does not fit)
    fits = None if dense is not None and dense.stopped else (
        program is not None and program.arguments + program.temporaries <= hbm)  # (its outputs: the state, donated)
    seconds = sum(p.compile_seconds for p in compiled + [program] if p is not None)
    return ServePlan(_words(engine), hbm, call.weights, rows, temporaries, pools // 2, page_size, slots, max_len,
                     mean_tokens, dense_slots, fits, seconds, (admission.name,) if admission.stopped else (),
                     compile_limit)


def _check(config: ModelConfig, **values):
    """Refuses numbers that cannot plan an engine, in one line naming their flags."""
    for name, value in values.items():
        number = (int, float) if name == "compile_limit" else int
        if isinstance(value, bool) or not isinstance(value, number) or value <= 0:
            raise ValueError(f"{FLAGS.get(name, name)} must be {'a number' if name == 'compile_limit' else 'an int'} "
                             f"above 0, got {value!r}")
    max_len, mean_tokens = values["max_len"], values["mean_tokens"]
    if max_len > config.max_position_embeddings:
        raise ValueError(f"--max-len {max_len} exceeds the target's max_position_embeddings "
                         f"({config.max_position_embeddings})")
    if mean_tokens > max_len:
        raise ValueError(f"--mean-tokens {mean_tokens} exceeds --max-len {max_len}: a request's prompt and output "
                         f"fit in max_len tokens (default: half of it)")


def _words(engine: _Engine) -> str:
    kind = "plain decoding" if engine.draft is None else f"draft chain K={engine.K}"
    return (f"{engine.target.model_type} {engine.target.num_params() / 1e9:.2f}B params ({engine.dtype}"
            f"{', int8' if engine.quantize else ''}), {kind}; {engine.slots} slots of max_len {engine.max_len}, "
            f"pages of {engine.page_size}, on {engine.topology}")


def _dense_slot(engine: _Engine, rows: int) -> int:
    """Bytes of one max_len-sized slot of the dense engine: its rows and every cache's."""
    caches = [c for c in (engine.target, engine.draft) if c is not None]
    return rows // engine.slots + sum(KVCache.nbytes(c, 1, engine.max_len, engine.dtype) for c in caches)


def _prepare(engine: _Engine):
    """In the compiling process: (the chip's memory, the handler of the jobs "step",
    "admission" and ("dense", slots))."""
    slice_ = aot.accelerator(engine.topology)
    if slice_.chips != 1:
        raise ValueError(f"the serve plan builds the engine on one chip; {engine.topology} has {slice_.chips}: give "
                         f"a one-chip topology (e.g. v5e:1x1, h100)")
    where = aot.on_device(slice_.devices[0])
    dtype = getattr(jnp, engine.dtype)  # (a name across the pipe)
    target = aot.abstract_model(engine.target, dtype, engine.quantize)
    draft = None if engine.draft is None else aot.abstract_model(engine.draft, dtype, engine.quantize)
    call = functools.partial(aot.engine_program, target, draft, where, max_len=engine.max_len, K=engine.K,
                             steps=engine.steps)

    def handler(job: str, slots: int = engine.slots):
        if job == "step":
            spec = call(slots=slots, kv_pages=1, page_size=engine.page_size)
            return spec.name, functools.partial(_with_state, spec)
        if job == "admission":
            spec = _largest_admission(target, draft, where, slots, engine.max_len, engine.page_size, engine.K)
            return spec.name, functools.partial(aot.compile_spec, spec)
        spec = call(slots=slots)
        return spec.name, functools.partial(_may_not_fit, spec)

    return slice_.hbm, handler


def _with_state(spec: aot.Spec) -> tuple[aot.Program, int, int]:
    """A paged engine call compiled, and its state's bytes: (program, the pools', the whole's)."""
    state = spec.args[3]
    return aot.compile_spec(spec), programs.pool_bytes(state), nbytes(state)


def _may_not_fit(spec: aot.Spec) -> aot.Program | None:
    """The program compiled, or None where XLA says it does not fit (an error at compile time)."""
    try:
        return aot.compile_spec(spec)
    except Exception as e:  # noqa: BLE001 - XLA's out-of-memory is an error at compile time
        if "memory" not in str(e).lower():
            raise
        return None


def _largest_admission(target, draft, where: aot.Placement, slots: int, max_len: int, page_size: int,
                       K: int) -> aot.Spec:
    """The paged engine's admission of the most tokens (`Programs.largest_prefill`: a group
    prefilled straight into the state's pages), placed on the chip."""
    placed = where.model(target)
    drafter = None if draft is None else DraftModel(where.model(draft)).resolve(K).bind(placed)
    engine = programs.Programs(placed, {0: None} if drafter is None else {K: drafter}, slots, max_len, 8, 1, 0.0,
                               paging=(2, page_size))
    host, b = engine.largest_prefill()
    n = host[0].shape[0]
    state = engine.state_shapes()
    params = (placed.params, aot.drafter_params(drafter))
    table = np.zeros((slots, engine.table_width), np.int32)
    args = where.replicated((state, np.arange(n, dtype=np.int32)) + tuple(host) + (table,))
    return aot.Spec(f"admission [{n}, {b}]", programs.admit_rows, None, (placed, drafter) + tuple(args),
                    dict(width=b, backend=where.backend, rules=None), params, nbytes(params) + nbytes(state),
                    where.platform)
