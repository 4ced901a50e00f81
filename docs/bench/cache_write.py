"""How a pass writes its new cache entries, compiled for one v5e chip (run nowhere): the
Llama-3.2-1B target with its 2-layer draft, bf16, generate's chain K=4 over prompts of 128 and
384 new tokens, at 8 and 64 rows. Per form of the write: compile seconds, temporaries, and
copies of a whole cache buffer (`aot.large_copies`, threshold 90% of one target buffer).

The forms: "slices" (cache.write(consecutive=True), what a TPU program holds: B unrolled
dynamic_update_slices), "scatter" (cache.write's point scatter, what the other platforms
hold), the scatter with indices_are_sorted/unique_indices, a vmapped dynamic_update_slice,
and the B slices as a fori_loop over rows.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/cache_write.py
"""

import time

import jax
import jax.numpy as jnp

from specjax import cache
from specjax.tools import aot
from specjax.config import ModelConfig
from specjax.models import transformer
from tests import real_configs as rc


def scatter(buffer, new, slots, consecutive=False):
    return cache.write(buffer, new, slots)


def slices(buffer, new, slots, consecutive=False):
    return cache.write(buffer, new, slots, consecutive=True)


def flagged(buffer, new, slots, consecutive=False):
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, slots].set(new.astype(buffer.dtype), mode="drop", indices_are_sorted=True,
                                      unique_indices=True)


def vmapped(buffer, new, slots, consecutive=False):
    one = lambda buf, x, start: jax.lax.dynamic_update_slice(buf, x, (start, 0, 0))  # noqa: E731
    return jax.vmap(one)(buffer, new.astype(buffer.dtype), slots[:, 0])


def row_loop(buffer, new, slots, consecutive=False):
    new = new.astype(buffer.dtype)

    def row(b, buffer):
        return jax.lax.dynamic_update_slice(buffer, jax.lax.dynamic_slice_in_dim(new, b, 1), (b, slots[b, 0], 0, 0))

    return jax.lax.fori_loop(0, buffer.shape[0], row, buffer)


target, draft = (aot.abstract_model(ModelConfig.from_hf_config(c))
                 for c in (rc.LLAMA_3_2_1B, rc.with_layers(rc.LLAMA_3_2_1B, 2)))
where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
c = target.config
print(f"# docs/bench/cache_write.py; jax {jax.__version__}, {time.strftime('%Y-%m-%d')}; bf16, v5e:1x1; generate "
      f"chain K=4, prompt 128 + 384 new tokens")
forms = {"slices": slices, "scatter": scatter, "scatter sorted+unique": flagged, "vmapped slice": vmapped,
         "fori_loop of slices": row_loop}
for B in (8, 64):
    for name, form in forms.items():
        if B == 64 and name not in ("slices", "scatter"):
            continue
        transformer.write = form
        jax.clear_caches()
        spec = aot.loop_program(target, draft, where, batch=B, prompt_len=128, max_new_tokens=384,
                                num_draft_tokens=4, name=f"B={B} {name}")
        buffer = B * aot.loop.cache_length(128, 384, 4) * c.num_kv_heads * c.head_dim * 2
        try:
            program = aot.compile_spec(spec, copies_threshold=int(0.9 * buffer))
        except Exception as e:  # noqa: BLE001 - a compiler failure is a finding too
            print(f"{spec.name:<34} does not compile: {' '.join(str(e).split())[:160]}", flush=True)
            continue
        print(aot.report([program]).splitlines()[-1][:80] + f"  {len(program.copies)} buffer copies", flush=True)
