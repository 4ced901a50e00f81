"""Before you rent a TPU or a GPU: will this pair run on that slice, at this batch and length,
and on which mesh? `plan` reads only config.json (a local folder, a hub id when online, or a
ModelConfig), builds the models from shapes, compiles `generate`'s real program for the
devices here (aot.py: XLA's TPU compiler, or its GPU compiler through jax's CUDA plugin; no
TPU or GPU needed) for every (data, model) mesh of its chips that the batch allows, and
reads per device what the program needs.

It knows configs, meshes and compiled programs' figures; it reads no weights and runs
nothing.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import jax.numpy as jnp

from specjax import budget
from specjax.tools import aot
from specjax.config import ModelConfig
from specjax.memory import GB, MB, device_nbytes, nbytes


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """One (data, model) mesh's program, per device."""

    data: int
    model: int
    fits: bool
    weights: int = 0
    caches: int = 0
    temporaries: int = 0  # caches included
    total: int = 0  # arguments + outputs + temporaries
    compile_seconds: float = 0.0
    program: aot.Program | None = None
    why: str = ""  # why it does not fit (XLA's words), or why it was not compiled

    @property
    def name(self) -> str:
        return f"{self.data}x{self.model}"


@dataclasses.dataclass(frozen=True)
class Plan:
    topology: str
    hbm: int  # per device
    request: str  # what was planned, in words
    meshes: tuple[MeshPlan, ...]
    advice: str  # what to change when nothing fits

    @property
    def recommended(self) -> MeshPlan | None:
        """The fitting mesh that splits the model the least (least communication per layer)."""
        fitting = [m for m in self.meshes if m.fits]
        return min(fitting, key=lambda m: (m.model, -m.data)) if fitting else None

    @property
    def fits(self) -> bool:
        return self.recommended is not None

    def __str__(self):
        chips = self.meshes[0].data * self.meshes[0].model if self.meshes else 0
        lines = [f"plan: {self.request}", f"slice {self.topology}: {chips} chips, {self.hbm / GB:.1f} GiB HBM each; "
                 f"per device:",
                 f"  {'mesh':<9} {'weights':>10} {'caches':>10} {'temps':>10} {'total':>10} {'free':>10} "
                 f"{'compile':>8}  fits"]
        for m in self.meshes:
            if m.program is None:
                weights = _gb(m.weights) if m.weights else f"{'':>10}"
                lines.append(f"  {m.name:<9} {weights} {'':>10} {'':>10} {'':>10} {'':>10} {m.compile_seconds:7.1f}s  "
                             f"no: {m.why}")
                continue
            free = self.hbm - m.total
            lines.append(f"  {m.name:<9} {_gb(m.weights)} {_gb(m.caches)} {_gb(m.temporaries)} {_gb(m.total)} "
                         f"{_gb(free)} {m.compile_seconds:7.1f}s  {'yes' if m.fits else 'no'}")
        best = self.recommended
        if best is not None:
            p = best.program
            copies = "none" if not p.copies else "; ".join(map(str, p.copies[:3])) + (
                f"; +{len(p.copies) - 3} more" if len(p.copies) > 3 else "")
            lines += [f"recommended mesh: data={best.data}, model={best.model} (--mesh {best.data},{best.model})",
                      f"  its step: temporaries {p.temporaries_over_weights:.2f}x the weights; weight- or cache-sized "
                      f"copies: {copies}"]
        else:
            lines.append(f"does not fit: {self.advice}")
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / GB:8.2f}G" if abs(n) >= 100 * MB else f"{n / MB:8.1f}M"


