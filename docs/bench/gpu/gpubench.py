"""GPU measurements of specjax, held out from the developers (CEO's workshop).

python gpubench.py shipped            # the shipped pair in bfloat16: AR vs drafters, exactness
python gpubench.py synth --size 1b    # a Llama-shaped random pair: roofline, pass-cost curve,
                                      # AR/spec tok/s, batch, and transformers on the same weights
python gpubench.py selfdraft          # the shipped target drafting for itself (greedy)
python gpubench.py attention --size 1b  # Model.attention portable vs kernels: passes, generation
Prints a table last; writes JSON to $OUT (or /tmp) when set.

Adapted from /work/shared/gpu/gpubench.py (written for f58689a, stacked [L, ...] layers) to
the per-layer layout: the synthetic pair is specjax.tools.synthetic.build_synthetic_pair (--size
1b/8b/tiny = llama-1b/llama-8b/llama-tiny) and the weights-only chain is
specjax.tools.synthetic.weights_only_time; the rest is as it was (see README.md here).
"""
import argparse
import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.tools.measure import median_time
from specjax.tools.synthetic import SIZES as SYNTHETIC_SIZES
from specjax.tools.aot import pass_reads
from specjax.cache import KVCache
from specjax.models import apply
from specjax.tools.synthetic import build_synthetic_pair, read_bandwidth, weight_bytes, weights_only_time

OUT = os.environ.get("OUT", "/tmp")
RESULTS = {}


def log(*a):
    print(*a, flush=True)


