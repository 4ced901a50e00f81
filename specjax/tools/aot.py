"""Programs built ahead of time for devices this host need not have, and what they cost.

A `Model` whose params are `jax.ShapeDtypeStruct`s (`abstract_model`: from a config alone,
nothing read or allocated) goes through everything that builds a specjax program. Placed on
the devices of a TPU slice that is not here (`tpu_slice("v5e:2x2")`: libtpu's topology
descriptions, XLA's real TPU compiler), each program compiles as it would on that slice:
`memory_analysis()` gives each device's argument, output and temporary bytes, and running out
of HBM is an error at compile time. Placed on GPUs that are not here (`gpu_slice("h100")`:
jax's CUDA plugin compiles deviceless for XLA's description of the device), a program is
XLA's optimised GPU program, kernels chosen and fused as on the device. Without the plugin a
program is lowered for "cuda" instead: before XLA optimises it, its cost analysis counts
every operand once.

What a program costs is read four ways (`Program`):
- its temporaries as a fraction of the weights (a decode step should need little beyond
  them and its caches);
- the weight- or cache-sized copies, transposes and converts in the optimised TPU program,
  named with the Python line that made them (`large_copies`; the target: none);
- the bytes a CUDA program moves over the bytes a step must read (weights plus the live
  cache): its optimised kernels' traffic where it was compiled for a GPU (`hlo.traffic`),
  else its CUDA lowering's count (`cuda_bytes`);
- its data-dependent loops and conditionals, traced for CUDA (`control_flow`: on a GPU each
  reads a predicate back to the host; a loop's own is the one it needs).
XLA's TPU "bytes accessed" is not HBM traffic (it counts on-chip prefetch too), so it is
not used; a loop body is counted once; Pallas kernels' flops are not counted.

The programs (`pass_program`, `verify_program`, `draft_program`, `loop_program`,
`distill_program`) are specjax's own: the one-token pass, a verification pass of K+1
tokens, one drafter step, `generate`'s whole loop (request.py prepares it as generate
does), and a distillation update. Attention's kernel follows the platform compiled for, not
this host's backend, so a program compiled here is the one that platform would run.

This module knows where programs run and how to read their compiled form; it does not
know what the models compute, and it runs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from specjax import loop, models, sharding
from specjax.backend import Backend
from specjax.cache import KVCache
from specjax.config import ModelConfig
from specjax.drafters import DraftModel
from specjax.drafters.base import DraftRequest
from specjax.memory import GB, MB, device_nbytes, nbytes
from specjax.models import Model
from specjax.request import prepare
from specjax.tools.hlo import Copy, large_copies, short_path, traffic

# HBM per chip (bytes), by TPU generation (Google Cloud's TPU pages); libtpu's topology
# names use the same generation names.
TPU_HBM = {"v4": 32 * GB, "v5e": 16 * GB, "v5p": 95 * GB, "v6e": 32 * GB}


class TopologyError(ValueError):
    """A slice that cannot be described here (unknown name, or libtpu missing)."""


@dataclasses.dataclass(frozen=True)
class Slice:
    """The devices of an accelerator slice, here or not, and the memory each one has."""

    name: str  # "v5e:2x2"
    platform: str  # "tpu"
    devices: tuple  # jax devices (topology devices: nothing runs on them)
    hbm: int  # bytes per device

    @property
    def chips(self) -> int:
        return len(self.devices)

    def mesh(self, data: int | None = None, model: int | None = None) -> Mesh:
        """A (data, model) mesh over the slice's devices (`sharding.make_mesh`)."""
        return sharding.make_mesh(data, model, devices=list(self.devices))


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """"v5e:2x2" -> ("v5e", (2, 2)); raises TopologyError naming what is accepted."""
    m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", str(name))
    if not m and re.match(r"(?i)(a|h|b|gb|l)\d+|rtx|mi\d+", str(name)):
        raise TopologyError(f"{name!r} is a GPU: the GPUs programs compile for here are {sorted(GPU_TARGETS)} "
                            f"(one, or several of one host: h100x8)")
    if not m:
        raise TopologyError(f"unknown TPU topology {name!r}: expected GENERATION:AxB[xC] with a generation "
                            f"among {sorted(TPU_HBM)}, e.g. v5e:1x1, v5e:2x2, v5e:2x4, v6e:2x2, v5p:2x2x1")
    dims = tuple(int(d) for d in m.group(2).split("x"))
    if min(dims) < 1:
        raise TopologyError(f"TPU topology {name!r} has a zero dimension")
    return m.group(1), dims


