"""Text at the edges of decoding, shared by `specjax generate` and the notebooks: the
command's prompts read (and refused, named, where they are not UTF-8), tokenizers loaded
from a checkpoint's folder (`load_tokenizer`: no code shipped in the folder ever runs) and
compared (`check_tokenizers`: a draft must share the target's), the target's tokenizer
(--tokenizer's, else the one beside it), prompts encoded as transformers encodes them
(chat template included), the ids a reply stops at, and a streamed-text printer for
`generate(stream=...)`.

It knows tokenizers and a model's generation config; nothing of weights, the loop,
drafters or timing. Folders are found and their files checked by folders.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specjax.folders import (
    CheckpointError,
    UnsafeCheckpointError,
    _read_json,
    check_regular,
    resolve,
)


def read_prompts(prompt: str | None, batch_file: str | None) -> list[str]:
    """`specjax generate`'s prompts: PROMPT (if given) first, then --batch-file's non-blank
    lines (a literal \\n in a line is a newline), all in one batch. Text that is not UTF-8
    (a shell passes such bytes to argv as surrogate escapes) is refused, naming where."""
    prompts = [] if prompt is None else [_utf8(prompt, "the PROMPT argument")]
    if batch_file:
        prompts += [line.rstrip("\n").replace("\\n", "\n")
                    for line in _read_utf8(batch_file).splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give a PROMPT or --batch-file")
    return prompts


def _utf8(text: str, what: str) -> str:
    """text, unless it holds characters that cannot be UTF-8 (lone surrogates: undecodable
    bytes of argv); those raise ValueError naming `what` and the first such byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start].encode("utf-8", "surrogateescape") if "\udc80" <= text[e.start] <= "\udcff" else None
        found = f"byte 0x{raw[0]:02x}" if raw else f"{text[e.start]!r}"
        raise ValueError(f"{what} is not valid UTF-8 text ({found} at character {e.start + 1})") from None
    return text


def _read_utf8(path: str) -> str:
    """The file's text; a file that is not UTF-8 raises ValueError naming it and the line."""
    data = check_regular(Path(path)).read_bytes()  # a FIFO or /dev/zero would be read forever
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"--batch-file {path}: line {line} is not valid UTF-8 text (byte 0x{data[e.start]:02x} "
                         f"at byte {column} of the line)") from None


# The files a tokenizer is saved as (fast, sentencepiece, GPT-2's BPE, WordPiece): a folder
# with none of them holds no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