def gen(target, prompts, draft=None, K=None, max_new=256, temperature=0.0, batch=None, **kw):
    """Times every prompt, in batches of `batch` (default: all at once)."""
    batch = batch or len(prompts)
    padded = [specjax.pad_prompts(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]
    out = {}

    def call():
        out["o"] = [jax.block_until_ready(specjax.generate(
            target, p, l, draft=draft, key=jax.random.key(0), max_new_tokens=max_new,
            num_draft_tokens=K, temperature=temperature, **kw)) for p, l in padded]

    t = median_time(call, 3)
    outs = [jax.tree.map(np.asarray, o) for o in out["o"]]
    rows = [o.tokens[b, : o.num_tokens[b]].tolist() for o in outs for b in range(o.tokens.shape[0])]
    tot = lambda f: int(sum(f(o).sum() for o in outs))  # noqa: E731
    toks, steps = tot(lambda o: o.num_tokens), tot(lambda o: o.stats.steps)
    return dict(s=t, tok_s=toks / t, tok_per_pass=toks / max(steps, 1), rows=rows,
                accepted=tot(lambda o: o.stats.accepted), drafted=tot(lambda o: o.stats.drafted))


def diverged(rows, ref):
    n = 0
    first = []
    for a, b in zip(rows, ref):
        if a != b:
            n += 1
            first.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return n, first


# --size -> specjax.tools.synthetic's size. The script's own build_pair (f58689a) made the same
# shapes; differences of build_synthetic_pair: weights drawn in the requested dtype (not
# float32 then cast), faint layers' o/down kernels x0.01 (not x0.05), llama-tiny's
# max_position_embeddings 512 and default rope_theta (rotary is computed, not tabled, so
# the 4096-slot cache pass still runs).
SIZE_MAP = {"tiny": "llama-tiny", "1b": "llama-1b", "8b": "llama-8b"}


def build_pair(size, draft_layers, dtype, seed=0):
    """(target, draft): specjax.tools.synthetic's random pair of `size` (a key of SIZE_MAP, or any
    specjax.tools.synthetic.SIZES name): the target's layers past `draft_layers` write faintly into
    the residual stream, and the draft is its own first layers + head (shared arrays)."""
    return build_synthetic_pair(SIZE_MAP.get(size, size), draft_layers, seed=seed, dtype=dtype)


def synth(args):
    from specjax.tools.measure import pass_time

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    t0 = time.time()
    target, draft = build_pair(args.size, args.draft_layers, dtype)
    jax.block_until_ready(target.params)
    log(f"built {args.size} pair in {time.time() - t0:.1f}s: target {weight_bytes(target) / 1e9:.2f} GB, "
        f"draft {weight_bytes(draft) / 1e9:.2f} GB ({args.dtype})")
    R = RESULTS.setdefault(f"synth-{args.size}", {})
    bw = read_bandwidth()
    R["bandwidth_GBps"] = bw / 1e9
    roof = bw / pass_reads(target)  # the weights a pass reads (an untied embedding: its rows only)
    R["roofline_tok_s_b1"] = roof
    log(f"measured bandwidth {bw / 1e12:.2f} TB/s -> weight-read roofline {roof:.0f} tok/s at batch 1")
    cache_len = 1024
    for cl in (256, 4096):
        R[f"pass1_ms_cache{cl}"] = pass_time(target, 1, 1, cl, 3) * 1e3
        log(f"one-token pass with a {cl}-slot cache: {R[f'pass1_ms_cache{cl}']:.3f} ms")
    curve = {}
    for T in args.pass_tokens:
        curve[T] = pass_time(target, 1, T, cache_len, 3)
    R["pass_ms_b1"] = {T: v * 1e3 for T, v in curve.items()}
    cd = pass_time(draft, 1, 1, cache_len, 3)
    R["weights_only_ms"] = weights_only_time(target, 3) * 1e3
    log(f"weights-only matmul chain (every weight read once, 1 token): {R['weights_only_ms']:.3f} ms")
    R["draft_step_over_target_pass"] = cd / curve[1]
    log("pass cost, batch 1 (ms): " + ", ".join(f"T={T}: {v * 1e3:.3f}" for T, v in curve.items()))
    log(f"one-token target pass {curve[1] * 1e3:.3f} ms = {1 / curve[1]:.0f} passes/s "
        f"({curve[1] * roof * 100:.0f}% of... roofline time {1e3 / roof:.3f} ms); draft step c = {cd / curve[1]:.3f}")
    rng = np.random.RandomState(0)
    rows = []
    for B in args.batches:
        prompts = [list(rng.randint(0, target.config.vocab_size, 32)) for _ in range(B)]
        ar = gen(target, prompts, max_new=args.max_new)
        rows.append(("AR", B, "-", ar["tok_s"], 1.0, 1.0, "-"))
        R[f"ar_b{B}"] = {k: v for k, v in ar.items() if k != "rows"}
        log(f"B={B} AR {ar['tok_s']:.1f} tok/s ({ar['tok_s'] / B / roof * 100:.0f}% of roofline per row)")
        for K in args.ks:
            sp = gen(target, prompts, draft=draft, K=K, max_new=args.max_new)
            n, first = diverged(sp["rows"], ar["rows"])
            rows.append((f"draft K={K}", B, f"{sp['tok_per_pass']:.2f}", sp["tok_s"], sp["tok_s"] / ar["tok_s"],
                         sp["accepted"] / max(sp["drafted"], 1), f"{n}/{B}"))
            R[f"spec_b{B}_k{K}"] = {k: v for k, v in sp.items() if k != "rows"} | {"diverged": n, "first": first}
            log(rows[-1])
        if B == 1 and args.tree:
            tr = specjax.DraftModel(draft, tree=specjax.Tree(*args.tree))
            sp = gen(target, prompts, draft=tr, max_new=args.max_new)
            n, first = diverged(sp["rows"], ar["rows"])
            rows.append((f"draft Tree{tuple(args.tree)}", B, f"{sp['tok_per_pass']:.2f}", sp["tok_s"],
                         sp["tok_s"] / ar["tok_s"], sp["accepted"] / max(sp["drafted"], 1), f"{n}/{B}"))
            R[f"tree_b{B}"] = {k: v for k, v in sp.items() if k != "rows"} | {"diverged": n}
            log(rows[-1])
        if B == 1:
            R["ar_rows_b1"] = ar["rows"]
    if args.hf:
        rows += hf_compare(target, draft, args, R)
    log("\n%-22s %4s %8s %10s %8s %7s %6s" % ("what", "B", "tok/pass", "tok/s", "vs AR", "accept", "diverg"))
    for r in rows:
        log("%-22s %4s %8s %10.1f %8.2f %7.2f %6s" % r)
    log(f"roofline (weights only, batch 1): {roof:.0f} tok/s")

ATTENTION_CASES = ((1, 1, 1024), (1, 6, 1024), (8, 1, 8192), (8, 6, 8192))  # (B, T, S): issue 37's bars


# The attention modes timed: (Model.attention, whether cuDNN is hidden). Where cuDNN is
# installed, "kernels" gives it every pass it applies to, cached passes of one or six tokens
# included (specjax.models.attention.choose); "prefix" hides it, so that cached passes take the
# Pallas prefix kernel (and full passes, prefill, the portable path).
MODES = {"portable": ("portable", False), "kernels": ("kernels", False), "prefix": ("kernels", True)}


@contextlib.contextmanager
def attending(mode: str):
    """Model.attention for `mode` (MODES), with cuDNN hidden for "prefix"; jit's caches are
    cleared on the way in and out (the model's key is the same as in "kernels")."""
    from specjax.models import attention as paths

    attention, hide = MODES[mode]
    real = paths._cudnn_available
    jax.clear_caches()
    if hide:
        paths._cudnn_available = lambda: False
    try:
        yield attention
    finally:
        paths._cudnn_available = real
        jax.clear_caches()


def attention(args):
    """Model.attention "portable" against "kernels" (cuDNN where it is installed) and
    "prefix" (the Pallas prefix kernel for cached passes: MODES): each pass of
    ATTENTION_CASES[:args.cases] (B rows, T tokens, an S-slot cache half full, as
    measure.pass_time runs it) timed, over what it must read (the weights once, the live
    cache once) at the measured bandwidth; then greedy generation (AR, draft K=5) in each
    mode and the rows where its output differs from the portable path's."""
    from specjax.tools.measure import pass_time

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    target, draft = build_pair(args.size, args.draft_layers, dtype)
    c = target.config
    W = pass_reads(target)
    bw = read_bandwidth()
    R = RESULTS.setdefault(f"attention-{args.size}", {"bandwidth_GBps": bw / 1e9, "pass_reads_GB": W / 1e9})
    log(f"{args.size}: a pass reads {W / 1e9:.2f} GB of weights, measured bandwidth {bw / 1e12:.2f} TB/s")
    # Each mode's logits of one cached pass (6 tokens, 8 rows over a random half-full cache of
    # 1,024 slots) against the portable path's: cuDNN reads the head-major cache in its BNSH
    # layout since 0618341, compiled before, never run.
    B, T, S = 8, 6, 1024
    keys = jax.random.split(jax.random.key(1), 2 * c.num_layers)
    filled = KVCache.init(c, B, S, dtype)
    filled = filled.replace(k=tuple(jax.random.normal(k, x.shape, dtype) for k, x in zip(keys[::2], filled.k)),
                            v=tuple(jax.random.normal(k, x.shape, dtype) for k, x in zip(keys[1::2], filled.v)))
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, c.vocab_size, (B, T)), jnp.int32)
    positions = S // 2 + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits = {}
    for mode in MODES:
        with attending(mode) as attention_mode:
            logits[mode] = np.asarray(jax.jit(lambda m, cache: apply(m, tokens, positions, cache)[0])(
                target.replace(attention=attention_mode), filled), np.float32)
        R[f"{mode}_logits_maxdiff"] = float(np.abs(logits[mode] - logits["portable"]).max())
        R[f"{mode}_argmax_agree"] = float((logits[mode].argmax(-1) == logits["portable"].argmax(-1)).mean())
        log(f"{mode:8s} a cached pass (B={B} T={T} S={S}) against portable: max |logit diff| "
            f"{R[f'{mode}_logits_maxdiff']:.4f}, argmax agrees on {R[f'{mode}_argmax_agree']:.3f} of tokens")
    for B, T, S in ATTENTION_CASES[:args.cases]:
        live = KVCache.nbytes(c, B, S // 2, dtype)
        floor = (W + live) / bw
        for mode in MODES:
            with attending(mode) as attention_mode:
                t = pass_time(target.replace(attention=attention_mode), B, T, S, 3)
            R[f"{mode}_b{B}_t{T}_s{S}"] = {"ms": t * 1e3, "over_bytes": t / floor}
            log(f"{mode:8s} B={B} T={T} S={S}: {t * 1e3:.3f} ms, {t / floor:.2f}x the {floor * 1e3:.3f} ms "
                f"to read weights + live cache ({live / 1e9:.2f} GB)")
    if not args.max_new:
        return
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, c.vocab_size, 32)) for _ in range(1)]
    ref = None
    for mode in MODES:
        with attending(mode) as attention_mode:
            t, d = target.replace(attention=attention_mode), draft.replace(attention=attention_mode)
            ar = gen(t, prompts, max_new=args.max_new)
            sp = gen(t, prompts, draft=d, K=5, max_new=args.max_new)
        ref = ref or ar["rows"]
        R[f"{mode}_gen"] = {"ar_tok_s": ar["tok_s"], "k5_tok_s": sp["tok_s"], "k5_tok_per_pass": sp["tok_per_pass"],
                            "ar_diverged": diverged(ar["rows"], ref)[0], "k5_diverged": diverged(sp["rows"], ref)[0]}
        log(f"{mode}: {R[f'{mode}_gen']}")


