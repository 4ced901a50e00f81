"""Orbax checkpoints of training state: params, optimizer state, step, and a JSON record
(model config, data seed and position, hyperparameters), resumable bit for bit.

Each step's record carries a SHA-256 of the state's bytes. Restoring recomputes it: a step
whose files were damaged (bytes changed, files missing or unreadable) is never restored
silently; the previous kept step is restored instead, with a warning naming the bad one,
and if none is good the restore fails with one line naming the steps tried.

It knows nothing about what is being trained; Hugging Face export lives in hf.py.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class DamagedCheckpointError(RuntimeError):
    """No kept step of a run directory restores to the bytes that were saved."""


def state_digest(state: Any) -> str:
    """SHA-256 over a state pytree's arrays (each one's dtype, shape and bytes), independent
    of the tree's container types and order, so that a state restored into plain dicts hashes
    as the dataclasses it was saved from."""
    leaves = []
    for leaf in jax.tree.leaves(jax.device_get(state)):
        a = np.ascontiguousarray(np.asarray(leaf))
        leaves.append(hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest())
    return hashlib.sha256("".join(sorted(leaves)).encode()).hexdigest()


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` holding {state pytree, JSON record}."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()  # orbax wants absolute paths
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, state: Any, record: dict) -> None:
        record = {**record, "sha256": state_digest(state)}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)))
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state shaped like abstract_state, record) of `step` (default: the latest), or of
        the newest earlier kept step if that one is damaged (see the module docstring)."""
        latest = self.latest_step() if step is None else step
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        tried = []
        for candidate in sorted((s for s in self._manager.all_steps() if s <= latest), reverse=True):
            try:
                out = self._manager.restore(candidate, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()))
                state, record = out.state, dict(out.record)
                expected = record.pop("sha256", None)
                if expected is not None and state_digest(state) != expected:
                    raise ValueError("its arrays do not match the checksum saved with them")
            except Exception as e:  # noqa: BLE001 -- any failure to read a step back is damage
                why = " ".join(str(e).split())[:200] or type(e).__name__
                tried.append(candidate)
                warnings.warn(f"checkpoint step {candidate} in {self.directory} is damaged ({why}); "
                              f"trying the previous kept step", stacklevel=2)
                continue
            return state, record
        raise DamagedCheckpointError(f"no kept checkpoint step in {self.directory} restores intact (tried "
                                     f"{', '.join(map(str, tried))}); start a new run directory")

    def restore_saved(self, step: int | None = None) -> Any:
        """The state as it was saved (nested dicts and lists of arrays), without a target
        structure: for checkpoints whose structure is not today's."""
        step = self.latest_step() if step is None else step
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state

    def record(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record

    def close(self):
        self._manager.close()
