"""Text at the edges of decoding, shared by `specjax generate` and the notebooks: prompts
encoded as transformers encodes them (chat template included), the ids a reply stops at,
and a streamed-text printer for `generate(stream=...)`.

It knows tokenizers and a model's generation config; nothing of the loop, drafters or
timing.
"""

from __future__ import annotations

import numpy as np


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
