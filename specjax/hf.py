"""Hugging Face folders (config.json + *.safetensors) <-> `Model`.

The tables of layouts.py say, for every Hugging Face tensor, its name, its shape, which
specjax parameter(s) it becomes and how. Loading checks every tensor against the table
(missing, unexpected, wrong shape) before converting, then streams each parameter of each
layer out of the memory-mapped files into its device buffer(s); saving runs the same
table backwards, so what `save_model` writes loads in transformers. Folders are found and
their files checked by folders.py, config.json's values read by config.py and hf_config.py,
tokenizers loaded by text.py. This module knows nothing about decoding.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax import quant, sharding
from specjax.config import GenerationConfig, ModelConfig
from specjax.folders import (
    CheckpointError,
    UnsafeCheckpointError,
    _read_json,
    check_regular,
    resolve,
)
from specjax.layouts import Concat, expected_tensors, layout, mtp_layout
from specjax.models import ATTENTION, Model, default_dtype, layers
from specjax.text import load_tokenizer

# Buffers some checkpoints carry that hold no weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


# ---- reading ---------------------------------------------------------------------------

# Weights stored with pickle (torch.save): unpickling runs whatever code the file names.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")
# Tensors are copied out of their files this many bytes at a time, each piece's file pages
# dropped before the next: loading holds little more than the parameters themselves.
CHUNK_BYTES = 4 * 2**20
PROGRESS_BYTES = 2**30  # checkpoints at least this large show a progress bar by default
SAFETENSORS_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "F32": np.float32, "F64": np.float64, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
# Diagnostics of the last load: elements copied out of checkpoint tensors (a tensor
# placed on n devices whole counts n times; a split one once).
stats = {"elements_read": 0}


def _read_hf_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{folder} has no config.json")
    return _read_json(config_file)


def read_config(folder: Path) -> ModelConfig:
    """config.json as a ModelConfig; nonsensical values raise InvalidConfigError."""
    return ModelConfig.from_hf_config(_read_hf_config(folder))


def read_generation_config(folder: Path, hf_config: dict | None = None,
                           vocab_size: int | None = None) -> GenerationConfig:
    """generation_config.json (stop ids, sampling defaults); without one, config.json's ids."""
    hf_config = _read_hf_config(folder) if hf_config is None else hf_config
    file = folder / "generation_config.json"
    return GenerationConfig.from_hf(_read_json(file) if file.exists() else None, hf_config, vocab_size)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map object of file names")
        names = set(weight_map.values())
        outside = sorted(str(f) for f in names if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")
                         or "\x00" in f)
        if outside:
            raise CheckpointError(f"{index} names shard files outside its folder (only plain file names are "
                                  f"allowed): {outside[:4]}")
        files = [check_regular(folder / f) for f in sorted(names)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = [check_regular(f) for f in sorted(folder.glob("*.safetensors"))]
    if not files:
        pickles = sorted({f.name for pattern in PICKLE_PATTERNS for f in folder.glob(pattern)})
        if pickles:
            raise UnsafeCheckpointError(
                f"{folder} holds its weights as pickle ({', '.join(pickles[:4])}), which specjax "
                f"refuses: loading a pickle runs any code its author put in it. Convert it once, "
                f"where you trust the file, to safetensors: python -c \"import transformers as t; "
                f"t.AutoModelForCausalLM.from_pretrained('{folder}').save_pretrained('OUT')\" "
                f"(transformers reads it with torch.load(weights_only=True) and writes safetensors)")
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    return files


class _Stored:
    """One tensor of a safetensors file, read only where indexed: `array()` maps its bytes
    (nothing is read yet), indexing it reads those pages, `release()` drops the pages read
    so far from this process's memory (they stay in the OS page cache)."""

    def __init__(self, file: Path, name: str, dtype, shape: tuple[int, ...], start: int, end: int):
        self.file, self.name, self.dtype, self.shape = file, name, np.dtype(dtype), shape
        self.start, self.end = start, end  # absolute byte range in the file
        self._map = self._array = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def array(self) -> np.ndarray:
        if self._array is None:
            if self.nbytes == 0:
                self._array = np.zeros(self.shape, self.dtype)
            else:
                offset = self.start - self.start % mmap.ALLOCATIONGRANULARITY
                with open(self.file, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), self.end - offset, offset=offset,
                                          access=mmap.ACCESS_READ)
                self._array = np.frombuffer(self._map, self.dtype, int(np.prod(self.shape)),
                                            self.start - offset).reshape(self.shape)
        return self._array

    def release(self):
        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self):
        self.release()
        self._array = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the collector will close it
                pass
            self._map = None


