"""Beyond one host: two processes on this machine join one `jax.distributed` job (gloo CPU
collectives, 4 emulated devices each) and run specjax on one (data=2, model=4) mesh over
all 8 devices, as one process per host would on a TPU pod slice or a GPU cluster
(tests/multihost_child.py does each process's part)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import children

CHILD = Path(__file__).with_name("multihost_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(job: str, out_dir: Path) -> list[subprocess.Popen]:
    """JOB started in two processes (tests/multihost_child.py), their output piped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = children.env(PYTHONPATH=str(CHILD.parent.parent))
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(CHILD), job, str(i), "2", str(port), str(out_dir)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]


def _run_job(job: str, out_dir: Path, timeout: float = 540) -> list[str]:
    """Runs JOB in two processes to the end; returns their outputs. Skips where gloo is
    unavailable."""
    procs = _start(job, out_dir)
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    if any("gloo" in o.lower() and ("not" in o.lower() and "support" in o.lower()) for o in outputs):
        reason = next(o for o in outputs if "gloo" in o.lower())[-300:]
        pytest.skip(f"this jaxlib has no gloo CPU collectives: {reason}")
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-3000:]
    return outputs


@pytest.mark.slow  # the suite's time on 2 cores (-m slow runs it)
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


def _command(args: list[str]) -> list[str]:
    """`specjax ARGS --coordinator ...` in two processes (4 CPU devices each); both must end
    cleanly. Returns their stdouts without gloo's own lines (its C++ prints its connections
    there, "[Gloo] Rank ...", and its threads' lines can interleave: a line with any piece
    of one is dropped)."""
    port = _free_port()
    env = children.env(XLA_FLAGS=children.xla_flags("--xla_force_host_platform_device_count=4"),
                       JAX_PLATFORMS="cpu", PYTHONPATH=str(CHILD.parent.parent))
    procs = [subprocess.Popen([sys.executable, "-m", "specjax.cli", *args, "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=540) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return ["".join(line for line in out.splitlines(keepends=True) if "[Gloo]" not in line and "peer ranks" not in line)
            for out, _ in outs]


@pytest.mark.slow
def test_the_command_runs_on_two_processes_and_prints_once(tmp_path):
    """`specjax generate --mesh 2,4 --coordinator ...` in two processes: process 0 prints
    the result, process 1 nothing; both end cleanly."""
    printed, silent = _command(["generate", "def read(path):", "--mesh", "2,4", "--batch-file",
                                str(_two_prompts(tmp_path)), "--max-new-tokens", "8", "--json"])
    printed = json.loads(printed)
    assert printed["stats"]["batch"] == 2 and all(row["num_tokens"] == 8 for row in printed["outputs"])
    assert not silent.strip()


def _two_prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("class Stack:\n")
    return path


@pytest.mark.slow  # test_train resumes on one process; the train command runs on two here
def test_training_on_two_processes_resumes_from_its_own_shards(tmp_path):
    """A tiny model trained on the (2, 4) mesh by two processes, each checkpointing its own
    shards: killed (both processes) once a checkpoint is written and restarted, it ends with
    the params an unbroken two-process run ends with, in both processes."""
    import numpy as np

    assert not any("resumed" in o for o in _run_job("train", tmp_path / "straight"))
    broken = tmp_path / "broken"
    procs = _start("train", broken)
    manifests = broken / "run" / "checkpoints.sha256"
    try:
        while not (manifests.exists() and any(manifests.iterdir())):
            assert all(p.poll() is None for p in procs), "the run ended before its first checkpoint"
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # both restarted processes resume (not retrain from scratch, which would end alike too)
    assert all("resumed from step" in o for o in _run_job("train", broken))
    for i in range(2):
        a, b = np.load(tmp_path / "straight" / f"params_{i}.npz"), np.load(broken / f"params_{i}.npz")
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"process {i}: {name}")


@pytest.mark.slow
def test_the_train_command_runs_on_two_processes(tmp_path):
    """`specjax train --mesh 2,4 --coordinator ...` in two processes: one run directory,
    process 0 prepares the data first and alone exports the model, which loads."""
    import specjax

    flags = ["--out", str(tmp_path / "run"), "--steps", "2", "--batch", "4", "--seq-len", "16", "--vocab", "300",
             "--hidden", "32", "--layers", "1", "--heads", "4", "--kv-heads", "4", "--intermediate", "64",
             "--eval-every", "2", "--checkpoint-every", "1", "--mesh", "2,4"]
    outs = _command(["train", *flags])
    assert "exported to" in outs[0] and "exported to" not in outs[1]
    assert specjax.load_model(tmp_path / "run" / "hf").config.hidden_size == 32


@pytest.mark.slow
def test_the_heads_command_runs_on_two_processes(tmp_path):
    """`specjax train-eagle --eagle3 --mesh 2,4 --coordinator ...` in two processes: the
    shipped target sharded, the heads replicated; process 0 alone saves them, and they load."""
    import specjax

    flags = ["--eagle3", "--target", str(CHILD.parent.parent / "checkpoints" / "target"), "--out",
             str(tmp_path / "run"), "--steps", "2", "--batch", "4", "--seq-len", "32", "--eval-every", "2",
             "--probe-prompts", "2", "--mesh", "2,4"]
    outs = _command(["train-eagle", *flags])
    assert "saved to" in outs[0] and "saved to" not in outs[1]
    assert isinstance(specjax.load_drafter(tmp_path / "run" / "drafter"), specjax.Eagle3)
