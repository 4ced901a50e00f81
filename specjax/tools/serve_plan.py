"""Before you serve on a chip: how many tokens of KV pages fit beside the weights and the
engine's programs, and how many requests that holds at once against max_len-sized slots.

`serve_plan` builds the engine's programs from shapes (`specjax.Engine`'s run calls at K = 0
and at the draft's K, and its admission of the most prompt tokens, prefilled into the
state's pages), compiles them for one chip here (aot.py: a
TPU's compiler, or a GPU's through jax's CUDA plugin), and reads XLA's figures
(`memory_analysis()`): the chip's memory less the weights, the state's rows (tokens, page
tables, settings) and the most any program needs beside its arguments is what pages may
hold. It then compiles the dense engine call at the slots that the same memory holds at
max_len each, to show it fits.

It knows configs and compiled programs' figures; it reads no weights and runs nothing. One
chip only: the engine's programs on a mesh are not built from shapes here.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.cache import KVCache
from specjax.drafters import DraftModel
from specjax.memory import GB, MB, nbytes
from specjax.serve import programs
from specjax.tools import aot
from specjax.tools.plan import read_config


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """A serving configuration's memory on one chip, from its compiled programs."""

    request: str  # what was planned, in words
    hbm: int
    weights: int
    rows: int  # the state's arrays but its pools: tokens, page tables, settings
    temporaries: int  # the most any program needs beside its arguments
    page_bytes: int  # one page of every cache (target and draft)
    page_size: int
    slots: int
    max_len: int
    mean_tokens: int
    dense_slots: int  # max_len-sized slots the same memory holds, at most `slots` (compiled: `dense_fits`)
    dense_fits: bool
    compile_seconds: float

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
        return "\n".join([
            f"serve plan: {self.request}",
            f"  chip {size(self.hbm)}: weights {size(self.weights)}, rows {size(self.rows)}, the programs' "
            f"temporaries {size(self.temporaries)} (compiled in {self.compile_seconds:.0f} s); free for pages "
            f"{size(max(self.free, 0))}",
            f"  pages of {self.page_size}: {self.pages} ({size(self.page_bytes)} each, every cache) = {self.tokens} "
            f"tokens: {self.paged_requests} requests of {self.mean_tokens} tokens at once (of {self.slots} slots)",
            f"  dense slots of {self.max_len}: {self.dense_slots} at once in the same memory (at most {self.slots}; compiled: "
            f"{'fits' if self.dense_fits else 'does not fit'})",
            f"  pages / dense: {ratio:.2f}x the requests at once"])


def serve_plan(target, draft=None, *, topology: str, slots: int = 64, max_len: int | None = None,
               page_size: int = 16, num_draft_tokens: int = 4, mean_tokens: int = 1500, dtype=jnp.bfloat16,
               quantize: str | None = None, steps: int = 4, log=None) -> ServePlan:
    """The engine of `slots` slots of max_len (default: 2048, or the target's positions where
    fewer) with its caches in pages of page_size, on the one-chip `topology` ("v5e:1x1",
    "h100"): the pages that fit and the requests of mean_tokens they hold at once, against
    dense slots. target, draft: folders, hub ids, config.json dicts or ModelConfigs (draft
    None: plain decoding; else a draft model at num_draft_tokens)."""
    config = read_config(target)
    max_len = min(2048, config.max_position_embeddings) if max_len is None else max_len
    for name, value in (("slots", slots), ("max_len", max_len), ("page_size", page_size),
                        ("mean_tokens", mean_tokens), ("num_draft_tokens", num_draft_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    slice_ = aot.accelerator(topology)
    if slice_.chips != 1:
        raise ValueError(f"the serve plan builds the engine on one chip; {topology} has {slice_.chips}: give a "
                         f"one-chip topology (e.g. v5e:1x1, h100)")
    where = aot.on_device(slice_.devices[0])
    target_model = aot.abstract_model(config, dtype, quantize)
    draft_model = None if draft is None else aot.abstract_model(read_config(draft), dtype, quantize)
    Ks = (0,) if draft_model is None else (0, num_draft_tokens)
    paged = [aot.engine_program(target_model, draft_model, where, slots, max_len, K=K, steps=steps, kv_pages=1,
                                page_size=page_size) for K in Ks]
    compiled = [aot.compile_spec(spec) for spec in paged]
    state = paged[0].args[3]
    pools = programs.pool_bytes(state)
    page_bytes = pools // 2  # (kv_pages=1: the null page and one)
    prefill = aot.compile_spec(_largest_admission(target_model, draft_model, where, slots, max_len, page_size,
                                                  num_draft_tokens))
    temporaries = max(max(p.temporaries for p in compiled), prefill.temporaries)  # (its output: the state, donated)
    weights = compiled[-1].weights
    kind = "plain decoding" if draft_model is None else f"draft chain K={num_draft_tokens}"
    request = (f"{target_model.config.model_type} {target_model.config.num_params() / 1e9:.2f}B params "
               f"({jnp.dtype(dtype).name}{', int8' if quantize else ''}), {kind}; {slots} slots of max_len "
               f"{max_len}, pages of {page_size}, on {topology}")
    rows = nbytes(state) - pools
    seconds = sum(p.compile_seconds for p in compiled) + prefill.compile_seconds
    if log:
        log(f"paged programs compiled in {seconds:.0f} s")
    # Dense: max_len-sized slots in the memory the pages and their rows take.
    per_slot = (nbytes(paged[0].args[3]) - pools) // slots + KVCache.nbytes(target_model.config, 1, max_len, dtype) + (
        0 if draft_model is None else KVCache.nbytes(draft_model.config, 1, max_len, dtype))
    dense_slots = int(max(0, min(slots, (slice_.hbm - weights - temporaries) // per_slot)))
    fits = False
    if dense_slots:
        spec = aot.engine_program(target_model, draft_model, where, dense_slots, max_len, K=Ks[-1], steps=steps)
        try:
            program = aot.compile_spec(spec)
            fits = program.arguments + program.temporaries <= slice_.hbm  # (its outputs are its donated state)
            seconds += program.compile_seconds
        except Exception as e:  # noqa: BLE001 - XLA's out-of-memory is an error at compile time
            if "memory" not in str(e).lower():
                raise
    return ServePlan(request, slice_.hbm, weights, rows, temporaries, page_bytes, page_size, slots, max_len,
                     mean_tokens, int(dense_slots), fits, seconds)


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