def hf_compare(target, draft, args, R):
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    d = tempfile.mkdtemp()
    t0 = time.time()
    specjax.save_model(target, d + "/t")
    specjax.save_model(draft, d + "/d")
    log(f"saved HF folders in {time.time() - t0:.1f}s")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tt = AutoModelForCausalLM.from_pretrained(d + "/t", dtype=torch.bfloat16).to(dev).eval()
    dd = AutoModelForCausalLM.from_pretrained(d + "/d", dtype=torch.bfloat16).to(dev).eval()
    rng = np.random.RandomState(0)
    prompt = torch.tensor([list(rng.randint(0, target.config.vocab_size, 32))], device=dev)
    out = {}
    rows = []

    def run(name, **kw):
        def call():
            with torch.no_grad():
                out[name] = tt.generate(prompt, max_new_tokens=args.max_new, min_new_tokens=args.max_new,
                                        do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
        t = median_time(call, 2)
        n = out[name].shape[1] - prompt.shape[1]
        return n / t, out[name][0, prompt.shape[1]:].tolist()

    ar_s, ar_row = run("hf-ar")
    ref = R.get("ar_rows_b1", [[]])[0]
    same = next((i for i, (a, b) in enumerate(zip(ar_row, ref)) if a != b), min(len(ar_row), len(ref)))
    R["hf_ar_tok_s"] = ar_s
    R["hf_ar_agrees_with_specjax_for"] = same
    rows.append(("transformers AR", 1, "-", ar_s, ar_s / R["ar_b1"]["tok_s"], 1.0, f"={same}"))
    log(rows[-1])
    for K in (5,):
        s, _ = run(f"hf-assist{K}", assistant_model=dd, num_assistant_tokens=K,
                   num_assistant_tokens_schedule="constant")
        R[f"hf_assist_k{K}_tok_s"] = s
        rows.append((f"transformers asst K={K}", 1, "-", s, s / R["ar_b1"]["tok_s"], 0, "-"))
        log(rows[-1])
    s, _ = run("hf-assist-default", assistant_model=dd)
    R["hf_assist_default_tok_s"] = s
    rows.append(("transformers asst dflt", 1, "-", s, s / R["ar_b1"]["tok_s"], 0, "-"))
    log(rows[-1])
    return rows


def selfdraft(args):
    """The target drafting for itself, greedy: every draft must be accepted unless the
    verification pass (K+1 tokens) computes other numbers than a one-token pass does."""
    tok = specjax.load_tokenizer(args.ckpt + "/target")
    texts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):",
             "def read_json(path):", "for i in range(10):", "def quicksort(xs):", "# Parse command line arguments\n",
             "def is_prime(n):\n    "]
    prompts = [tok.encode(t) for t in texts][:args.prompts]
    for dtype in ("bfloat16", "float32"):
        target = specjax.load_model(args.ckpt + "/target", dtype=dtype)
        ar = gen(target, prompts, max_new=args.max_new, batch=len(prompts))
        for K in args.ks:
            sp = gen(target, prompts, draft=specjax.DraftModel(target), K=K, max_new=args.max_new, batch=len(prompts))
            n, first = diverged(sp["rows"], ar["rows"])
            log(f"self-draft {dtype} K={K}: acceptance {sp['accepted'] / max(sp['drafted'], 1):.4f} "
                f"(rejected {sp['drafted'] - sp['accepted']} of {sp['drafted']}), rows != AR: {n}/{len(prompts)} first {first}")
            RESULTS[f"selfdraft-{dtype}-k{K}"] = dict(acc=sp["accepted"] / max(sp["drafted"], 1), diverged=n)
        with jax.default_matmul_precision("highest"):
            ar2 = gen(target, prompts, max_new=args.max_new, batch=len(prompts))
        n, _ = diverged(ar2["rows"], ar["rows"])
        log(f"{dtype}: AR rows changed by matmul precision 'highest': {n}/{len(prompts)}")


