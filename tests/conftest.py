"""Shared test setup: offline hub, CPU float32, and tiny random transformers models."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Programs compiled for TPU slices (tests/test_aot.py) load libtpu, which admits one process at
# a time unless each allows more: this process and the CLI's child processes may both compile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# A persistent compilation cache for this run only (a fresh, empty folder, removed at exit),
# shared by pytest's workers and every child process the tests start (notebook kernels, the
# CLI, sharded and multi-process checks), which inherit these variables: a program compiled
# once is read back from disk by any later process or module that needs it again (after
# `_release_compiled_programs`), instead of compiled again; compiling is most of the suite's
# time on CPU. XLA's cache key holds the folder's path, so only one shared folder lets
# processes share. Keys are XLA's fingerprints of the whole program, so a changed program
# (a monkeypatched rule, another shape) never hits an old entry; the in-memory jit caches,
# which the compile-once tests count, are untouched. (No size limit: with one, every write
# scans the whole folder. A process that reads an entry another is still writing fails to
# load it, warns, and compiles.)
# JAX_COMPILATION_CACHE_DIR, if set, is used instead (and kept).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny programs too
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
COMPILATION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import tiny  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops every compiled program after each test module. On CPU each compiled generate
    program holds ~750 memory mappings (measured), and the suite compiles hundreds: past
    Linux's default vm.max_map_count (65,530) XLA's compiler segfaults. Programs a later
    module needs are compiled again."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(name) -> (folder, torch model): a tiny random model saved once per session."""
    cache = {}

    def make(name):
        if name not in cache:
            model = tiny.build(name)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            cache[name] = (folder, model)
        return cache[name]

    return make


@pytest.fixture(scope="session")
def pair(hf_folder):
    """A tiny Llama target, a draft that agrees often, one that agrees rarely, and torch's copy."""
    import specjax

    folder, torch_model = hf_folder("llama")
    target = specjax.load_model(folder)
    return target, {"near": tiny.noisy(target, 0.002, 1), "far": tiny.noisy(target, 0.03, 2)}, torch_model