class _InMemory:
    """A numpy array behind _Stored's interface (params_from_tensors)."""

    def __init__(self, name: str, array):
        self.name, self._array = name, np.asarray(array)
        self.shape, self.dtype, self.nbytes = self._array.shape, self._array.dtype, self._array.nbytes

    def array(self):
        return self._array

    def release(self):
        pass

    def close(self):
        pass


def _read_header(file: Path) -> dict[str, _Stored]:
    """A safetensors file's tensors from its JSON header alone; every entry is checked
    against the file's size, so a truncated or corrupt file is named before any read."""
    size = file.stat().st_size

    def corrupt(why):
        return CheckpointError(f"{file} is corrupt or truncated: {why}")

    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt(f"{size} bytes, too short for a safetensors header")
            n = int.from_bytes(prefix, "little")
            if n > min(size - 8, 100 * 2**20):
                raise corrupt(f"its header claims {n} bytes")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(f"its header is not valid JSON ({e})") from e
    except RecursionError:
        raise corrupt("its header nests its JSON too deeply") from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError) as e:
            raise corrupt(f"tensor {name} has a malformed header entry {entry!r} ({e!r})") from e
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            raise corrupt(f"tensor {name}'s shape {shape!r} and data_offsets {offsets!r} must be lists of integers")
        begin, end = offsets
        expected = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
        if min(shape, default=0) < 0 or end - begin != expected or begin < 0:
            raise corrupt(f"tensor {name} ({entry['dtype']} {list(shape)}) spans bytes "
                          f"[{begin}, {end}) of its data, which should be {expected} bytes")
        if 8 + n + end > size:
            raise corrupt(f"tensor {name} ends at byte {8 + n + end} of a {size}-byte file")
        out[name] = _Stored(file, name, dtype, tuple(shape), 8 + n + begin, 8 + n + end)
    covered = 0  # as the format requires: the tensors tile the data, none overlapping
    for stored in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if stored.start != 8 + n + covered:
            raise corrupt(f"tensor {stored.name} starts at byte {stored.start - 8 - n} of its data, but the tensors "
                          f"before it end at {covered} (tensors must tile the data, none overlapping)")
        covered = stored.end - 8 - n
    return out


def _ints(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def read_sources(folder: Path) -> dict[str, _Stored]:
    """Every tensor of a folder's safetensors file(s), located but not read."""
    sources: dict[str, _Stored] = {}
    for file in _safetensors_files(folder):
        for name, stored in _read_header(file).items():
            if name in sources:
                raise CheckpointError(f"tensor {name} is in both {sources[name].file.name} and {file.name}")
            sources[name] = stored
    return sources


def params_from_tensors(tensors: dict[str, np.ndarray], config: ModelConfig, dtype,
                        mesh=None, rules=None, quantize: str | None = None) -> dict:
    """In-memory tensors (Hugging Face names) -> params, checked as load_model checks files."""
    sources = {name: _InMemory(name, t) for name, t in tensors.items()}
    return _params(sources, config, dtype, mesh, rules, progress=False, quantize=quantize)


def _check_tensors(sources: dict, config: ModelConfig, mtp_layers: int = 0) -> dict:
    """The sources under their canonical names, once every tensor the layout needs is there
    with the shape the config implies and none is left unexplained (but the mtp_layers
    multi-token-prediction layers' after the decoder's, `_mtp_layer`)."""
    sources = {_canonical(name, config): t for name, t in sources.items()}
    if config.num_layers > len(sources):  # every layer has tensors: don't list a billion names
        raise CheckpointError(f"config.json asks for {config.num_layers} layers, but the checkpoint holds "
                              f"{len(sources)} tensors in all")
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(sources))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors the config needs: "
                              f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(n for n in set(sources) - set(expected) if not _ignorable(n, config, mtp_layers))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensors the config does not "
                              f"explain: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    head, embedding = sources.get("lm_head.weight"), sources.get(
        "transformer.wte.weight" if config.family == "gpt2" else "model.embed_tokens.weight")
    if config.tie_word_embeddings and head is not None and embedding is not None and not (
            head.shape == embedding.shape and np.array_equal(head.array(), embedding.array())):
        raise CheckpointError("config.json says tie_word_embeddings=true, but the checkpoint's lm_head.weight "
                              "differs from its embedding (transformers would keep the head untied)")
    for name, shape in expected.items():
        if tuple(sources[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(sources[name].shape)}, "
                                  f"but the config implies {shape}")
        if not jnp.issubdtype(sources[name].dtype, jnp.floating):
            raise CheckpointError(f"tensor {name} is {sources[name].dtype}, not a floating-point type")
    return sources


