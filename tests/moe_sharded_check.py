"""Run in a subprocess by test_moe.py with 8 emulated CPU devices: a mixture of experts split
over an `expert` mesh axis computes what one device computes, its experts really split, and
no collective of its compiled pass moves a weight; and the same of its int8 form (experts'
values and scales split alike) on one mesh. Argument: the model's folder. Prints one JSON
line of findings."""

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
tokens = np.random.RandomState(0).randint(2, 97, (4, 6))
positions = np.broadcast_to(np.arange(6), tokens.shape)
run = jax.jit(lambda model, tokens: apply(model, tokens, positions)[0])
expected = {q: np.asarray(run(specjax.load_model(folder, quantize=q), tokens)) for q in (None, "int8")}
alone = specjax.load_model(folder)
largest_weight = max(int(np.prod(x.shape)) for layer in alone.params["layers"] for x in jax.tree.leaves(layer))
findings = {}
for d, e, m, q in ((1, 8, 1, None), (2, 2, 2, None), (2, 4, 1, None), (2, 1, 4, None), (2, 2, 2, "int8")):
    mesh = specjax.make_mesh(data=d, model=m, expert=e)
    model = specjax.load_model(folder, mesh=mesh, quantize=q).on(Backend.of(None, mesh))
    gate = model.params["layers"][0]["moe"]["experts_gate"]
    if q:  # its scales [X, 1, I] split over experts and width as its values are
        assert gate.scale.addressable_shards[0].data.shape[::2] == gate.value.addressable_shards[0].data.shape[::2]
        gate = gate.value
    got = np.asarray(run(model, tokens))
    moved = collectives(run.lower(model, tokens).compile().as_text())
    findings[f"{d}x{e}x{m}" + (f" {q}" if q else "")] = {
        "max_diff": float(np.abs(got - expected[q]).max()),
        "experts_per_device": gate.addressable_shards[0].data.shape[0],
        "largest_collective": max((int(np.prod(shape)) for _, _, shape in moved), default=0),
        "largest_weight": largest_weight}
print(json.dumps(findings))
