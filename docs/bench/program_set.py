"""The engine's program set by slots, and what a narrower run saves on this device: the
shipped pair (float32, paged, chunked prefill of 256, 1,024 positions), its programs listed
at 8, 32, 64 and 1,024 slots (`Engine(...).programs.listing()`, nothing compiled) with their
run widths; then one step of each width at 8 slots, K = 0 and K = 4 (`timing.step_costs`: the
median of 5 calls, its first `width` rows live).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/program_set.py
"""

import collections

import specjax
from specjax.serve import timing
from specjax.shipped import default_checkpoint

target = specjax.load_model(default_checkpoint("target"))
draft = specjax.load_drafter(default_checkpoint("draft"))
for slots in (8, 32, 64, 1024):
    programs = specjax.Engine(target, draft=draft, slots=slots, max_len=1024, kv_cache_bytes="64MiB",
                              prefill_chunk=256).programs
    kinds = collections.Counter(name.split()[0] for name in programs.listing())
    print(f"{slots} slots: {sum(kinds.values())} programs ({kinds['admit']} admissions, {kinds['run']} runs); "
          f"widths {programs.widths}, prefill groups {programs.prefill_sizes}")
engine = specjax.Engine(target, draft=draft, slots=8, max_len=1024, kv_cache_bytes="64MiB",
                        num_draft_tokens=(4,) * 4 + (0,) * 4)
for K, by_width in timing.step_costs(engine.programs).items():
    print(f"8 slots, K={K}: ms per step by width " + ", ".join(f"{w}: {ms:.1f}" for w, ms in by_width.items()))
