"""specjax serve's start-up: `Engine.compile_all()` for the shipped pair (8 slots of 1,024, the
shipped draft), timed; "one" prefills requests one at a time (as before grouping), "grouped"
the default (1, 2, 4, 8 per call), all compiled before serving, "background" as `specjax
serve` does since 2026-11-26: `compile_all(groups_later=True)`, the grouped prefills compiled
in a background thread once the engine can serve (the time until it can, then until the
background is done). One fresh process each:

    for m in one grouped background; do PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/serve_startup.py $m; done
"""

import sys, time, specjax
from specjax.shipped import default_checkpoint
t = specjax.load_model(default_checkpoint("target"))
e = specjax.Engine(t, draft=specjax.load_drafter(default_checkpoint("draft")), slots=8, max_len=1024, steps_per_call=4)
mode = sys.argv[1]
if mode == "one":
    e.programs.prefill_sizes = (1,)
s = time.perf_counter(); e.compile_all(groups_later=mode == "background"); ready = time.perf_counter() - s
line = f"{mode} {len(e.programs.listing())} programs listed compile_all {ready:.1f} s"
if mode == "background":
    while e.stats()["compiling"] and e.compile_error is None:
        time.sleep(0.1)
    line += f", the background's {2 * len(e.programs.groups())} programs done at {time.perf_counter() - s:.1f} s"
print(line)
