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

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import tiny  # noqa: E402

# A persistent compilation cache for this session only (a fresh, empty folder each run,
# removed at exit): a program a later module needs again after `_release_compiled_programs`
# is read back from disk instead of compiled again (compiling is most of the suite's time on
# CPU). Keys are XLA's fingerprints of the whole program, so a changed program (a
# monkeypatched rule, another shape) never hits an old entry; the in-memory jit caches,
# which the compile-once tests count, are untouched. Each process has its own folder (XLA's
# key holds the folder's path; one folder shared by the workers measured no faster, and a
# process could read an entry another is still writing). JAX_COMPILATION_CACHE_DIR, if set,
# is used instead (and kept).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    cache_dir = tempfile.mkdtemp(prefix="specjax-test-jax-cache-")
    atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs too
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# The fast tier, `python -m pytest -m fast` (about a minute on 2 cores): pure functions and
# tiny programs, for a developer at work; CI runs the whole suite. Module -> the fixtures
# that make one of its tests slow (they build and compile models); empty: all are fast.
FAST = {"test_config.py": set(), "test_house.py": set(), "test_text.py": set(), "test_fuzz.py": set(),
        "test_scheduler.py": set(),
        "test_auto_k.py": {"pair"}, "test_sampling.py": {"tiny_pair"}}


# The longest modules first (seconds of their tests on 2 cores, 2026-11-28, `--durations=0`):
# xdist's --dist loadfile hands modules out in collection order as workers free up, so the
# longest going first keeps one worker from running a long module alone at the end.
LONGEST_FIRST = ("test_serve.py", "test_engine.py", "test_tree.py", "test_generate.py", "test_aot.py",
                 "test_sharding.py", "test_long_context.py", "test_grammar.py", "test_engine_pages.py",
                 "test_heads.py", "test_mtp.py", "test_drafters.py", "test_published.py", "test_sampling.py",
                 "test_logprobs.py",
                 "test_cli.py", "test_exact.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow = FAST.get(item.path.name)
        if slow is not None and not slow & set(item.fixturenames):
            item.add_marker(pytest.mark.fast)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's tests keep their order


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
