"""The environment of the child processes that the sharding, multi-process and notebook
tests start: the parent's, with XLA's CPU backend told to compile without LLVM's
optimisations. Those children compile many programs and run each for a few tiny steps, so
compiling is nearly all their time; at `--xla_backend_optimization_level=0` sharded_check.py
takes about 40% less CPU time and its findings are the same, to the bit (the HLO passes,
sharding and buffer assignment are XLA's own, not LLVM's). The suite's own processes keep
XLA's defaults: the exactness tests are about the programs users run."""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a child: the parent's, FAST_COMPILE and these."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), FAST_COMPILE, *flags]).strip()


def env(**extra: str) -> dict:
    """The parent's environment with the child's XLA_FLAGS, and `extra`."""
    return {**os.environ, "XLA_FLAGS": xla_flags(), **extra}
