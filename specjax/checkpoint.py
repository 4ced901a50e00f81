"""Orbax checkpoints of training state: params, optimizer state, step, and a JSON record
(model config, data seed and position, hyperparameters), resumable bit for bit.

Two checksums guard every step: a manifest of each of its files' SHA-256, written beside
the checkpoints (CHECKPOINTS.sha256/STEP.json) once orbax has finished, and a SHA-256 of
the state's arrays in its record. Restoring checks the files first (a missing, changed or
extra file is caught before orbax reads anything, so its readers never fail half-way),
then the arrays: a damaged step is never restored silently; the previous kept step is
restored instead, with a warning naming the bad one, and if none is good the restore
fails with one line naming the steps tried. Steps written before manifests existed are
checked by their arrays alone; a step of today's layout whose record lacks its checksum is
damaged (removing both checksums does not make an edit pass). Something other than a file
or folder where orbax first reads a step (its metadata) is refused outright: orbax would
block reading a FIFO before any check could run.

In a job of several processes (jax.distributed) every process saves and restores its own
shards of the state's global arrays; nothing is gathered to one host. The run directory
must then be one that every process sees (a shared file system).

It knows nothing about what is being trained; Hugging Face export lives in hf.py.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from specjax.sharding import barrier


class DamagedCheckpointError(ValueError):
    """No kept step of a run directory restores to the bytes that were saved."""


def state_digest(state: Any) -> str:
    """SHA-256 over a state pytree's arrays (each one's dtype, shape and bytes), independent
    of the tree's container types and order, so that a state restored into plain dicts hashes
    as the dataclasses it was saved from. An array spread over several processes is hashed
    where it lies (`_sharded_digest`: a collective, which every process calls), never
    gathered to one host."""
    leaves = []
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaves.append(_sharded_digest(leaf))
            continue
        a = np.ascontiguousarray(np.asarray(leaf))
        leaves.append(hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest())
    return hashlib.sha256("".join(sorted(leaves)).encode()).hexdigest()


def _sharded_digest(x: jax.Array) -> str:
    """A digest of a global array from its shards: the XOR of SHA-256(index, dtype, shape,
    bytes) over each distinct shard (replica 0 of each), combined across processes. The same
    in every process; it depends on how the array is split, so a run resumes on the mesh it
    was saved from."""
    from jax.experimental import multihost_utils

    mine = np.zeros(32, np.uint8)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            a = np.ascontiguousarray(np.asarray(shard.data))
            where = repr([(s.start, s.stop) for s in shard.index])
            h = hashlib.sha256(f"{a.dtype.str}{x.shape}{where}".encode() + a.tobytes()).digest()
            mine ^= np.frombuffer(h, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 32)
    return "sharded:" + np.bitwise_xor.reduce(every, axis=0).tobytes().hex()


def file_digests(folder: Path) -> dict[str, str]:
    """{path relative to folder: SHA-256 of its bytes} for every file under folder; anything
    that is not a regular file or folder is listed as such, never read."""
    digests = {}
    for path in sorted(Path(folder).rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            digests[name] = "not a regular file"
        elif path.is_file():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            digests[name] = h.hexdigest()
    return digests


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` holding {state pytree, JSON record}."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()  # orbax wants absolute paths
        for path in self.directory.glob("*/*") if self.directory.is_dir() else ():  # what orbax opens first
            if not (path.is_dir() or path.is_file()) or path.is_symlink():  # it would block on a FIFO
                raise DamagedCheckpointError(f"{path} in a run's checkpoints is not a regular file or folder; "
                                             f"refusing to read the run")
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self._intact: set[int] = set()  # steps whose files matched their manifest

    @property
    def _manifests(self) -> Path:
        return self.directory.with_name(self.directory.name + ".sha256")

    def save(self, step: int, state: Any, record: dict) -> None:
        """Saves the state (host or device arrays; each process writes the shards of a global
        array it holds) and the record. In a job of several processes every process calls
        it; process 0 writes the manifest once all have written."""
        record = {**record, "sha256": state_digest(state)}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)))
        self._manager.wait_until_finished()
        barrier(f"specjax checkpoint {step} written")
        if jax.process_index() == 0:
            self._manifests.mkdir(exist_ok=True)
            (self._manifests / f"{step}.json").write_text(json.dumps(file_digests(self.directory / str(step))))
            kept = {f"{s}.json" for s in self._manager.all_steps()}
            for manifest in self._manifests.iterdir():  # orbax deleted those steps
                if manifest.name not in kept:
                    manifest.unlink()
        barrier(f"specjax checkpoint {step} listed")

    def _check_files(self, step: int):
        """Raises ValueError naming the first file of `step` that differs from its manifest
        (each step is hashed once per manager: a record read and a restore share it)."""
        if step in self._intact:
            return
        manifest = self._manifests / f"{step}.json"
        if not manifest.exists():
            return  # written before manifests existed
        if not manifest.is_file():
            raise ValueError(f"its manifest {manifest} is not a regular file")
        expected = json.loads(manifest.read_text())
        found = file_digests(self.directory / str(step))
        for name in sorted(set(expected) | set(found)):
            if expected.get(name) != found.get(name):
                what = "is missing" if name not in found else "is not one it saved" if name not in expected \
                    else "has changed"
                raise ValueError(f"its file {name} {what}")
        self._intact.add(step)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, record) of `step` (default: the latest), or of the newest earlier kept step
        if that one is damaged (see the module docstring). abstract_state: the state's
        structure, or a function of the step's record that returns it."""
        def read(candidate):
            record = self._read_record(candidate)
            abstract = abstract_state(record) if callable(abstract_state) else abstract_state
            state = self._manager.restore(candidate, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract))).state
            expected = record.pop("sha256", None)
            if expected is None and record.get("layout", 1) >= 2:  # written since checksums exist
                raise ValueError("its record lacks the checksum every step of its layout is saved with")
            if expected is not None and state_digest(state) != expected:
                raise ValueError("its arrays do not match the checksum saved with them")
            return state, record
        return self._newest_intact(step, read)

    def record(self, step: int | None = None) -> dict:
        """The JSON record of `step` (default: the latest), or of the newest earlier kept step
        whose files are intact."""
        return self._newest_intact(step, self._read_record)

    def _read_record(self, step: int) -> dict:
        self._check_files(step)
        return dict(self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore())).record)

    def _newest_intact(self, step: int | None, read):
        """read(step) of `step` or, where it raises, of the next older kept step, warning
        about each damaged one."""
        latest = self.latest_step() if step is None else step
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        damaged = {}  # step -> why; warned about only if an older step restores
        for candidate in sorted((s for s in self._manager.all_steps() if s <= latest), reverse=True):
            try:
                out = read(candidate)
            except Exception as e:  # noqa: BLE001 -- any failure to read a step back is damage
                damaged[candidate] = " ".join(str(e).split())[:200] or type(e).__name__
                continue
            for step, why in damaged.items():
                warnings.warn(f"checkpoint step {step} in {self.directory} is damaged ({why}); restored step "
                              f"{candidate} instead", stacklevel=3)
            return out
        raise DamagedCheckpointError(f"no kept checkpoint step in {self.directory} restores intact (tried "
                                     + "; ".join(f"{s}: {why}" for s, why in damaged.items())
                                     + "); start a new run directory")

    def restore_saved(self, step: int | None = None) -> Any:
        """The state as it was saved (nested dicts and lists of arrays), without a target
        structure: for checkpoints whose structure is not today's."""
        step = self.latest_step() if step is None else step
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state

    def close(self):
        self._manager.close()
