"""Where a plain `specjax serve` spends its Python time under serve_load's 8-client load: the
server's threads sampled by py-spy (200 Hz, non-blocking, active samples only) during three
loads after a warm one, by thread and by innermost function; the load's throughput under the
sampler (it slows the server); and the CPU seconds this load's own client process used.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/serve_spy.py   # needs py-spy (pip install py-spy)
"""

import asyncio
import collections
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

import serve_load as S  # noqa: E402

RATE, SECONDS, OUT = 200, 8, "/tmp/serve_spy.txt"


def main():
    proc, url = S.start("none", 8)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        texts = S.prompts(32)
        asyncio.run(S.load(url, model, texts, 8, float("inf"), 128, 0))  # warm
        S.settle()
        spy = subprocess.Popen(["py-spy", "record", "-p", str(proc.pid), "-r", str(RATE), "--threads", "-f", "raw",
                                "-o", OUT, "-d", str(SECONDS), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        client_cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(3):
            results, seconds = asyncio.run(S.load(url, model, texts, 8, float("inf"), 128, 0))
            print(f"8 clients under the sampler: {S.summary(results, seconds)['output_tok_per_s']:.0f} tok/s")
        client_cpu, wall = time.process_time() - client_cpu, time.perf_counter() - wall
        spy.wait()
    finally:
        proc.terminate()
        proc.wait()
    threads, leaves = collections.Counter(), collections.Counter()
    for line in open(OUT):
        stack, _, count = line.strip().rpartition(" ")
        if stack:
            frames = stack.split(";")
            threads[frames[0]] += int(count)
            leaves[frames[0].split(": ")[-1], frames[-1]] += int(count)
    print(f"active samples in {SECONDS} s at {RATE} Hz, by thread (seconds = samples / {RATE}):")
    for thread, n in threads.most_common():
        print(f"  {n / RATE:5.2f} s  {thread}")
    print("by innermost function:")
    for (thread, frame), n in leaves.most_common(8):
        print(f"  {n / RATE:5.2f} s  {thread}: {frame}")
    print(f"the load's client process: {client_cpu:.2f} CPU s in {wall:.2f} s of loads ({client_cpu / wall:.2f} of a core)")


if __name__ == "__main__":
    main()