def _params(sources: dict, config: ModelConfig, dtype, mesh, rules, progress, quantize=None,
            kv_repeat: int = 1, mtp_layers: int = 0) -> dict:
    """Checks every tensor against the layout, then converts and places one parameter of one
    layer at a time, each straight into its device buffer (and with a mesh, its shards).
    kv_repeat: copies of each kv head in the q/k/v weights (see sharding.kv_repeat).
    mtp_layers: the multi-token-prediction layers config.json declares (num_nextn_predict_layers),
    whose tensors the model leaves to its MTP drafter (drafters/mtp.py)."""
    quant.check_method(quantize)
    sources = _check_tensors(sources, config, mtp_layers)
    jobs = [(w, i) for w in layout(config) for i in w.indices(config.num_layers)]
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    _convert(sources, jobs, lambda i: params if i is None else params["layers"][i], dtype, mesh, rules, progress,
             quantize, kv_repeat)
    return params


def _convert(sources: dict, jobs: list, tree_of, dtype, mesh=None, rules=None, progress=None, quantize=None,
             kv_repeat: int = 1):
    """Converts and places the (Weights, layer number) jobs' parameters, one at a time, into
    tree_of(layer number) (a dict; tree_of(None): the one whole-model parameters go into),
    then closes every source. The sources are checked already."""
    dtype = np.dtype(dtype)
    stats["elements_read"] = 0
    total = sum(sources[n].nbytes for w, i in jobs for n in w.names(i))
    bar = None
    if progress or (progress is None and total >= PROGRESS_BYTES):
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading")
    try:
        for w, i in jobs:
            stored = [sources[n] for n in w.names(i)]
            for k, path in enumerate(w.paths):
                def view(w=w, k=k, stored=stored, path=path):  # the param in our layout, unread
                    x = w.to_ours(tuple(s.array() for s in stored))[k]
                    if kv_repeat > 1 and path[-1] in sharding.KV_HEAD_PARAMS:
                        x = sharding.regroup_kv_heads(np.asarray(x), kv_repeat)
                    return x

                full_path = path if i is None else ("layers", str(i)) + path
                tree = tree_of(i)
                if quantize and quant.quantizable(path):
                    _set(tree, path, _quantized(view, stored, dtype, full_path, mesh, rules))
                else:
                    _set(tree, path, _assemble(view, stored, dtype, full_path, mesh, rules))
            for s in stored:
                s.close()
            if bar is not None:
                bar.update(sum(s.nbytes for s in stored))
    finally:
        if bar is not None:
            bar.close()
        for s in sources.values():
            s.close()


def _assemble(view, stored, dtype, path, mesh, rules) -> jax.Array:
    """One parameter, read from its tensor(s) through `view` and placed. Each device's block
    is copied out of the mapped file(s) into a fresh host buffer of the final dtype,
    CHUNK_BYTES of the file at a time, the file's pages dropped after each; device_put then
    moves the buffer to its device (on CPU it adopts the 64-byte-aligned buffer without a
    copy). Host memory thus peaks near the parameters themselves, and no program is
    compiled. Each device's block reads only its own slice of the files (of each file, for
    a parameter that joins several tensors)."""
    shape = view().shape

    def release():
        for s in stored:
            s.release()

    def block(index: tuple[slice, ...]) -> np.ndarray:
        """The parameter's block `index` (a tuple of slices), in dtype."""
        src = view()
        pieces = src.parts_in(index) if isinstance(src, Concat) else [(src, index, ())]
        out = _aligned_empty(tuple(len(range(*s.indices(n))) for s, n in
                                   zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)), dtype)
        for part, src_index, dst_index in pieces:
            _copy(out[dst_index], part[src_index], release, "parameter " + "/".join(map(str, path)))
        stats["elements_read"] += out.size
        return out

    return jax.make_array_from_callback(shape, _placement(shape, path, mesh, rules), block)


