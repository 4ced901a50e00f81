"""`specjax.__version__`: the installed package's version (its metadata), else, run from a
source checkout that is not installed, the version pyproject.toml beside it declares."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def source_version(pyproject: Path = PYPROJECT) -> str:
    """[project] version of a pyproject.toml; "unknown" where there is none."""
    try:
        text = pyproject.read_text()
    except OSError:
        return "unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = project and re.search(r"^version\s*=\s*[\"']([^\"']+)[\"']", project.group(1), re.M)
    return found.group(1) if found else "unknown"


def version() -> str:
    try:
        return metadata.version("specjax")
    except metadata.PackageNotFoundError:
        return source_version()


__version__ = version()
