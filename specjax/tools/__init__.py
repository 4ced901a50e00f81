"""The tools around the library: what measures, plans and compiles specjax's programs, not
what runs them.

    specjax.tools.measure    timing and statistics of `generate` (medians, pass costs, runs)
    specjax.tools.bench      `specjax bench`: the pair side by side, its sections, cost profiles
    specjax.tools.synthetic  a random pair of any size, timed against its weight-read roofline
    specjax.tools.plan       `specjax plan`: before renting a TPU or a GPU, the program compiled
                             for it here, and whether it fits
    specjax.tools.aot        programs compiled ahead of time for TPU slices and GPUs from any
                             machine (a static Backend of their platform), and their figures
    specjax.tools.hlo        reading optimised HLO text: large copies, the bytes kernels move
    specjax.tools.notebook   the Colab notebooks' helpers (small mode, side-by-side timing)

The rule: the library's core (everything in specjax outside tools/) never imports
specjax.tools, at module level or inside a function; the command line (specjax/cli.py and
its subcommands) is the tools' front door and may. tests/test_house.py checks it. What a
tool needs from the core it imports; what the core needs (the held-out prompts, acceptance
from a trace) lives in the core and the tools re-export it.
"""
