"""Where a one-token pass's time goes on a GPU: the whole pass with the attention kernels
(Model.attention="kernels": cuDNN where it is installed), the pass with the portable
attention, the vocabulary head alone, and the layers' matmuls alone.
python parts.py SIZE   (run from the project's root with PYTHONPATH set; SIZE: 1b, 8b, tiny)

Adapted from /work/shared/gpu/parts.py (f58689a, stacked layers) to the per-layer layout: the
pair is specjax.tools.synthetic.build_synthetic_pair (through gpubench.build_pair), and the last
line, the layers' matmuls alone, is specjax.tools.synthetic.weights_only_time (the original
printed no such line although its docstring promised it)."""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpubench  # noqa: E402
from specjax.tools.measure import pass_time  # noqa: E402
from specjax.tools.synthetic import weights_only_time  # noqa: E402


def timeit(f, *a, passes=50):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) / passes


size = sys.argv[1]
target, _ = gpubench.build_pair(size, 2, jnp.bfloat16)
p = target.params
print(f"{size}: {gpubench.nbytes(target) / 1e9:.2f} GB", flush=True)
full = pass_time(target.replace(attention="kernels"), 1, 1, 1024, 3)
print(f"full pass T=1, kernels:       {full * 1e3:.3f} ms", flush=True)
portable = target.replace(attention="portable")
port = pass_time(portable, 1, 1, 1024, 3)
print(f"full pass T=1, portable attn: {port * 1e3:.3f} ms", flush=True)
port8 = pass_time(portable, 1, 8, 1024, 3)
print(f"full pass T=8, portable attn: {port8 * 1e3:.3f} ms", flush=True)
head = p["lm_head"] if "lm_head" in p else None
emb = p["embedding"]
x = jnp.ones((1, emb.shape[1]), emb.dtype) * 0.01


@jax.jit
def head_loop(x, emb, head):
    def one(i, acc):
        y = x @ head if head is not None else jnp.einsum("be,ve->bv", x, emb)
        return acc + y[:, :1].astype(jnp.float32)
    return jax.lax.fori_loop(0, 50, one, jnp.zeros((1, 1), jnp.float32))


hb = (head if head is not None else emb).nbytes
th = timeit(head_loop, x, emb, head)
print(f"vocab head alone:            {th * 1e3:.3f} ms ({hb / th / 1e12:.2f} TB/s)", flush=True)


@jax.jit
def head_f32(x, emb, head):
    def one(i, acc):
        y = (jnp.einsum("be,ve->bv", x, emb, preferred_element_type=jnp.float32) if head is None
             else jnp.einsum("be,ev->bv", x, head, preferred_element_type=jnp.float32))
        return acc + y[:, :1]
    return jax.lax.fori_loop(0, 50, one, jnp.zeros((1, 1), jnp.float32))


th2 = timeit(head_f32, x, emb, head)
print(f"vocab head, f32 out:         {th2 * 1e3:.3f} ms", flush=True)


tw = weights_only_time(target, 3)
wb = sum(a.nbytes for a in jax.tree.leaves(p["layers"])) + hb  # what it reads: the layers and the head
print(f"layers' matmuls + head alone: {tw * 1e3:.3f} ms ({wb / tw / 1e12:.2f} TB/s)", flush=True)
