"""Where the shipped checkpoints are: checkpoints/NAME (target, draft, medusa, eagle,
datastore), found from the working directory or from the package's own clone. It knows
paths only: nothing of loading, models or the command line.
"""

from __future__ import annotations

from pathlib import Path

NAMES = ("target", "draft", "medusa", "eagle", "eagle3", "datastore")


def default_checkpoint(name: str) -> str:
    """checkpoints/NAME in the working directory, else beside the installed package (an
    editable install from a clone). A model folder (config.json), a drafter's (drafter.json) or a
    datastore's (datastore.json)."""
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if any((root / "checkpoints" / name / f).exists() for f in ("config.json", "drafter.json", "datastore.json")):
            return str(root / "checkpoints" / name)
    return str(Path("checkpoints") / name)


def shipped_checkpoint(name: str) -> str:
    """The folder of the shipped checkpoint `name` (one of `NAMES`), wherever the working
    directory is: `specjax.load_model(specjax.shipped_checkpoint("target"))`. They ship in
    the repository's checkpoints/, not in the wheel: a FileNotFoundError says so where the
    package was not installed from a clone."""
    if name not in NAMES:
        raise ValueError(f"no shipped checkpoint {name!r}: they are {', '.join(NAMES)}")
    found = default_checkpoint(name)
    if not Path(found).is_dir():
        raise FileNotFoundError(f"the shipped checkpoint {name!r} is not here: the checkpoints ship in the "
                                f"repository's checkpoints/ folder, found beside a package installed from a clone "
                                f"(git clone ... && pip install -e .) or from the working directory")
    return found
