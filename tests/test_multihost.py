"""Beyond one host: two processes on this machine join one `jax.distributed` job (gloo CPU
collectives, 4 emulated devices each) and run specjax on one (data=2, model=4) mesh over
all 8 devices, as one process per host would on a TPU pod slice or a GPU cluster
(tests/multihost_child.py does each process's part)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("multihost_child.py")


def _run_job(job: str, out_dir: Path, timeout: float = 540, env: dict | None = None) -> list[str]:
    """Runs JOB in two processes; returns their outputs. Skips where gloo is unavailable."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(CHILD.parent.parent), **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(CHILD), job, str(i), "2", str(port), str(out_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    if any("gloo" in o.lower() and ("not" in o.lower() and "support" in o.lower()) for o in outputs):
        pytest.skip("this jaxlib has no gloo CPU collectives: " + next(o for o in outputs if "gloo" in o.lower())[-300:])
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-3000:]
    return outputs


def test_speculative_generate_on_two_processes_equals_one_device(tmp_path):
    """The shipped pair, a chain and a tree: every process reads (specjax.gather) exactly
    the tokens one process on one device gives; stream= is called in process 0 only, with
    every token."""
    _run_job("generate", tmp_path)
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert (r["devices"], r["local"]) == (8, 4)
        for shape in ("chain", "tree"):
            assert r[shape]["sharded"] == r[shape]["alone"], (r["process"], shape)
            assert r[shape]["counts"] == [24, 24]
    for shape in ("chain", "tree"):
        assert results[0][shape]["stream_calls"] > 0 and results[0][shape]["streamed"] == 48
        assert results[1][shape]["stream_calls"] == 0
