"""Training text: the Python standard library's own source, a tokenizer for it, a
deterministic stream of training windows, and prompts from the held-out modules (for the
heads' probe, the bench and the notebooks).

The corpus is every `.py` file of the running interpreter's standard library outside test
folders and site-packages. Whole modules (top-level packages or files) are held out for
evaluation: those named in HELD_OUT plus a fixed 2% chosen by a hash of their name, so the
split is the same on every machine. Batches are a pure function of (seed, step): a run that
resumes at step s sees exactly the batches an uninterrupted run would have.
This module knows nothing about models.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

HELD_OUT = ("json", "csv", "textwrap", "heapq", "fractions", "statistics", "shlex", "difflib")
EOS = "<|endoftext|>"


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def module_of(path: Path, root: Path) -> str:
    """The top-level module a file belongs to: json/decoder.py -> json; heapq.py -> heapq."""
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_held_out(module: str) -> bool:
    digest = int(hashlib.sha256(module.encode()).hexdigest(), 16)
    return module in HELD_OUT or digest % 50 == 0


def split_corpus(root: str | Path | None = None) -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out module names)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, held, held_modules = [], [], set()
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        module = module_of(path, root)
        if is_held_out(module):
            held.append(text)
            held_modules.add(module)
        else:
            train.append(text)
    return train, held, sorted(held_modules)


def held_out_prompts(tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Windows of held-out standard-library code (modules the shipped pair never saw),
    each starting at a line that opens a def or class."""
    _, texts, _ = split_corpus()
    rng = np.random.RandomState(seed)
    prompts = []
    for _ in range(1000):
        if len(prompts) == num_prompts:
            break
        text = texts[rng.randint(len(texts))]
        starts = [i for i, line in enumerate(text.splitlines(keepends=True))
                  if line.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        lines = text.splitlines(keepends=True)
        start = starts[rng.randint(len(starts))]
        ids = tokenizer.encode("".join(lines[start:]), add_special_tokens=False)
        if len(ids) >= prompt_tokens + 64:
            prompts.append(ids[:prompt_tokens])
    return prompts


def train_tokenizer(texts: list[str], vocab_size: int, folder: str | Path):
    """A byte-level BPE tokenizer trained offline, saved so AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)
    fast.save_pretrained(str(folder))
    return fast


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """One int32 stream: each text's tokens followed by EOS."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.concatenate([np.array(t + [eos], np.int32) for t in ids])


def batch_at(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """The batch [B, T+1] of a given step: windows at offsets drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return np.stack([stream[s: s + seq_len + 1] for s in starts])


def eval_batches(stream: np.ndarray, batch: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
    """Fixed, non-overlapping held-out windows [B, T+1]."""
    n = min(max_batches * batch, (len(stream) - 1) // seq_len)
    windows = [stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
    return [np.stack(windows[i: i + batch]) for i in range(0, n - batch + 1, batch)]


def prepare(run_dir: str | Path, tokenizer_folder: str | Path | None = None,
            vocab_size: int = 4096, root: str | Path | None = None):
    """(tokenizer, train stream, held-out stream, held-out modules) for a run directory.

    Trains a tokenizer into run_dir/tokenizer unless one is given; caches the encoded
    streams in run_dir/data so that a resumed run reads exactly the same tokens."""
    from transformers import AutoTokenizer

    run_dir = Path(run_dir)
    data_dir = run_dir / "data"
    train_texts, held_texts, held_modules = split_corpus(root)
    if tokenizer_folder is None:
        tokenizer_folder = run_dir / "tokenizer"
        if not (tokenizer_folder / "tokenizer.json").exists():
            train_tokenizer(train_texts, vocab_size, tokenizer_folder)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    if not (data_dir / "train.npy").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        np.save(data_dir / "train.npy", encode(tokenizer, train_texts))
        np.save(data_dir / "held_out.npy", encode(tokenizer, held_texts))
    return (tokenizer, np.load(data_dir / "train.npy"), np.load(data_dir / "held_out.npy"),
            held_modules)