@functools.lru_cache(maxsize=None)
def tpu_slice(name: str) -> Slice:
    """The devices of a TPU slice ("v5e:1x1", "v5e:2x2", "v6e:2x2", "v5p:2x2x1", ...), from
    libtpu's topology descriptions: programs compile for them here, nothing runs. Needs
    the `libtpu` package (jax's `tpu` extra); only one process at a time may load it unless
    every one sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 before it loads (safe where none drives a TPU)."""
    generation, dims = parse_topology(name)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TopologyError("compiling for a TPU needs the libtpu package (pip install 'jax[tpu]', or "
                            "specjax's test extra on Linux x86-64)") from None
    from jax.experimental import topologies

    chips = int(np.prod(dims))
    kwargs = {}
    if chips < 4 and len(dims) == 2:  # a host of fewer than 4 chips says its own bounds
        kwargs["chips_per_host_bounds"] = (*dims, 1)
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)
    except Exception as e:  # noqa: BLE001 - libtpu's own message says what it lacks
        held = "lockfile" in str(e)
        raise TopologyError(f"libtpu cannot describe the TPU topology {name!r}: {type(e).__name__}: {e}" + (
            " (another process holds libtpu: where no process drives a real TPU, set ALLOW_MULTIPLE_LIBTPU_LOAD=1 "
            "in every one before jax starts)" if held else "")) from e
    return Slice(name, "tpu", tuple(topology.devices), TPU_HBM[generation])


def accelerator(name: str) -> Slice:
    """The devices `name` describes: a TPU slice ("v5e:2x2": `tpu_slice`) or GPUs of one host
    ("h100", "h200x8": `gpu_slice`)."""
    return gpu_slice(name) if re.fullmatch(r"(?i)[a-z]+\d+(x\d+)?", str(name)) else tpu_slice(name)


# The GPUs programs compile for here: (memory bandwidth B/s, memory bytes, name) as an H100 SXM
# reports them to XLA (jax issue 28376 quotes its description), and the H200, the same chip
# with more memory (nvidia-smi's 143,771 MiB) and bandwidth (4.8 TB/s). Compilation reads the
# compute capability, the core count and the memory limits of `_target_config`; nothing is timed.
GPU_TARGETS = {"h100": (3352320000000, 84929347584, "NVIDIA H100 80GB HBM3"),
               "h200": (4800000000000, 150754820096, "NVIDIA H200")}


def _target_config(bandwidth: int, memory: int, name: str) -> str:
    """XLA's GpuTargetConfig text of a Hopper GPU (compute capability 9.0, 132 SMs)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 }} runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""


@functools.lru_cache(maxsize=None)
def gpu_slice(name: str) -> Slice:
    """The devices of one host's GPUs ("h100", "h200", "h100x8": eight of them): programs
    compile for them here (XLA's GPU compiler, deviceless, for `GPU_TARGETS`' description),
    nothing runs. Needs jax's CUDA plugin (pip install 'jax[cuda12]'; no GPU, no driver); on a
    host without a GPU, with JAX_PLATFORMS=cpu set before jax starts (the plugin checks the
    driver's version unless the platforms exclude CUDA)."""
    m = re.fullmatch(r"([a-z]+\d+)(?:x(\d+))?", str(name).lower())
    if not m or m.group(1) not in GPU_TARGETS or (m.group(2) and int(m.group(2)) < 1):
        raise TopologyError(f"unknown GPU {name!r}: expected one of {sorted(GPU_TARGETS)}, or several of one "
                            f"host as h100x8")
    from jax.experimental import topologies

    count = int(m.group(2) or 1)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=_target_config(*GPU_TARGETS[m.group(1)]),
                                                topology=f"1x1x{count}")
    except NotImplementedError:  # jax found no CUDA plugin
        raise TopologyError(f"compiling for {name!r} needs jax's CUDA plugin (pip install 'jax[cuda12]'), loaded: "
                            f"on a host without a GPU, set JAX_PLATFORMS=cpu before jax starts, or the plugin "
                            f"refuses to load for want of a driver") from None
    return Slice(str(name).lower(), "gpu", tuple(topology.devices), GPU_TARGETS[m.group(1)][1])


