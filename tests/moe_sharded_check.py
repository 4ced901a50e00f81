"""Run in a subprocess by test_moe.py with 8 emulated CPU devices: a mixture of experts split
over an `expert` mesh axis computes what one device computes, its experts really split, and
no collective of its compiled pass moves a weight. Argument: the model's folder. Prints one
JSON line of findings."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax  # noqa: E402
from specjax.backend import Backend  # noqa: E402
from specjax.models import apply  # noqa: E402
from specjax.tools.hlo import collectives  # noqa: E402

folder = sys.argv[1]
alone = specjax.load_model(folder)
tokens = np.random.RandomState(0).randint(2, 97, (4, 6))
positions = np.broadcast_to(np.arange(6), tokens.shape)
run = jax.jit(lambda model, tokens: apply(model, tokens, positions)[0])
expected = np.asarray(run(alone, tokens))
largest_weight = max(int(np.prod(x.shape)) for layer in alone.params["layers"] for x in jax.tree.leaves(layer))
findings = {}
for d, e, m in ((1, 8, 1), (2, 2, 2), (2, 4, 1)):
    mesh = specjax.make_mesh(data=d, model=m, expert=e)
    model = specjax.load_model(folder, mesh=mesh).on(Backend.of(None, mesh))
    gate = model.params["layers"][0]["moe"]["experts_gate"]
    got = np.asarray(run(model, tokens))
    moved = collectives(run.lower(model, tokens).compile().as_text())
    findings[f"{d}x{e}x{m}"] = {
        "max_diff": float(np.abs(got - expected).max()),
        "experts_per_device": gate.addressable_shards[0].data.shape[0],
        "largest_collective": max((int(np.prod(shape)) for _, _, shape in moved), default=0),
        "largest_weight": largest_weight}
print(json.dumps(findings))