def _copy(dst: np.ndarray, src: np.ndarray, release, name: str):
    """dst[...] = src (a view of mapped files), CHUNK_BYTES of the file at a time along its
    axis of largest stride (the file's outermost, so pieces are contiguous bytes), calling
    release() after each piece to drop the file pages it touched. Values `check_finite`
    refuses (in the parameter `name`) are refused piece by piece."""
    if src.ndim == 0:
        dst[...] = src
        release()
        check_finite(dst, name)
        return
    axis = max(range(src.ndim), key=lambda a: src.strides[a] if src.shape[a] > 1 else -1)
    rows = src.shape[axis]
    step = max(1, CHUNK_BYTES * rows // max(src.size * src.itemsize, 1))
    for lo in range(0, rows, step):
        cut = (slice(None),) * axis + (slice(lo, lo + step),)
        dst[cut] = src[cut]
        release()
        check_finite(dst[cut], name)


# No trained weight comes near this magnitude; past it, a matmul of a few thousand terms
# overflows float32 and bfloat16 (3.4e38), and every logit is NaN or infinite.
MAX_WEIGHT = 1e15


def check_finite(values: np.ndarray, name: str):
    """Raises CheckpointError if weights `name` hold NaN, infinite or absurd (past
    MAX_WEIGHT) values: every logit would be NaN or overflow."""
    if values.size and not np.abs(values).max() <= MAX_WEIGHT:  # NaN compares false
        raise CheckpointError(f"{name} holds NaN, infinite or absurd values (magnitude "
                              f"{np.abs(values.astype(np.float32)).max():.3g}, past {MAX_WEIGHT:.0e}): every "
                              f"logit would overflow")


def _quantized(view, stored, dtype, path, mesh, rules) -> quant.Int8:
    """One matmul weight, read whole onto the host, quantised to int8 there, then placed
    (with a mesh, each device gets its shards of the weight and of its scales). Host memory
    peaks at this one float parameter on top of what is already loaded."""
    value = np.asarray(view())
    stats["elements_read"] += value.size
    check_finite(value, "parameter " + "/".join(map(str, path)))
    q = quant.quantize_array(value, quant.CONTRACTED[path[-1]], jnp.dtype(dtype))
    if mesh is None:
        return jax.tree.map(jnp.asarray, q)
    placement = sharding.param_sharding(path, q, mesh, rules or sharding.DEFAULT_RULES)
    return jax.tree.map(sharding.put, q, placement)


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """np.empty aligned to `align` bytes (what XLA's CPU client needs to adopt it uncopied)."""
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n].view(dtype).reshape(shape)


def _placement(shape, path, mesh, rules):
    if mesh is None:  # this process's first device (in a job of several processes, devices()[0] is process 0's)
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    from jax.sharding import NamedSharding

    axes = sharding.logical_axes(path, len(shape))
    return NamedSharding(mesh, sharding.spec(shape, axes, mesh, rules or sharding.DEFAULT_RULES))


def load_model(path: str | os.PathLike, dtype=None, mesh=None, rules=None,
               progress: bool | None = None, quantize: str | None = None,
               duplicate_kv_heads: bool = True, attention: str = "auto") -> Model:
    """Loads a Hugging Face folder (or hub id) of a supported architecture.

    dtype: parameter dtype (with quantize: of the scales, norms and activations); default
    float32 on CPU, bfloat16 on TPU/GPU.
    mesh, rules: place each parameter straight into its shards (see specjax.sharding);
    no device ever holds a whole tensor that the rules split, and each process reads only
    the slices its own devices hold. With fewer kv heads than the axis they go on, each kv
    head is repeated as it is read (see `specjax.sharding.kv_repeat`; duplicate_kv_heads=False
    splits head_dim instead).
    progress: a progress bar (None: for checkpoints of 1 GiB or more).
    quantize: "int8" for int8 weight-only quantisation (see specjax.quant), None for none.
    attention: "auto" (default: the kernels where they have been measured, a GPU), "portable"
    or "kernels": whether its passes take the fused attention kernels of the platform a
    program is built for, where one applies (see Model.attention).

    Everything is checked before anything is allocated: config.json's values, that the
    weights are safetensors (pickle is refused), every tensor's name and shape. Then the
    tensors are read lazily, one parameter at a time, through memory maps: host memory
    peaks near the parameters' own size, not twice it. generation_config.json (stop ids,
    sampling defaults) becomes `model.generation_config`."""
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating-point type (activations take it), got {jnp.dtype(dtype)}; "
                         f"for int8 weights pass quantize='int8'")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION))}, got {attention!r}")
    folder = resolve(path)
    hf_config = _read_hf_config(folder)
    config = ModelConfig.from_hf_config(hf_config)
    generation = read_generation_config(folder, hf_config, config.vocab_size)
    sources = read_sources(folder)
    rules = None if mesh is None else tuple(rules or sharding.DEFAULT_RULES)
    repeat = sharding.kv_repeat(config, mesh, rules) if mesh is not None and duplicate_kv_heads else 1
    params = _params(sources, config, dtype or default_dtype(), mesh, rules, progress, quantize, repeat,
                     declared_mtp_layers(hf_config))
    if repeat > 1:
        config = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * repeat)
    return Model(config, params, generation, rules=rules, attention=attention)


