"""A cold `specjax serve` of the shipped pair at its defaults, timed from launch: when the
port first answers, and when the first completion (16 greedy tokens) comes back; each start
on an empty compilation cache, the tree given on the command line against another (a git
worktree) in turn.

    python docs/bench/serve_first_answer.py [--against TREE] [--rounds N]

Prints a line per start and the medians. It knows the command line and HTTP only.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Path) -> tuple[float, float]:
    """(seconds to the port's first answer, seconds to the first completion) of one cold start."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as cache:
        launched = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", str(tree / "checkpoints/target"),
                                 "--draft", str(tree / "checkpoints/draft"), "--port", str(port),
                                 "--compilation-cache", cache], cwd=tree, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, bound = f"http://127.0.0.1:{port}", None
        try:
            while True:
                assert proc.poll() is None, "the server exited"
                try:
                    httpx.get(url + "/health", timeout=1)
                    bound = time.perf_counter() - launched
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            r = httpx.post(url + "/v1/completions", json={"prompt": "def fibonacci(n):", "max_tokens": 16,
                                                          "temperature": 0}, timeout=900)
            assert r.status_code == 200, r.text
            return bound, time.perf_counter() - launched
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another tree (e.g. a git worktree of the parent)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"this tree": HERE, **({"against": args.against.resolve()} if args.against else {})}
    times = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            bound, answered = start(tree)
            times[name].append((bound, answered))
            print(f"round {r + 1}, {name} ({tree}): port answers at {bound:.1f} s, first completion at "
                  f"{answered:.1f} s", flush=True)
    for name, runs in times.items():
        print(f"{name}: median port {statistics.median(b for b, _ in runs):.1f} s, first completion "
              f"{statistics.median(a for _, a in runs):.1f} s")


if __name__ == "__main__":
    main()