# ---- models and arrays from shapes -------------------------------------------------------

def abstract_model(config: ModelConfig, dtype=jnp.bfloat16, quantize: str | None = None) -> Model:
    """A Model of this config whose params are shapes (jax.ShapeDtypeStruct): nothing is
    read or allocated. quantize="int8": its int8 weight-only form (specjax.quant)."""
    model = jax.eval_shape(lambda: models.init(config, jax.random.key(0), dtype))
    if quantize is not None:
        from specjax.quant import quantize as quantized

        model = jax.eval_shape(lambda m: quantized(m, quantize), model)
    return model


def shaped(tree, placement: jax.sharding.Sharding | None = None):
    """The arrays of a pytree as shapes (with `placement` on every leaf, if given)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=placement), tree)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a program's arrays go: one device, or a mesh (with the target's rules)."""

    device: Any = None
    mesh: Mesh | None = None
    rules: tuple | None = None

    @property
    def backend(self) -> Backend:
        """The backend its programs are built for (the mesh's devices, or the device's)."""
        return Backend.of(None, self.mesh) if self.mesh is not None else Backend(self.device.platform)

    @property
    def platform(self) -> str:
        return self.backend.platform

    def whole(self) -> jax.sharding.Sharding:
        """Every device holds all of it (one device: that device)."""
        return SingleDeviceSharding(self.device) if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def rows(self, shape) -> jax.sharding.Sharding:
        """Rows over the mesh's data axis."""
        return self.whole() if self.mesh is None else sharding.batch_sharding(shape, self.mesh, self.rules)

    def model(self, model: Model, rules=None) -> Model:
        """A model placed: on the device, or sharded over the mesh by `rules` (default the
        placement's; a draft may be replicated with (("batch", "data"),))."""
        if self.mesh is None:
            return model.replace(params=shaped(model.params, self.whole()))
        return sharding.shard_model(model, self.mesh, rules or self.rules)

    def replicated(self, tree):
        return shaped(tree, self.whole())


def on_device(device) -> Placement:
    return Placement(device=device)


def on_mesh(mesh: Mesh, rules=None) -> Placement:
    return Placement(mesh=mesh, rules=tuple(rules or sharding.DEFAULT_RULES))


# ---- the programs --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """A program not yet compiled: a jitted function and its (abstract) arguments."""

    name: str
    fn: Callable  # a jax.jit-wrapped function
    body: Callable | None  # what fn jits, of (backend, *args) (None: fn takes a static `backend`)
    args: tuple
    kwargs: dict
    params: Any  # the parameters it reads (placed shapes): its weights
    must_read: int  # bytes one run must read at the least: weights + the live cache
    platform: str  # where it runs ("tpu", "gpu", "cpu")

    @property
    def weights(self) -> int:
        """Bytes of its parameters, all devices together."""
        return nbytes(self.params)


def _carry(tree, where: Placement, drafter=None):
    """Shapes of a loop carry placed as the loop lays them (one device: on it): a KVCache by
    CACHE_AXES, the loop's state by its declared axes (`loop.state_shardings`)."""
    if where.mesh is None:
        return shaped(tree, where.whole())
    if isinstance(tree, KVCache):
        return sharding.place_carry(tree, sharding.cache_axes(tree), where.mesh, where.rules)
    return jax.tree.map(sharding.put, tree, loop.state_shardings(tree, drafter, where.mesh, where.rules))


