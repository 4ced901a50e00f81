"""How large an engine's state and calls may be: its page pool (`page_pool`), the pages a
byte budget holds (`pages_within`), a slot's room for a grammar (`grammar_capacity`), the state's bytes checked against what the devices have
(`check_memory`), and the prompt tokens a call prefills by default (`default_chunk`).

This module reads a `Programs`' shapes and the devices' memory; it knows nothing of
requests, queues or threads (engine.py).
"""

from __future__ import annotations

import jax

from specjax import memory
from specjax.backend import Backend
from specjax.grammar import Capacity
from specjax.serve.pages import PagePool

KV_MEMORY_FRACTION = 0.9  # of a device's free memory that kv_cache_bytes="auto" may take (vLLM's default)
# A paged engine's default prefill_chunk (tokens a call), by platform: a chunk stalls the live
# rows for its whole cost, which on a compute-bound CPU grows with its tokens, so chunks are
# short there (docs/bench/serve_arrival.txt); an accelerator reads the weights once for a
# chunk of hundreds.
PREFILL_CHUNK = {"cpu": 64}
PREFILL_CHUNK_ELSEWHERE = 512


# A slot's room for a structured-output grammar by default (`grammar_capacity`): a state costs
# 12 bytes, a distinct token mask V/8, an exceptional move 8, the tokens' classes 4V. A JSON
# object of five strings of up to 20-50 characters takes 1,490 states, 98 masks and 13,411
# moves over the shipped tokenizer's 4,096 tokens, 200 masks and 32,713 moves over 128k.
GRAMMAR_STATES = 8192
GRAMMAR_MASK_BYTES = 4 << 20  # the masks: as many as this holds, within GRAMMAR_MASKS
GRAMMAR_MASKS = (256, 1024)
GRAMMAR_EDGES = 1 << 16


def grammar_capacity(states: int | None, edges: int | None, vocab_size: int,
                     masks: int | None = None) -> Capacity | None:
    """The `Capacity` (states, distinct token masks, exceptional moves) a slot's grammar may
    hold, or None (states 0: none). Each None: its default, GRAMMAR_STATES states, as many
    masks as GRAMMAR_MASK_BYTES hold (V/8 bytes each) within GRAMMAR_MASKS, GRAMMAR_EDGES
    moves: a slot's room (`Capacity.bytes`) is then 1.1 MiB at 4,096 tokens, 5.1 MiB at
    128k, 9.6 MiB at 256k (the masks take 4 MiB, or 256 masks' worth past 128k tokens: a
    larger vocabulary's longer tokens need no fewer distinct masks)."""
    for name, value in (("max_grammar_states", states), ("max_grammar_masks", masks), ("max_grammar_edges", edges)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    if states == 0:
        return None
    if masks == 0:
        raise ValueError("max_grammar_masks must be >= 1 where slots hold grammars (every state has a mask)")
    if masks is None:
        lo, hi = GRAMMAR_MASKS
        masks = min(hi, max(lo, GRAMMAR_MASK_BYTES // (4 * -(-vocab_size // 32))))
    return Capacity(GRAMMAR_STATES if states is None else states, masks, GRAMMAR_EDGES if edges is None else edges)


def page_pool(programs, kv_pages, kv_cache_bytes, page_size: int, mesh) -> tuple:
    """(an `Engine`'s PagePool, what its size was computed from), or (None, {}) unpaged:
    kv_pages pages (and the null page), or those a byte budget holds (`pages_within`)."""
    if kv_pages is None and kv_cache_bytes is None:
        return None, {}
    per_page, rest = programs.page_bytes()
    budget = {}
    if kv_cache_bytes is not None:
        kv_pages, budget = pages_within(programs, kv_cache_bytes, per_page, rest, mesh)
    pages = PagePool(int(kv_pages) + 1, int(page_size))
    budget["kv_cache_bytes"] = per_page * pages.num_pages  # every cache's, the null page too
    return pages, budget


def pages_within(programs, budget, per_page: int, rest: int, mesh) -> tuple[int, dict]:
    """(the pages a byte budget holds, what it was computed from), the pool then set to them
    (`Programs.set_pool`). budget: `Engine`'s kv_cache_bytes (bytes, "4GiB", or "auto");
    per_page, rest: `Programs.page_bytes`."""
    found = {}
    if budget == "auto":
        free = memory.device_free_bytes(mesh)
        if free is None:
            raise ValueError(f"kv_cache_bytes='auto' takes {KV_MEMORY_FRACTION:.0%} of the device's free memory, "
                             f"which this device ({jax.devices()[0].platform}) does not report: give "
                             f"kv_cache_bytes in bytes (e.g. '4GiB') or kv_pages")
        temporaries = programs.temporaries()
        held = int(KV_MEMORY_FRACTION * free) - rest - temporaries
        found = {"kv_budget_free_bytes": free, "kv_budget_temporary_bytes": temporaries}
        how = (f"{KV_MEMORY_FRACTION:.0%} of the {memory.readable(free)} free, less {memory.readable(rest)} of rows "
               f"and {memory.readable(temporaries)} of the programs' temporaries")
    else:
        held = memory.parse_bytes(budget)
        how = f"kv_cache_bytes={budget!r}"
    most = programs.slots * programs.table_width  # every slot at max_len
    pages = min(held // per_page - 1, most)
    if pages < 1:
        raise ValueError(f"{how} leaves {memory.readable(max(held, 0))} for pages of {memory.readable(per_page)} "
                         f"(every cache's {programs.paging[1]} positions): not one page beside the null page")
    programs.set_pool(pages + 1)
    return pages, found


def check_memory(programs, target) -> dict:
    """The state's bytes against what the devices have; refused with the numbers."""
    state = programs.state_bytes()
    weights = memory.nbytes(target.params) + memory.nbytes(programs.deepest)  # K's drafters share it
    mesh = programs.mesh
    free = memory.device_free_bytes(mesh)
    if free is not None and mesh is not None:  # rows and heads are split over the mesh's devices
        free *= mesh.devices.size
    if free is None:  # CPU: the host's memory holds the weights too
        capacity = memory.memory_capacity()
        free = None if capacity is None else capacity - weights
    if free is not None and state > free:
        raise memory.InsufficientMemoryError(
            f"Engine(slots={programs.slots}, max_len={programs.max_len}) needs {state / memory.GB:.2f} GB for its "
            f"caches and rows beside {weights / memory.GB:.2f} GB of weights; the device has "
            f"{free / memory.GB:.2f} GB free: use fewer slots or a shorter max_len")
    return {"state_bytes": state, "weight_bytes": weights, "free_bytes": free}


def default_chunk(mesh=None) -> int:
    """The prefill chunk of a paged engine given none: `PREFILL_CHUNK` of its devices' platform."""
    return PREFILL_CHUNK.get(Backend.of(None, mesh).platform, PREFILL_CHUNK_ELSEWHERE)
