"""Text at the edges of decoding, shared by `specjax generate` and the notebooks: the
command's prompts read (and refused, named, where they are not UTF-8), the target's
tokenizer (--tokenizer's, else the one beside it), prompts encoded as transformers encodes
them (chat template included), the ids a reply stops at, and a streamed-text printer for
`generate(stream=...)`.

It knows tokenizers and a model's generation config; nothing of the loop, drafters or
timing.
"""

from __future__ import annotations

import numpy as np


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
    from pathlib import Path

    from specjax.hf import check_regular  # a FIFO or /dev/zero would be read forever

    data = check_regular(Path(path)).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"--batch-file {path}: line {line} is not valid UTF-8 text (byte 0x{data[e.start]:02x} "
                         f"at byte {column} of the line)") from None


def target_tokenizer(target, tokenizer=None):
    """The tokenizer in `tokenizer` (a folder or hub id: the commands' --tokenizer), else the
    one beside the target; a target folder that holds none (as `save_model` writes without
    one) is refused with a sentence saying to pass --tokenizer."""
    from specjax.hf import NoTokenizerError, load_tokenizer

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
    from specjax.hf import check_tokenizers, load_tokenizer

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
