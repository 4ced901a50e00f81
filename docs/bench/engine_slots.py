"""A paged engine of many slots built and compiled whole (`compile_all`), then serving a burst:
the seconds its compile took and the process's memory mappings before and after (Linux's
vm.max_map_count is 65,530 by default; each CPU executable holds hundreds).

    SLOTS=64 python docs/bench/engine_slots.py SOURCE_TREE [tiny|shipped]

SOURCE_TREE: the checkout whose specjax runs (a worktree of another revision to compare);
tiny: tests/tiny.py's Llama (max_len 128), shipped: checkpoints/ (max_len 1024).
"""
import os, sys, time, tempfile
os.environ.setdefault("JAX_PLATFORMS", "cpu")
root = sys.argv[1]
sys.path.insert(0, root)
import numpy as np, specjax
which = sys.argv[2] if len(sys.argv) > 2 else "tiny"
if which == "tiny":
    from tests import tiny
    d = tempfile.mkdtemp(); tiny.build("llama").save_pretrained(d)
    target = specjax.load_model(d); draft = tiny.noisy(target, 0.002, 1); max_len = 128
else:
    target = specjax.load_model(os.path.join(root, "checkpoints/target"))
    draft = specjax.DraftModel.load(os.path.join(root, "checkpoints/draft")); max_len = 1024
maps = lambda: sum(1 for _ in open("/proc/self/maps"))
before = maps()
start = time.perf_counter()
engine = specjax.Engine(target, draft=draft, slots=int(os.environ.get("SLOTS", 64)), max_len=max_len, kv_cache_bytes="64MiB")
engine.compile_all()
took = time.perf_counter() - start
print(f"{which}: compile_all of {engine.slots} slots {took:.1f} s, memory mappings {before} -> {maps()}, programs "
      f"{len(engine.stats()['programs'])}", flush=True)
with engine:
    rs = [engine.submit([int(t) for t in np.random.default_rng(i).integers(3, 90, 5 + i % 20)], max_new_tokens=8)
          for i in range(80)]
    print("served", sum(len(r.result(timeout=600)) for r in rs), "tokens for 80 requests", flush=True)
