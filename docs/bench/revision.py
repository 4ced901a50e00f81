"""`checked_out(rev)`: a git revision of this repository in a temporary worktree, for the
benchmarks that run it beside the working tree (serve_against.py, step_against.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def checked_out(rev: str):
    """Yields the path of a detached worktree at `rev`; removes it on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "old")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
