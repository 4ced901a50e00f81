"""specjax.text: the streamed-text printer and stop ids that `specjax generate` and the
notebooks share (prompt encoding is exercised through the command in test_cli)."""

import numpy as np

import specjax
from specjax import text


class _Tokenizer:
    eos_token_id = 7

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_text_stream_prints_one_row_as_it_grows(capsys):
    stream = text.TextStream(_Tokenizer(), row=1)
    stream(np.array([[0, 0, 0], [1, 2, 0]]), np.array([3, 2]))
    stream(np.array([[0, 0, 0], [3, 0, 0]]), np.array([1, 1]))
    assert stream.text == "bcd" and capsys.readouterr().out == "bcd"


def test_stop_ids_prefer_the_generation_config(pair):
    target = pair[0]
    with_config = target.replace(generation_config=specjax.GenerationConfig(eos_token_id=(3, 4)))
    assert text.stop_ids(with_config, _Tokenizer()) == [3, 4]
    assert text.stop_ids(target.replace(generation_config=None), _Tokenizer()) == [7]