def read_config(source) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a config.json dict, a local folder (or its
    config.json), or a hub id (only its config.json is fetched)."""
    from specjax import hf

    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, dict):
        return ModelConfig.from_hf_config(source)
    path = Path(source)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return hf.read_config(path)
    name = str(source)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise hf.CheckpointError(f"{name} is neither a folder with a config.json nor a Hugging Face hub id")
    try:
        from huggingface_hub import hf_hub_download

        return hf.read_config(Path(hf_hub_download(name, "config.json")).parent)
    except hf.CheckpointError:
        raise
    except Exception as e:  # offline, unknown repo, no access
        raise hf.CheckpointError(f"{name} is not a local folder and its config.json could not be fetched from "
                                 f"the Hugging Face hub: {type(e).__name__}: {e}") from e


def meshes_for(chips: int) -> list[tuple[int, int]]:
    """Every (data, model) with data * model = chips, model first from 1."""
    return [(chips // m, m) for m in range(1, chips + 1) if chips % m == 0]


_OOM = re.compile(r"(?i)(ran out of memory|resource_exhausted|exceeds .*memory|hbm)")


def plan(target, draft=None, *, topology: str, batch: int = 1, prompt_len: int = 128, max_len: int | None = None,
         num_draft_tokens: int | None = 4, tree=None, mesh: tuple[int, int] | None = None, dtype=jnp.bfloat16,
         quantize: str | None = None, early_exit: int | None = None, log=None) -> Plan:
    """Compiles generate's loop for `batch` prompts of `prompt_len` tokens growing to `max_len`
    (max_new_tokens = max_len - prompt_len) on the TPU slice or GPUs `topology` ("v5e:2x4", "h100"), for
    `mesh` (data, model) or every mesh the chips and batch allow, and says per device what
    it needs. target, draft: folders, hub ids, config.json dicts or ModelConfigs (draft None:
    plain decoding, or early_exit=N: the target's first N layers); tree: a `Tree` for the
    draft model instead of a chain of num_draft_tokens; max_len None: 2048, or the target's
    max_position_embeddings where that is less."""
    from specjax.drafters import DraftModel, EarlyExit

    config = read_config(target)
    max_len = min(2048, config.max_position_embeddings) if max_len is None else max_len
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_len <= prompt_len:
        raise ValueError(f"max_len ({max_len}) must exceed prompt_len ({prompt_len}): it counts the prompt and "
                         f"the tokens generated after it")
    slice_ = aot.accelerator(topology)
    target_model = aot.abstract_model(config, dtype, quantize)
    drafter, K = None, None
    if early_exit is not None:
        drafter, K = EarlyExit(early_exit), num_draft_tokens
    elif draft is not None:
        d = aot.abstract_model(read_config(draft), dtype, quantize)
        drafter, K = (DraftModel(d, tree), None) if tree is not None else (d, num_draft_tokens)
    candidates = [mesh] if mesh is not None else meshes_for(slice_.chips)
    for data, model in candidates:
        if data * model != slice_.chips:
            raise ValueError(f"mesh {data}x{model} needs {data * model} chips; {topology} has {slice_.chips}")
    kind = "plain decoding" if drafter is None else (
        f"early exit {early_exit}, K={K}" if early_exit is not None else
        f"draft {'tree ' + str(tree) if tree is not None else f'chain K={K}'}")
    request = (f"{target_model.config.model_type} {target_model.config.num_params() / 1e9:.2f}B params "
               f"({jnp.dtype(dtype).name}{', int8' if quantize else ''}), {kind}; batch {batch}, prompt {prompt_len} "
               f"+ {max_len - prompt_len} new tokens")
    plans = []
    for data, model in candidates:
        if batch % data:
            plans.append(MeshPlan(data, model, False, why=f"batch {batch} does not divide data={data}"))
            continue
        where = (aot.on_device(slice_.devices[0]) if slice_.chips == 1
                 else aot.on_mesh(slice_.mesh(data, model)))
        held = device_nbytes(where.model(target_model).params)
        if held > slice_.hbm:  # no program can fit: not worth compiling
            plans.append(MeshPlan(data, model, False, weights=held, why=f"the target's weights alone are "
                                  f"{held / GB:.1f} GiB per device"))
            continue
        spec = aot.loop_program(target_model, drafter, where, batch=batch, prompt_len=prompt_len,
                                max_new_tokens=max_len - prompt_len, num_draft_tokens=K,
                                draft_rules=(("batch", "data"),))
        start = time.perf_counter()
        try:
            program = aot.compile_spec(spec)
        except Exception as e:  # noqa: BLE001 - XLA's out-of-memory is an error at compile time
            message = " ".join(str(e).split())
            if not _OOM.search(message):
                raise
            plans.append(MeshPlan(data, model, False, compile_seconds=time.perf_counter() - start,
                                  why=_oom_words(message)))
            continue
        caches = budget.cache_bytes(spec.args, spec.kwargs, per_device=True)
        plans.append(MeshPlan(data, model, program.total <= slice_.hbm, program.weights, caches,
                              program.temporaries, program.total, program.compile_seconds, program))
        if log:
            log(f"{data}x{model}: compiled in {program.compile_seconds:.1f} s")
    return Plan(topology, slice_.hbm, request, tuple(plans),
                _advice(target_model, drafter, slice_, batch, max_len, quantize))


def _oom_words(message: str) -> str:
    m = re.search(r"(Ran out of memory[^.]*\.[^.]*\.)", message)
    return (m.group(1) if m else message)[:300]


def _advice(target, drafter, slice_: aot.Slice, batch: int, max_len: int, quantize) -> str:
    weights = nbytes(target.params) + nbytes(aot.drafter_params(drafter))
    per_chip = weights / slice_.chips
    hints = []
    if per_chip > 0.8 * slice_.hbm:
        hints.append(f"the weights alone are {weights / GB:.1f} GiB, {per_chip / GB:.1f} GiB per chip even split "
                     f"over all {slice_.chips} chips ({slice_.hbm / GB:.0f} GiB each): use a slice with more "
                     f"chips or HBM" + ("" if quantize else ", or --quantize int8 (half the bytes)"))
    else:
        hints.append(f"the weights fit ({per_chip / GB:.1f} GiB per chip split over {slice_.chips}); the caches "
                     f"and temporaries do not: use a smaller --batch ({batch}) or --max-len ({max_len}), or more "
                     f"chips")
    return "; ".join(hints)