class NoTokenizerError(CheckpointError):
    """A model's folder holds no tokenizer (as one `save_model` wrote without a tokenizer);
    `folder` is the folder."""

    def __init__(self, folder, remedy: str = "load the tokenizer from a folder that has it, or save one beside "
                                             "the weights with specjax.save_model(..., tokenizer=...)"):
        self.folder = folder
        super().__init__(f"{folder} has no tokenizer (no tokenizer.json, tokenizer_config.json or the like): "
                         f"{remedy}")


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored beside the weights (NoTokenizerError where the folder
    holds none). Code shipped in the folder never runs: transformers is told not to trust
    remote code, so a tokenizer that needs its own Python (an auto_map naming a class
    transformers lacks) is refused, never prompted for."""
    from transformers import AutoTokenizer

    folder = resolve(path)
    for file in folder.iterdir():  # transformers would read a FIFO forever
        if not file.is_dir():
            check_regular(file)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise NoTokenizerError(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            _read_json(folder / name)  # JSON objects, named if not, before transformers reads them
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        if not isinstance(tokenizer.model_max_length, int) or tokenizer.model_max_length < 1:
            raise ValueError(f"tokenizer_config.json: model_max_length={tokenizer.model_max_length!r} must be "
                             f"an integer >= 1")
        return tokenizer
    except Exception as e:  # noqa: BLE001 -- whatever the files make transformers raise
        words = " ".join(str(e).split())
        first = words if len(words) <= 300 else words[:300] + " ..."  # one line, and visibly cut if cut
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise UnsafeCheckpointError(f"the tokenizer in {folder} needs Python code shipped in the folder, which "
                                        f"specjax never runs: use a checkpoint whose tokenizer transformers ships "
                                        f"({first})") from None
        if isinstance(e, OSError):  # no tokenizer files at all: as transformers says it
            raise
        raise CheckpointError(f"the tokenizer files in {folder} cannot be loaded: {type(e).__name__}: {first}") from None


# Text on which two tokenizers must agree: ASCII prose and code, digits, runs of spaces and
# newlines, accents, CJK, an emoji.
TOKENIZER_PROBE = ("The quick brown fox, 1234567890 times!\n\ndef f(x):\n    return x ** 2  # ok\n"
                   "\tcafé déjà-vu naïve Größe 東京 你好 🙂 <|end|> </s>")


class TokenizerMismatchError(ValueError):
    """A draft whose tokenizer turns the same text into other ids than the target's: its
    proposals would be tokens of another language."""


def check_tokenizers(target, draft, target_name="target", draft_name="draft"):
    """Raises TokenizerMismatchError unless both tokenizers give the same ids for
    TOKENIZER_PROBE, special tokens included (vocabulary sizes alone prove nothing)."""
    a, b = target(TOKENIZER_PROBE)["input_ids"], draft(TOKENIZER_PROBE)["input_ids"]
    if list(a) != list(b):
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise TokenizerMismatchError(
            f"the tokenizers of {target_name} and {draft_name} differ: on a probe text they give "
            f"{len(a)} and {len(b)} ids, first differing at position {at} "
            f"({list(a[at:at + 4])} vs {list(b[at:at + 4])}); a draft must share the target's tokenizer")


def target_tokenizer(target, tokenizer=None):
    """The tokenizer in `tokenizer` (a folder or hub id: the commands' --tokenizer), else the
    one beside the target; a target folder that holds none (as `save_model` writes without
    one) is refused with a sentence saying to pass --tokenizer."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    try:
        return load_tokenizer(target)
    except NoTokenizerError as e:
        raise NoTokenizerError(e.folder, "pass --tokenizer PATH, a folder or hub id holding the target's "
                                         "tokenizer") from None


def check_draft_tokenizer(tokenizer, target_name: str, draft_path) -> str | None:
    """Refuses (TokenizerMismatchError) a draft whose folder's tokenizer gives other ids than
    the target's; a folder without one is assumed to share it: the note saying so, or None."""
    try:
        draft_tokenizer = load_tokenizer(draft_path)
    except (OSError, ValueError):
        return f"{draft_path} has no tokenizer; assuming it shares the target's"
    check_tokenizers(tokenizer, draft_tokenizer, target_name, draft_path)
    return None


def encode_prompts(tokenizer, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """Token ids as transformers builds them: the tokenizer's special tokens included (BOS
    where the model expects one); with chat, each prompt is a user turn of the tokenizer's
    chat template, ready for the assistant's reply."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: the target's tokenizer has no chat template "
                         "(tokenizer_config.json or chat_template.jinja); drop --chat")
    ids = []
    for p in prompts:
        if chat:
            try:  # the template is the checkpoint's: sandboxed by transformers, and it may fail
                ids.append(list(tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=True)["input_ids"]))
            except Exception as e:  # noqa: BLE001 -- jinja2's errors, or what the template raises
                raise ValueError(f"--chat: the tokenizer's chat template fails: {type(e).__name__}: {e}") from None
        else:
            ids.append(list(tokenizer(p)["input_ids"]))
    fallback = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return [row or [fallback] for row in ids]


def stop_ids(model, tokenizer) -> list[int] | None:
    """The ids a reply stops at: the model's generation_config.json (or config.json), else
    the tokenizer's EOS, else none."""
    gen = model.generation_config
    if gen is not None and gen.eos_token_id:
        return list(gen.eos_token_id)
    return None if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


class TextStream:
    """A `generate(stream=...)` function that prints one row's text as the loop produces
    it (held back while the last bytes are an incomplete character); `.text` is all of it."""

    def __init__(self, tokenizer, row: int = 0, echo: bool = True, skip_special_tokens: bool = True):
        self.tokenizer, self.row, self.echo, self.skip = tokenizer, row, echo, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, tokens, counts):
        self.ids += np.asarray(tokens)[self.row, : int(counts[self.row])].tolist()
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if not text.endswith("\ufffd") and len(text) > len(self.text):
            if self.echo:
                print(text[len(self.text):], end="", flush=True)
            self.text = text