def pass_reads(model: Model) -> int:
    """Bytes of weights one pass reads: all of them but an untied embedding, of which a pass
    gathers only its tokens' rows."""
    untied = "lm_head" in model.params
    return nbytes(model.params) - (nbytes(model.params["embedding"]) if untied else 0)


def pass_program(target: Model, where: Placement, batch: int = 1, context: int = 512, tokens: int = 1,
                 name: str | None = None) -> Spec:
    """`tokens` tokens per row through the target over a cache of `context` slots (the
    one-token pass; with tokens = K + 1, a verification pass of a chain of K). Its must_read:
    the weights a pass reads and the whole cache (keep context <= attention.ATTENTION_BLOCK for
    the CUDA figure: a blockwise attention loop's body is counted once)."""
    placed = where.model(target)
    slots = loop.cache_length(context, 0, 0)
    cache = _carry(jax.eval_shape(lambda: KVCache.init(target.config, batch, slots, target.dtype)), where)
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=where.rows((batch, tokens)))

    def run(backend, model, tokens, positions, cache):
        logits, _, cache = models.apply(model.on(backend), tokens, positions, cache)
        return logits, cache

    fn = jax.jit(functools.partial(run, where.backend), donate_argnums=3)
    return Spec(name or (f"{tokens}-token pass" if tokens > 1 else "one-token pass"), fn, run,
                (placed, ids, ids, cache), {}, placed.params,
                pass_reads(target) + KVCache.nbytes(target.config, batch, context, target.dtype), where.platform)


def verify_program(target: Model, where: Placement, K: int, batch: int = 1, context: int = 512) -> Spec:
    """The target's verification pass of a chain of K drafts: K + 1 tokens per row."""
    return pass_program(target, where, batch, context, K + 1, name=f"verify K={K}")


def _loop_args(target: Model, draft, where: Placement, batch: int, prompt_len: int, max_new_tokens: int,
               generate_kwargs: dict, draft_rules=None):
    placed = where.model(target)
    if isinstance(draft, Model):
        draft = where.model(draft, draft_rules)
    elif isinstance(draft, DraftModel):
        draft = where.replicated(draft).replace(model=where.model(draft.model, draft_rules))
    elif draft is not None:  # a drafter's own params: replicated
        draft = where.replicated(draft)
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=where.rows((batch, prompt_len)))
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=where.rows((batch,)))
    kwargs = dict(draft=draft, key=None, max_new_tokens=max_new_tokens, num_draft_tokens=None, temperature=0.0,
                  top_k=0, top_p=1.0, min_p=0.0, logit_bias=None, presence_penalty=0.0, frequency_penalty=0.0,
                  repetition_penalty=1.0, grammar=None, eos_token_id=None, return_trace=False,
                  logprobs=None, logprobs_mode="raw", prompt_logprobs=None, adaptive_k=False, draft_threshold=0.0,
                  mesh=where.mesh, rules=where.rules, stream=None, cost_profile=None, deterministic=False)
    kwargs.update(generate_kwargs)
    # The exact program for another platform is built, not promised (prepare would refuse it
    # off the CPU, where its bits are verified).
    exact, kwargs["deterministic"] = kwargs["deterministic"], False
    args, static, _ = prepare(placed.replace(exact=bool(exact)), prompts, lengths, **kwargs)
    args = args[:4] + tuple(where.replicated(a) for a in args[4:])  # key, sampling, stop ids, threshold
    return args, static


