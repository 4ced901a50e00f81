"""Conversations over HTTP: a next turn resends the earlier turns, replies included. Two
`specjax serve` processes of the shipped pair (8 slots, max_len 1024, --kv-pages 512, prefix
caching on in both): one from this checkout, where a finished request's reply is cached as
far as its caches hold it, and one from --against (a commit whose prefix cache held prompts'
pages alone), both up before either is loaded, loaded in turn (--rounds). A load: 8
closed-loop clients, each one conversation of --turns turns (new ones each round); a turn's
prompt is the text of every earlier turn (prompt and reply) and --user new tokens of
held-out code, its reply --reply tokens (greedy, streamed). Printed per load: time to first token p50 and p99 of the
turns after the first, output tokens/s, and the prompt tokens the server reports cached;
then the medians over rounds and their ratios.

    PYTHONPATH=$PWD python docs/bench/serve_turns.py --against REV [--turns 4] [--user 32] [--reply 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time

import httpx
from serve_load import ROOT, one, prefix_figures, prefix_medians, settle, start

CLIENTS = 8


async def conversations(url: str, openings: list[str], users: list[list[str]], reply: int) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=CLIENTS + 4)) as client:
        async def talk(opening, said):
            history, turns = opening, []
            for i, user in enumerate([""] + said):
                history += user
                turns.append({**await one(client, url, "target", history, reply), "index": i})
                history += turns[-1]["text"]
            return turns

        began = time.perf_counter()
        results = await asyncio.gather(*(talk(o, u) for o, u in zip(openings, users)))
        return [t for turns in results for t in turns], time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="a commit whose prefix cache held prompts' pages alone")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user", type=int, default=32)
    parser.add_argument("--reply", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import specjax
    from specjax.train.data import held_out_prompts

    tokenizer = specjax.load_tokenizer(str(ROOT / "checkpoints/target"))

    def conversations_of(seed):  # (openings, each one's later user turns): new ones each round, none cached
        texts = [tokenizer.decode(p) for p in held_out_prompts(tokenizer, CLIENTS * args.turns, 128, seed=seed)]
        said = [tokenizer.decode(tokenizer.encode(t)[:args.user]) for t in texts[CLIENTS:]]
        return texts[:CLIENTS], [said[c * (args.turns - 1):(c + 1) * (args.turns - 1)] for c in range(CLIENTS)]

    servers, tree = {}, tempfile.mkdtemp(prefix="specjax-against-")
    subprocess.run(["git", "worktree", "add", "--detach", tree, args.against], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        for name, source in (("replies cached", None), ("prompts alone", tree)):
            servers[name] = start("checkpoints/draft", CLIENTS, ("--kv-pages", "512"), tree=source)
        runs = {name: [] for name in servers}
        for round_ in range(args.rounds):
            openings, users = conversations_of(1 + round_)
            for name, (_, url) in servers.items():
                settle()
                turns, seconds = asyncio.run(conversations(url, openings, users, args.reply))
                later = [t["chunks"][0] - t["start"] for t in turns if t["index"]]
                runs[name].append(prefix_figures(later, turns, seconds))
                print(f"{name}: {json.dumps({k: round(v, 1) for k, v in runs[name][-1].items()})}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
    print(f"# {' '.join(sys.argv)}")
    print(f"# shipped pair over HTTP, 8 slots of 1024 on 512 pages of 16; {CLIENTS} closed-loop conversations of "
          f"{args.turns} turns (a 128-token opening, then {args.user} new tokens a turn), {args.reply}-token replies; "
          f"time to first token of turns 2-{args.turns}; {args.rounds} rounds, medians")
    prefix_medians(runs, "replies cached", "prompts alone")


if __name__ == "__main__":
    main()
