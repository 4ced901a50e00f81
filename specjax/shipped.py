"""Where the shipped checkpoints are: checkpoints/NAME (target, draft, medusa, eagle,
datastore), found from the working directory or from the package's own clone. It knows
paths only: nothing of loading, models or the command line.
"""

from __future__ import annotations

from pathlib import Path


def default_checkpoint(name: str) -> str:
    """checkpoints/NAME in the working directory, else beside the installed package (an
    editable install from a clone). A model folder (config.json) or a drafter's (drafter.json)."""
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if any((root / "checkpoints" / name / f).exists() for f in ("config.json", "drafter.json")):
            return str(root / "checkpoints" / name)
    return str(Path("checkpoints") / name)