def loop_program(target: Model, draft, where: Placement, batch: int = 1, prompt_len: int = 128,
                 max_new_tokens: int = 128, name: str | None = None, draft_rules=None, **generate_kwargs) -> Spec:
    """`generate`'s whole loop for `batch` prompts of `prompt_len` tokens: draft as generate's
    (None, a Model or a drafter; abstract), generate's other keywords as its own
    (num_draft_tokens, temperature, deterministic, ...). deterministic=True builds the exact
    program even where generate would refuse to run it (its promise is verified on CPU)."""
    args, static = _loop_args(target, draft, where, batch, prompt_len, max_new_tokens, generate_kwargs, draft_rules)
    drafter = args[1]
    params = (args[0].params, drafter_params(drafter))
    context = prompt_len + max_new_tokens
    must = nbytes(params) + KVCache.nbytes(target.config, batch, context, target.dtype)
    label = name or ("plain loop" if drafter is None else f"loop {type(drafter).__name__} {drafter.tree}")
    return Spec(label, loop.generate_loop, None, args, dict(static, stream=None), params, must, where.platform)


def engine_program(target: Model, draft: Model | None, where: Placement, slots: int = 8, max_len: int = 2048,
                   K: int = 4, steps: int = 8, kind: str = "greedy", name: str | None = None,
                   width: int | None = None, kv_pages: int | None = None, page_size: int = 16,
                   grammar: tuple | None = None) -> Spec:
    """One device call of `specjax.Engine` (serve/programs.py's run): `steps` steps at K (0: the
    draft's state carried, not drafting) of the first `width` (default: all `slots`) rows of a
    state sized for max_len, for rows whose sampling is of `kind` (specjax.sampling.KINDS).
    kv_pages: a paged engine's (Engine(kv_pages=, page_size=)): every cache in pools of
    kv_pages pages (and the null page) of page_size slots, each row's table as wide as its
    longest cache needs: the state is the engine's own (`Programs`: its cache length and
    table width). grammar: None, or (states, token masks, exceptional moves): each row's room
    for a grammar (`specjax.grammar.Capacity`: Engine(max_grammar_states=, max_grammar_masks=,
    max_grammar_edges=)), the call of a kind that walks it."""
    from specjax.serve import programs
    from specjax.serve.engine import OPEN_STEPS

    if where.mesh is not None:
        raise ValueError("engine_program builds the engine on one device")
    placed = where.model(target)
    drafter = None if draft is None else DraftModel(where.model(draft)).resolve(max(K, 1)).bind(placed)
    engine = programs.Programs(placed, {0: None} if drafter is None else {max(K, 1): drafter}, slots, max_len, 8,
                               steps, 0.0, paging=None if kv_pages is None else (kv_pages + 1, page_size),
                               grammar=grammar)
    state = where.replicated(engine.state_shapes())  # (its shapes are every platform's)
    scalar = lambda dtype: where.replicated(jax.ShapeDtypeStruct((), dtype))  # noqa: E731
    params = (placed.params, drafter_params(drafter))
    must = nbytes(params) + KVCache.nbytes(target.config, slots, max_len, target.dtype)
    width = width or slots
    label = f"engine call K={K}, {slots} slots" + (f", rows [:{width}]" if width < slots else "") + (
        "" if kv_pages is None else f", {kv_pages} pages of {page_size}") + (
        "" if grammar is None else f", grammars of {grammar[0]} states")
    return Spec(name or label, programs.run_steps, None,
                (placed, drafter if K else None, drafter, state, scalar(jnp.float32), scalar(jnp.int32)),
                dict(steps=steps, open_steps=min(OPEN_STEPS, steps), width=width, kind=kind, backend=where.backend,
                     rules=None), params, must, where.platform)


def drafter_params(drafter):
    """The weights a drafter holds (a draft model's, a head's), or None."""
    if drafter is None:
        return None
    if isinstance(drafter, Model):
        return drafter.params
    if isinstance(drafter, DraftModel):
        return (drafter.model.params, drafter.head)
    return getattr(drafter, "params", None)


