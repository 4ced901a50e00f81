"""specjax serve's start-up: `Engine.compile_all()` for the shipped pair (8 slots of 1,024, the
shipped draft), timed; "one" prefills requests one at a time (as before grouping), "grouped"
the default (1, 2, 4, 8 per call). One fresh process each:

    for m in one grouped; do PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/serve_startup.py $m; done
"""

import sys, time, specjax
from specjax.shipped import default_checkpoint
t = specjax.load_model(default_checkpoint("target"))
e = specjax.Engine(t, draft=specjax.load_drafter(default_checkpoint("draft")), slots=8, max_len=1024, steps_per_call=4)
if sys.argv[1] == "one":
    e.programs.prefill_sizes = (1,)
s = time.perf_counter(); e.compile_all()
print(sys.argv[1], len(e.programs.listing()), "programs listed", f"compile_all {time.perf_counter() - s:.1f} s")