def declared_mtp_layers(hf_config: dict) -> int:
    """The multi-token-prediction layers config.json declares (num_nextn_predict_layers; its
    type checked with the other counts, hf_config.py), 0 where it names none."""
    return hf_config.get("num_nextn_predict_layers") or 0


def read_mtp(folder: Path, layer: int | None, dtype) -> tuple[ModelConfig, int, dict]:
    """MTP layer `layer` (0 .. n-1, stored as layer L + layer; None: the only one) of a target's folder whose
    config.json declares n = num_nextn_predict_layers, read through the table of
    `layouts.mtp_layout` as `load_model` reads a model: every tensor of that layer there with
    the shape the target's config implies, floating, none unexplained, then placed in dtype.
    Its shared_head.head (and embed_tokens, where it has one) is left out where it equals the
    target's own lm_head (embedding), as DeepSeek-V3's copies do: the drafter then reads the
    target's. Returns (the target's config, n, the layer's params: `mtp_layout`'s paths)."""
    hf_config = _read_hf_config(folder)
    config = ModelConfig.from_hf_config(hf_config)
    n = declared_mtp_layers(hf_config)
    L = config.num_layers
    if n == 0:
        raise CheckpointError(f"{folder}/config.json declares no multi-token-prediction layers "
                              f"(num_nextn_predict_layers is {hf_config.get('num_nextn_predict_layers')!r}): this "
                              f"target ships no MTP drafter; train one with `specjax train-mtp`")
    if layer is None and n > 1:
        raise ValueError(f"{folder} ships {n} MTP layers (stored as layers {L}..{L + n - 1}); specjax drafts every "
                         f"depth with one of them, re-applied: choose it with Mtp.load(folder, layer=k), k in "
                         f"0..{n - 1} (0: the one trained for the next token but one)")
    layer = 0 if layer is None else layer
    if type(layer) is not int or not 0 <= layer < n:
        raise ValueError(f"{folder} has {n} MTP layer(s) (0..{n - 1}, stored as layers {L}..{L + n - 1}); "
                         f"layer {layer!r} is none of them")
    sources = {_canonical(name, config): t for name, t in read_sources(folder).items()}
    i = L + layer
    prefix = f"model.layers.{i}."
    mine = {name: t for name, t in sources.items() if name.startswith(prefix)}
    embedding = prefix + "embed_tokens.weight" in mine
    specs = mtp_layout(config, n, (i,), embedding)
    expected = {name.format(i=i): shape for w in specs for name, shape in w.hf}
    where = (f"{folder}: config.json declares {n} multi-token-prediction layer(s) after its {L} decoder layers, "
             f"but MTP layer {layer} (model.layers.{i}.*)")
    missing = sorted(set(expected) - set(mine))
    if missing:
        found = "has no tensors at all" if not mine else f"lacks {len(missing)} tensors its config implies"
        raise CheckpointError(f"{where} {found}: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexplained = sorted(name for name in set(mine) - set(expected) if not name.endswith(IGNORED_SUFFIXES))
    if unexplained:
        raise CheckpointError(f"{where} has {len(unexplained)} tensors the config does not explain: "
                              f"{unexplained[:8]}{' ...' if len(unexplained) > 8 else ''}")
    for name, shape in expected.items():
        if tuple(mine[name].shape) != tuple(shape):
            raise CheckpointError(f"{folder}: tensor {name} (MTP layer {layer}) has shape {list(mine[name].shape)}, "
                                  f"but the target's config implies {list(shape)}")
        if not jnp.issubdtype(mine[name].dtype, jnp.floating):
            raise CheckpointError(f"{folder}: tensor {name} is {mine[name].dtype}, not a floating-point type")
    copies = {"head": ("shared_head.head.weight",
                       "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"),
              "embedding": ("embed_tokens.weight", "model.embed_tokens.weight")}
    shared = {path for path, (own, target) in copies.items()
              if prefix + own in mine and _same_tensor(mine[prefix + own], sources.get(target))}
    jobs = [(w, i) for w in specs if w.paths[0][0] not in shared]
    params: dict = {}
    for name, t in sources.items():
        if name not in mine:
            t.close()
    _convert(mine, jobs, lambda _: params, dtype)
    return config, n, params


def _same_tensor(a, b, rows: int = 4096) -> bool:
    """Whether two stored tensors hold the same values (b may be None), compared a block of
    rows at a time (no copy of either is held whole)."""
    if b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = a.array(), b.array()
    same = all(np.array_equal(x[r:r + rows], y[r:r + rows]) for r in range(0, max(x.shape[0], 1), rows))
    a.release()
    b.release()
    return same


# ---- writing ---------------------------------------------------------------------------


def tensors_from_params(model: Model) -> dict[str, np.ndarray]:
    """Hugging Face tensors of a model's params (int8 weights written dequantised)."""
    c = model.config
    params = jax.tree.map(lambda w: np.asarray(jax.device_get(layers.dequantize(w))), model.params,
                          is_leaf=lambda x: isinstance(x, quant.Int8))
    out = {}
    for w in layout(c):
        for i in w.indices(c.num_layers):
            tree = params if i is None else params["layers"][i]
            out.update(zip(w.names(i), w.to_hf(tuple(_get(tree, p) for p in w.paths))))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_model(model: Model, path: str | os.PathLike, dtype=None, tokenizer=None) -> Path:
    """Writes config.json + model.safetensors (+ generation_config.json when the model has
    one) that specjax and transformers both load; files get the usual mode (0644 under a
    022 umask).

    dtype: storage dtype (default: the params' own; an int8 model is written dequantised,
    in its scales' dtype, so what loads back computes what the int8 model computed).
    tokenizer: also save this tokenizer beside the weights (a transformers tokenizer, e.g.
    `load_tokenizer(...)`'s, or the folder or hub id to load it from), so that the folder
    is whole for `specjax generate --target FOLDER`; None saves none."""
    from safetensors.numpy import save_file

    if tokenizer is not None and isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)  # refused before anything is written
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must be a transformers tokenizer, a folder or a hub id, got "
                        f"{type(tokenizer).__name__}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tensors_from_params(model)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = hf["dtype"] = str(next(iter(tensors.values())).dtype)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if model.generation_config is not None:
        (folder / "generation_config.json").write_text(
            json.dumps(model.generation_config.to_hf(), indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(folder / "model.safetensors", 0o666 & ~_umask())  # save_file renames a private (0600) temp file
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def _umask() -> int:
    """This process's umask (read without changing it where Linux tells it)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


# ---- helpers ---------------------------------------------------------------------------


def _canonical(name: str, config: ModelConfig) -> str:
    """GPT-2 checkpoints saved from GPT2Model (the original hub files) lack `transformer.`."""
    if config.family == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def _ignorable(name: str, config: ModelConfig, mtp_layers: int = 0) -> bool:
    return (name.endswith(IGNORED_SUFFIXES) or (config.tie_word_embeddings and name == "lm_head.weight")
            or _mtp_layer(name, config, mtp_layers) is not None)


# The model types whose checkpoints hold multi-token-prediction modules past the decoder
# whatever their config declares (DeepSeek-V3, GLM-4.5).
MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe")


def _mtp_layer(name: str, config: ModelConfig, mtp_layers: int = 0) -> int | None:
    """The number of the multi-token-prediction layer (num_nextn_predict_layers: layers L ..
    L+n-1 after the decoder's L, which transformers does not load either; specjax's MTP
    drafter does, drafters/mtp.py) a tensor belongs to, or None. A DeepSeek-V3 or GLM-4.5
    checkpoint's layers past its decoder's are its MTP layers whatever it declares."""
    parts = name.split(".")
    if not (parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit()):
        return None
    i = int(parts[2])
    last = float("inf") if config.model_type in MTP_MODEL_TYPES else config.num_layers + mtp_layers
    return i if config.num_layers <= i < last else None


def _set(tree: dict, path: tuple[str, ...], value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