def draft_program(target: Model, draft, where: Placement, batch: int = 1, prompt_len: int = 128,
                  max_new_tokens: int = 128, name: str | None = None, draft_rules=None,
                  **generate_kwargs) -> Spec:
    """One drafter step as the loop runs it (`Drafter.propose` on the loop's state at its
    first step): its forwards, its cache writes, its proposal."""
    args, static = _loop_args(target, draft, where, batch, prompt_len, max_new_tokens, generate_kwargs, draft_rules)
    target_placed, drafter, prompts, lengths, key, sampling, _, threshold = args[:8]
    if drafter is None:
        raise ValueError("draft_program needs a draft")
    backend = static["backend"]

    def state_of(target, drafter, prompts, lengths, key, sampling):
        target, drafter = loop.bound(backend, target, drafter)
        return loop.initial_state(target, drafter, prompts, lengths, key, max_new_tokens, sampling)

    state = jax.eval_shape(state_of, target_placed, drafter, prompts, lengths, key, sampling)
    key = jax.eval_shape(lambda k: loop.row_keys(k, batch), key)
    state = _carry(state, where, drafter)

    def step(backend, target, drafter, state, key, sampling, threshold):
        target, drafter = loop.bound(backend, target, drafter)
        request = DraftRequest(target=target, target_cache=state.target_cache, tokens=state.tokens,
                               length=state.length, done=state.done, key=key, sampling=state.sampling,
                               k_limit=state.k_limit, threshold=threshold, features=state.features)
        return drafter.propose(state.draft_state, request)

    fn = jax.jit(functools.partial(step, backend))
    params = drafter_params(drafter)
    must = nbytes(params) + (KVCache.nbytes(drafter.model.config, batch, prompt_len, drafter.model.dtype)
                             if isinstance(drafter, DraftModel) else 0)
    return Spec(name or f"draft step {type(drafter).__name__} {drafter.tree}", fn, step,
                (target_placed, drafter, state, key, sampling, threshold), {}, params, must, backend.platform)


def distill_program(target: Model, draft: Model, where: Placement, batch: int = 8, seq_len: int = 256) -> Spec:
    """One distillation update of `draft` (float32 weights, AdamW) from a frozen `target`:
    what `specjax distill` runs per step."""
    import optax

    from specjax.train.loop import TrainConfig, TrainState, make_optimizer, model_objective

    cfg = TrainConfig()
    student = draft.replace(params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), draft.params))
    optimizer = make_optimizer(cfg)
    state = jax.eval_shape(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)), student.params)
    state = where.replicated(state)
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32, sharding=where.rows((batch, seq_len + 1)))

    def step(backend, state, batch, teacher):
        loss_fn, _ = model_objective(student.on(backend), cfg, teacher.on(backend))
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), loss

    fn = jax.jit(functools.partial(step, where.backend), donate_argnums=0)
    teacher = where.model(target)
    params = (teacher.params, state.params)
    return Spec("distill step", fn, step, (state, tokens, teacher), {}, params, nbytes(params), where.platform)


# ---- compiling and reading a program --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled program's figures, per device."""

    name: str
    platform: str
    compile_seconds: float
    arguments: int
    outputs: int
    temporaries: int
    weights: int  # bytes of parameters per device (among the arguments)
    copies: tuple[Copy, ...]  # weight- or cache-sized copies/transposes/converts (`large_copies`)
    # Bytes a CUDA program moves / bytes that must be read: compiled for a GPU, its optimised
    # kernels' traffic (`hlo.traffic`); else the CUDA lowering's count before XLA fuses it
    # (`cuda_bytes`: every elementwise op charged apart).
    cuda_ratio: float | None = None
    branching: tuple | None = None  # its data-dependent loops and conditionals traced for CUDA (`control_flow`)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries

    @property
    def temporaries_over_weights(self) -> float:
        return self.temporaries / max(self.weights, 1)


def _trace_for_cuda(spec: Spec):
    """The spec's program traced as a CUDA device would run it (for a backend on one GPU)."""
    unplaced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(
        x, jax.ShapeDtypeStruct) else x, spec.args)
    kwargs = dict(spec.kwargs)
    if spec.body is None:  # a loop's or an engine call's: its static backend
        fn = spec.fn
        kwargs.update(backend=Backend("gpu"), rules=None)
    else:
        fn = jax.jit(functools.partial(spec.body, Backend("gpu")))
    return fn.trace(*unplaced, **kwargs)


