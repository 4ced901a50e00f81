"""Orbax checkpoints of training state: params, optimizer state, step, and a JSON record
(model config, data seed and position, hyperparameters), resumable bit for bit.

It knows nothing about what is being trained; Hugging Face export lives in hf.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` holding {state pytree, JSON record}."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()  # orbax wants absolute paths
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def save(self, step: int, state: Any, record: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)))
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state shaped like abstract_state, record) of `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), record=ocp.args.JsonRestore()))
        return out.state, out.record

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
