"""`python -m specjax.tools.bench`: the bench's command line (specjax.tools.bench.command.main)."""

from specjax.tools.bench.command import main

main()