def cuda_bytes(spec: Spec) -> float | None:
    """The CUDA lowering's bytes accessed (before optimisation: every operand once) for the
    spec's program, traced with GPU kernels where they can be traced here (cuDNN needs jax's
    CUDA plugin; without it attention takes the portable path; the Pallas prefix kernel where
    the model opts in); None where the lowering has no cost analysis. XLA's analysis does
    not cost a custom call (a Pallas kernel): each counts its operands and results once here."""
    lowered = _trace_for_cuda(spec).lower(lowering_platforms=("cuda",))
    costs = lowered.cost_analysis()
    if not costs:
        return None
    return float(costs.get("bytes accessed", 0.0)) + sum(map(_custom_call_bytes, re.findall(
        r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*\} : (\(.*\)) -> (.*)$", lowered.as_text(),
        flags=re.MULTILINE)))


_MLIR_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1, "i1": 1, "f64": 8, "i64": 8}


def _custom_call_bytes(signature: tuple[str, str]) -> int:
    """Bytes of a custom call's operand and result tensors, from its MLIR type signature."""
    total = 0
    for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", " ".join(signature)):
        total += int(np.prod([int(d) for d in dims.split("x") if d] or [1])) * _MLIR_BYTES.get(dtype, 4)
    return total


@dataclasses.dataclass(frozen=True)
class Branching:
    """A data-dependent `while` or `cond` in a program: on a GPU each runs as a device-to-host
    copy of its predicate and a wait (XLA's while and conditional thunks), and stops graph
    capture. Loops of a static trip count (`fori_loop` over Python ints: a `scan`) are not
    counted: they need no predicate."""

    op: str  # "while" | "cond"
    nested: int  # how many loops or conditionals enclose it (0: the program's own level)
    source: str  # "specjax/loop.py:321" (the Python line that made it)

    def __str__(self):
        return f"{self.op} at {self.source}" + (f" (inside {self.nested})" if self.nested else "")


