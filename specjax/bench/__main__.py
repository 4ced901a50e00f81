"""`python -m specjax.bench`: the bench's command line (specjax.bench.command.main)."""

from specjax.bench.command import main

main()