def shipped_pair(args):
    dtype = args.dtype
    target = specjax.load_model(args.ckpt + "/target", dtype=dtype)
    draft = specjax.load_model(args.ckpt + "/draft", dtype=dtype)
    tok = specjax.load_tokenizer(args.ckpt + "/target")
    texts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main():", "class Stack:\n    def __init__(self):",
             "def read_json(path):", "for i in range(10):", "def quicksort(xs):", "# Parse command line arguments\n",
             "def is_prime(n):\n    "]
    prompts = [tok.encode(t) for t in texts][:args.prompts]
    R = RESULTS.setdefault(f"shipped-{dtype}", {})
    rows = []
    for B in args.batches:
        group = (prompts * ((B + len(prompts) - 1) // len(prompts)))[:max(B, len(prompts))]
        ar = gen(target, group, max_new=args.max_new, batch=B)
        rows.append(("AR", B, "-", ar["tok_s"], 1.0, 1.0, "-"))
        R[f"ar_b{B}"] = ar["tok_s"]
        cases = [(f"draft K={K}", draft, K) for K in args.ks]
        for name in ("eagle", "medusa"):
            p = os.path.join(args.ckpt, name)
            if os.path.isdir(p):
                cases.append((f"{name} chain", specjax.load_drafter(p), None))
                if name == "eagle" and B == 1:
                    cases.append(("eagle Tree(6,2,20)", specjax.load_drafter(p, tree=specjax.Tree(6, 2, 20)), None))
        cases.append(("draft Tree(6,2,20)", specjax.DraftModel(draft, tree=specjax.Tree(6, 2, 20)), None))
        for name, d, K in cases:
            try:
                sp = gen(target, group, draft=d, K=K, max_new=args.max_new, batch=B)
            except Exception as e:  # report, go on
                log(f"{name} B={B} FAILED: {type(e).__name__}: {str(e)[:300]}")
                rows.append((name + " FAIL", B, "-", 0.0, 0.0, 0.0, "-"))
                continue
            n, first = diverged(sp["rows"], ar["rows"])
            rows.append((name, B, f"{sp['tok_per_pass']:.2f}", sp["tok_s"], sp["tok_s"] / ar["tok_s"],
                         sp["accepted"] / max(sp["drafted"], 1), f"{n}/{len(group)}"))
            R[f"{name}_b{B}"] = dict(tok_s=sp["tok_s"], tpp=sp["tok_per_pass"], diverged=n, first=first)
            log(rows[-1])
    log("\n%-22s %4s %8s %10s %8s %7s %6s" % ("what", "B", "tok/pass", "tok/s", "vs AR", "accept", "diverg"))
    for r in rows:
        log("%-22s %4s %8s %10.1f %8.2f %7.2f %6s" % r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["shipped", "synth", "selfdraft", "attention"])
    ap.add_argument("--size", default="1b", choices=sorted(set(SIZE_MAP) | set(SYNTHETIC_SIZES)))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--pass-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--tree", type=int, nargs=3, default=None)
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--ckpt", default="checkpoints")
    ap.add_argument("--prompts", type=int, default=8, help="shipped/selfdraft: use the first N of the 8 prompts")
    ap.add_argument("--cases", type=int, default=len(ATTENTION_CASES), help="attention: the first N of ATTENTION_CASES")
    args = ap.parse_args()
    log(f"jax {jax.__version__} backend {jax.default_backend()} devices {jax.devices()}")
    try:
        if args.part == "synth":
            synth(args)
        elif args.part == "selfdraft":
            selfdraft(args)
        elif args.part == "attention":
            attention(args)
        else:
            shipped_pair(args)
    finally:
        with open(os.path.join(OUT, f"gpubench-{args.part}-{args.size}-{args.dtype}.json"), "w") as f:
            json.dump(RESULTS, f, default=float)


if __name__ == "__main__":
    main()
