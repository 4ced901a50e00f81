"""A reply's text as its token ids arrive: incremental detokenization and stop strings.

Ids come in chunks; `Detokenizer.push` returns the text that became final with them. A
character whose bytes span several tokens is held back until it is whole (a byte-level
tokenizer decodes a partial one as U+FFFD), and so is any tail of the text that may be the
start of a stop string. A stop string ends the text before it (it is not returned, as
OpenAI's API does). The pieces joined are the whole text: a client that streams gets what
one that waits gets.

Decoding reads a window of recent ids (vLLM's and TGI's prefix/read offsets: the ids since
the last character boundary, and those before it as context), so a long reply costs no more
per chunk than a short one. It knows a tokenizer's `decode`; nothing of requests or HTTP.
"""

from __future__ import annotations

from typing import Sequence

INCOMPLETE = "\ufffd"  # what decode gives for the bytes of a character not yet whole


class Detokenizer:
    """The text of a growing list of generated ids (decoded as `tokenizer.decode(ids,
    skip_special_tokens=...)` decodes them all, for tokenizers whose decode of a sequence
    extends the decode of its prefix: byte-level BPE, SentencePiece).

    stop: strings that end the text; `stopped` says one did."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the text decoded so far (cut at a stop string once one is found)
        self.sent = 0  # characters of text already returned
        self.stopped = False
        self.used: int | None = None  # once stopped: the ids up to the one that completed the stop string
        self._prefix = 0  # ids before the window's new part: context for its first character
        self._read = 0  # ids whose text is in self.text
        self._checked = 0  # characters of text already searched for stop strings

    def push(self, ids: Sequence[int]) -> str:
        """Takes the next ids; returns the text they made final (maybe "")."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids)
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The text not yet returned (an incomplete last character as U+FFFD, as decode
        gives it; a held-back tail that did not become a stop string)."""
        if not self.stopped:
            self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool):
        before = self._text_of(self.ids[self._prefix:self._read])
        window = self._text_of(self.ids[self._prefix:])
        if len(window) > len(before) and (final or not window.endswith(INCOMPLETE)):
            self.text += window[len(before):]
            read, self._prefix, self._read = self._read, self._read, len(self.ids)
            self._find_stop(read)

    def _text_of(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _find_stop(self, read: int):
        """Cuts the text at the first stop string, if one is whole now; `used` then counts the
        ids through the one that completed it (what the reply's tokens stop at: its usage and
        logprobs), one of those after `read` (the ids decoded before held none)."""
        if not self.stop:
            return
        longest = max(map(len, self.stop))
        start = max(0, self._checked - longest + 1)
        found = [(i, i + len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if found:
            cut, end = min(found)
            self.text, self.stopped = self.text[:cut], True
            self.used = next((n for n in range(read + 1, len(self.ids))
                              if len(self._text_of(self.ids[:n]).rstrip(INCOMPLETE)) >= end), len(self.ids))
        self._checked = len(self.text)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """How many trailing characters could begin a stop string."""
        tail = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), tail, -1):
                if self.text.endswith(s[:n]):
                    tail = n
                    break
        return tail