def control_flow(spec: Spec) -> tuple[Branching, ...]:
    """Every data-dependent loop and conditional in the spec's program as traced for CUDA,
    outermost first (the jaxpr's: `while` and `cond` primitives, wherever they are nested,
    but inside a Pallas kernel, whose loops run on the device and wait on no host)."""
    from jax.extend import source_info_util

    found = []

    def walk(jaxpr, nested):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in ("while", "cond"):
                frame = source_info_util.summarize(eqn.source_info).split(" (")[0]  # "path:line:column"
                path, line = frame.rsplit(":", 2)[:2] if frame.count(":") >= 2 else ("?", "")
                found.append(Branching(name, nested, f"{short_path(path)}:{line}"))
            if name == "pallas_call":
                continue
            inner = nested + (name in ("while", "cond", "scan"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(_trace_for_cuda(spec).jaxpr.jaxpr, 0)
    return tuple(sorted(found, key=lambda b: b.nested))


def compile_spec(spec: Spec, copies_threshold: int | None = None, cuda: bool = False) -> Program:
    """Compiles the spec for its devices and reads its figures (per device). copies_threshold:
    the bytes from which a copy counts as large (default: the smallest weight matrix a
    device holds, so that a copy of any weight counts); cuda: also lower for CUDA and give
    the bytes-accessed ratio (`Program.cuda_ratio`) and its data-dependent control flow
    (`Program.branching`). A program compiled for a GPU (`gpu_slice`) gives the ratio of its
    own kernels' traffic whether or not cuda is set."""
    start = time.perf_counter()
    compiled = spec.fn.lower(*spec.args, **spec.kwargs).compile()
    seconds = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    weights = device_nbytes(spec.params)
    threshold = copies_threshold or _default_threshold(spec.params)
    text = compiled.as_text()
    ratio = branching = None
    if spec.platform == "gpu":
        ratio = traffic(text) / spec.must_read
    elif cuda:
        accessed = cuda_bytes(spec)
        ratio = None if accessed is None else accessed / spec.must_read
    if cuda:
        branching = control_flow(spec)
    return Program(spec.name, spec.platform, seconds, int(analysis.argument_size_in_bytes),
                   int(analysis.output_size_in_bytes), int(analysis.temp_size_in_bytes), weights,
                   large_copies(text, threshold), ratio, branching)


def _default_threshold(params) -> int:
    """The smallest weight matrix one device holds: a copy of any weight is at least that."""
    sizes = [device_nbytes([x]) for x in jax.tree.leaves(params) if len(x.shape) >= 2]
    return max(min(sizes, default=1), 1)


def report(programs, title: str = "") -> str:
    """A table of programs' figures, per device."""
    lines = [title] if title else []
    lines.append(f"{'program':<34} {'compile':>8} {'weights':>10} {'temps':>10} {'temps/w':>8} {'cuda/ideal':>10}"
                 f" {'branch':>6}  large copies")
    for p in programs:
        cuda = "-" if p.cuda_ratio is None else f"{p.cuda_ratio:.2f}"
        branch = "-" if p.branching is None else str(len(p.branching))
        copies = "none" if not p.copies else "; ".join(map(str, p.copies[:4])) + (
            f"; +{len(p.copies) - 4} more" if len(p.copies) > 4 else "")
        lines.append(f"{p.name:<34} {p.compile_seconds:7.1f}s {p.weights / MB:9.1f}M {p.temporaries / MB:9.1f}M "
                     f"{p.temporaries_over_weights:8.3f} {cuda:>10} {branch:>6}  {copies}")
    return "\n".join(lines)


def step_programs(target: Model, draft: Model | None, slice_: Slice, context: int = 512, K: int = 4,
                  prompt_len: int | None = None) -> list[Spec]:
    """The programs of one decode step and of generate, as the instrument reports them: the
    one-token pass, the verification pass of K+1 tokens, the draft step, the plain loop and
    the loop with a chain of K (draft: None leaves out the draft's). Batch 1 on one chip;
    on a slice, batch 2 on a (data 2, model chips/2) mesh, the draft replicated. The loops
    read a prompt of prompt_len (default: a quarter of the context) and fill the context."""
    prompt_len = prompt_len or context // 4
    where = on_device(slice_.devices[0]) if slice_.chips == 1 else on_mesh(slice_.mesh(2, slice_.chips // 2))
    B = 1 if slice_.chips == 1 else 2
    new = context - prompt_len
    replicated = (("batch", "data"),)
    specs = [pass_program(target, where, batch=B, context=context),
             verify_program(target, where, K, batch=B, context=context)]
    if draft is not None:
        specs.append(draft_program(target, draft, where, batch=B, prompt_len=prompt_len, max_new_tokens=new,
                                   num_draft_tokens=K, draft_rules=replicated, name=f"draft step K={K}"))
    specs.append(loop_program(target, None, where, batch=B, prompt_len=prompt_len, max_new_tokens=new,
                              name="plain loop"))
    if draft is not None:
        specs.append(loop_program(target, draft, where, batch=B, prompt_len=prompt_len, max_new_tokens=new,
                                  num_draft_tokens=K, draft_rules=replicated, name=f"loop chain K={K}"))
    return specs


def instrument(target: Model, draft: Model | None, slice_name: str, context: int = 512, K: int = 4,
               prompt_len: int | None = None, title: str = "", log=print) -> list[Program]:
    """Compiles `step_programs` for the slice, with their CUDA figures, and logs their table
    (`report`); a program that does not compile (out of HBM, say) is logged with XLA's words
    and left out. Returns the programs that compiled."""
    slice_ = accelerator(slice_name)
    programs = []
    for spec in step_programs(target, draft, slice_, context=context, K=K, prompt_len=prompt_len):
        try:
            programs.append(compile_spec(spec, cuda=True))
        except Exception as e:  # noqa: BLE001 - out of HBM is an answer too
            log(f"{spec.name} on {slice_name}: does not compile: {' '.join(str(e).split())[:300]}")
    log(report(programs, title or f"\n## on {slice_name} ({slice_.chips} chips, {slice_.hbm / 2**30:.0f} GiB each)"))
    return programs
