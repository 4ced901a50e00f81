"""`specjax serve`: the OpenAI-compatible API against live servers on loopback ports.

One engine for the module (a tiny random Llama with the shipped byte-level tokenizer's
4,096 ids, and a noisy copy of it as the draft), served by several apps (with a chat
template, without one, with an API key, with a tiny queue) from threads of this process;
one `specjax serve` subprocess for SIGTERM, whose compiled programs two more starts find in
their compilation cache. Greedy outputs are compared with `generate` on each prompt alone."""

import asyncio
import contextlib
import io
import json
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers as tr
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import specjax
from specjax.serve.api import Server, create_app
from specjax.serve.detokenize import Detokenizer
from tests import children, tiny
from tests.test_engine import _alone as engine_alone

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TOKENIZER = ROOT / "checkpoints" / "target"
MAX_LEN = 96
SLOTS = 4
EOS = 0
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama over the shipped tokenizer's 4,096 ids, saved with that tokenizer."""
    config = tr.LlamaConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=48, max_position_embeddings=128,
                            bos_token_id=EOS, eos_token_id=EOS, pad_token_id=None)
    torch.manual_seed(0)
    model = tiny.randomized(tr.LlamaForCausalLM(config).eval())
    out = tmp_path_factory.mktemp("served")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TOKENIZER / name, out / name)
    return out


@pytest.fixture(scope="module")
def engine(folder):
    target = specjax.load_model(folder)
    draft = tiny.noisy(target, 0.002, 1)
    engine = specjax.Engine(target, draft=draft, slots=SLOTS, max_len=MAX_LEN, num_draft_tokens=(3, 2, 1, 0),
                            steps_per_call=2, max_logprobs=5)
    with engine:
        yield engine


class Live:
    """A server in a thread of this process, on a free loopback port."""

    def __init__(self, server: Server):
        self.server = server
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers(engine, folder):
    """servers(name) -> a Live server on the module's engine: "main" (a chat template),
    "plain" (none), "key" (an API key), "small" (a queue of 2)."""
    made = {}

    def make(name):
        if name not in made:
            tokenizer = specjax.load_tokenizer(folder)
            if name == "main":
                tokenizer.chat_template = CHAT
            options = {"key": {"api_key": "sekret"}, "small": {"max_queue": 2}}.get(name, {})
            made[name] = Live(Server(engine, tokenizer, "tiny", stop_ids=(EOS,), **options))
        return made[name]

    yield make
    for live in made.values():
        live.stop()


def _alone(engine, prompt, max_tokens, **settings):
    """generate's greedy output on the prompt alone, to EOS or max_tokens (test_engine's: one
    length, 40, for every budget here, so one program for every call)."""
    return engine_alone(engine.target, prompt, max_tokens, (EOS,), at_least=40, **settings)


def _text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


PROMPTS = [[5, 900, 17, 3000], [44] * 9, list(range(100, 130)), [7], [2048, 11, 12, 13, 14, 15]]


def test_concurrent_greedy_completions_equal_generate_alone(engine, servers):
    live = servers("main")
    client = live.client()
    budgets = [20, 7, 33, 12, 25]
    results = [None] * len(PROMPTS)

    def one(i):
        results[i] = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=budgets[i], temperature=0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    tokenizer = live.server.tokenizer
    for prompt, budget, got in zip(PROMPTS, budgets, results):
        ids = _alone(engine, prompt, budget)
        assert got.choices[0].text == _text(tokenizer, ids)
        assert got.choices[0].finish_reason == ("stop" if ids[-1] == EOS else "length")
        assert got.usage.completion_tokens == len(ids) and got.usage.prompt_tokens == len(prompt)


def test_a_text_prompt_is_encoded_as_the_tokenizer_does(engine, servers):
    live = servers("main")
    got = live.client().completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=10, temperature=0,
                                           echo=True)
    ids = live.server.tokenizer("def fibonacci(n):")["input_ids"]
    assert got.choices[0].text == "def fibonacci(n):" + _text(live.server.tokenizer, _alone(engine, ids, 10))


def test_streamed_deltas_join_to_the_text_and_end_with_done(engine, servers):
    """(A random model emits invalid UTF-8 too: its U+FFFD are the text's own. Characters
    split across tokens are held back whole: test_the_detokenizer_never_emits_a_broken_character.)"""
    live = servers("main")
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    whole = live.client().completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0)
    assert text == whole.choices[0].text == _text(live.server.tokenizer, _alone(engine, PROMPTS[2], 40))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    # The openai client reads the same stream.
    streamed = live.client().completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                                stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_chat_completions_use_the_chat_template(engine, servers):
    live = servers("main")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    got = live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ids = live.server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == _text(live.server.tokenizer, _alone(engine, list(ids), 12))
    stream = live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                   stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        servers("plain").client().chat.completions.create(model="tiny", messages=messages, max_tokens=4)


def test_stop_strings_end_the_text_and_are_not_returned(servers):
    live = servers("main")
    client = live.client()
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop, "\x00"],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_several_prompts_and_n_give_one_choice_each(servers):
    client = servers("main").client()
    got = client.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=5, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    sampled = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, n=3, seed=7)
    again = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, n=3, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in sampled.choices}) > 1  # each choice its own seed


BAD = [  # (body, status, param)
    (b"not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "x", "temperature": true}', 400, "temperature"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "x", "n": 0}', 400, "n"),
    (b'{"prompt": "x", "seed": -3}', 400, "seed"),
    (b'{"prompt": {"a": 1}}', 400, "prompt"),
    (b'{"prompt": [1, "a"]}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": [1, 4096]}', 400, "prompt"),
    (b'{"prompt": [-1]}', 400, "prompt"),
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    (b'{"prompt": [1, 2], "max_tokens": 95}', 400, "max_tokens"),
    (json.dumps({"prompt": [5] * MAX_LEN}).encode(), 400, "prompt"),
    (b'{"prompt": "x", "logprobs": 6}', 400, "logprobs"),  # the engine's max_logprobs is 5
    (b'{"prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "x", "logprobs": true}', 400, "logprobs"),
    (b'{"prompt": "x", "logprobs": 6, "echo": true}', 400, "logprobs"),
    (b'{"prompt": "x", "top_logprobs": 2}', 400, "top_logprobs"),  # chat's field
    (b'{"prompt": "x", "presence_penalty": 2.5}', 400, "presence_penalty"),
    (b'{"prompt": "x", "frequency_penalty": "1"}', 400, "frequency_penalty"),
    (b'{"prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty"),
    (b'{"prompt": "x", "min_p": 1.5}', 400, "min_p"),
    (b'{"prompt": "x", "min_p": -0.1}', 400, "min_p"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"five": 1}}', 400, "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"-5": 1}}', 400, "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"4096": 1}}', 400, "logit_bias"),
    (b'{"prompt": "x", "logit_bias": [5, 1]}', 400, "logit_bias"),
    (b'{"prompt": "x", "guided_choice": []}', 400, "guided_choice"),
    (b'{"prompt": "x", "guided_regex": "("}', 400, "guided_regex"),  # the library's reason, named
    (b'{"prompt": "x", "guided_regex": "' + b"a" * 40000 + b'"}', 400, "guided_regex"),  # over MAX_CONSTRAINT_CHARS
    (b'{"prompt": "x", "guided_json": "[1]"}', 400, "guided_json"),
    (b'{"prompt": "x", "guided_json": {"type": "integer", "maximum": 3}}', 400, "guided_json"),  # inexpressible
    (b'{"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}', 400, "guided_choice"),  # one a request
    (b'{"prompt": "x", "response_format": {"type": "json_schema"}}', 400, "response_format"),
    (b'{"prompt": "x", "response_format": {"type": "xml"}}', 400, "response_format"),
    (b'{"prompt": "x", "structured_outputs": {"grammar": "root ::= x"}}', 400, "structured_outputs"),
    (b'{"prompt": "x", "guided_grammar": "root ::= x"}', 400, "guided_grammar"),
    (b'{"prompt": "x", "guided_choice": ["a"], "ignore_eos": true}', 400, "ignore_eos"),
    (b'{"prompt": "x", "max_completion_tokens": 5}', 400, "max_completion_tokens"),  # chat's, not completions'
    (b'{"prompt": "x", "temprature": 0.5}', 400, "temprature"),  # a typo is named, not ignored
    (b'{"prompt": "x", "stop_token_ids": [99999]}', 400, "stop_token_ids"),
    (b'{"prompt": "x", "stop_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}', 400, "stop_token_ids"),
    (b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, None),
    ('{"prompt": "\udcff"}'.encode("utf-8", "surrogatepass"), 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_openai_errors_quickly(servers, body, status, param):
    live = servers("main")
    start = time.perf_counter()
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=10)
    assert time.perf_counter() - start < 2
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_fields_at_their_off_values_and_harmless_fields_are_served(servers):
    """vLLM's and OpenAI's fields at their "off" values, and fields that change nothing
    served (user, metadata, ...), are accepted; an error shows a long value cut with its
    length, not cut mid-brace."""
    live = servers("main")
    body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "guided_choice": None, "logprobs": None, "metadata": {"k": "v"}, "store": False, "user": "u"}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "guided_grammar": {"k": "v" * 200}}, timeout=10)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "guided_grammar" in message and "characters)" in message and len(message) < 200


def test_min_p_logit_bias_and_penalties_through_the_openai_client(engine, servers):
    """OpenAI's logit_bias (string keys) and penalties, and vLLM's min_p and
    repetition_penalty, reach the engine: a greedy completion that bans its own first token
    equals generate with that bias (streamed and chat alike), one with penalties equals
    generate with them, and sampled choices at min_p = 1 are the greedy ones."""
    live = servers("main")
    client = live.client()
    prompt = PROMPTS[0]
    plain = _alone(engine, prompt, 12)
    bias = {plain[0]: -100.0, 7: 2.5}
    want = _alone(engine, prompt, 12, logit_bias=bias)[:8]
    assert want[0] != plain[0]
    tokenizer = live.server.tokenizer
    logit_bias = {str(t): b for t, b in bias.items()}
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias=logit_bias)
    assert got.choices[0].text == _text(tokenizer, want)
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       logit_bias=logit_bias, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(tokenizer, want)
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    top = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, n=3, seed=1,
                                    extra_body={"min_p": 1.0})
    assert {c.text for c in top.choices} == {greedy.choices[0].text}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"5": 100})
    assert chat.choices[0].message.content == _text(tokenizer, [5] * 4)
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.4)
    want = _alone(engine, prompt, 12, **penalties)
    assert want != plain
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    presence_penalty=1.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.4})
    assert got.choices[0].text == _text(tokenizer, want)


def test_logprobs_through_the_openai_client(engine, servers):
    """Completions' logprobs and chat's logprobs/top_logprobs, streamed and not: each token's
    equals generate's (the verification pass's at its position: a plain pass's), its top
    alternatives likewise, the streamed chunks' join to the whole."""
    live = servers("main")
    client, tokenizer = live.client(), live.server.tokenizer
    prompt = PROMPTS[2]
    prompts, lengths = specjax.pad_prompts([prompt])
    out = specjax.generate(engine.target, prompts, lengths, max_new_tokens=10, eos_token_id=[EOS], logprobs=3)
    n = int(out.num_tokens[0])
    ids, chosen = np.asarray(out.tokens[0, :n]).tolist(), np.asarray(out.logprobs.chosen[0, :n])
    top_ids, top = np.asarray(out.logprobs.top_ids[0, :n]), np.asarray(out.logprobs.top[0, :n])
    piece = lambda i: tokenizer.decode([int(i)])  # noqa: E731
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.tokens == [piece(i) for i in ids]
    np.testing.assert_allclose(lp.token_logprobs, chosen, atol=1e-4)
    for k in range(n):
        assert list(lp.top_logprobs[k]) == [piece(i) for i in top_ids[k]] or len(set(map(piece, top_ids[k]))) < 3
        np.testing.assert_allclose(sorted(lp.top_logprobs[k].values(), reverse=True), top[k], atol=1e-4)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == got.choices[0].text
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=3, stream=True) if c.choices]
    assert sum((s.token_logprobs for s in streamed if s is not None), []) == lp.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 and
               bytes(t.bytes).decode() == t.token for t in content)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0, logprobs=True, stream=True)
    streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert [t.logprob for t in streamed] == [t.logprob for t in content] and all(t.top_logprobs == [] for t in streamed)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_structured_output_through_the_openai_client(engine, servers):
    """response_format json_schema (chat, streamed and not) gives JSON that validates against
    the schema; guided_choice one of the choices; guided_regex a match; each equal to
    generate with that grammar (greedy) on the same vocabulary."""
    import jsonschema

    live = servers("main")
    client, tokenizer = live.client(), live.server.tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy", "zzz"]}},
              "required": ["ok", "tag"], "additionalProperties": False}
    format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": "answer"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                          response_format=format_)
    assert chat.choices[0].finish_reason == "stop", repr(chat.choices[0].message.content)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                              response_format=format_, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    sampled = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=1.0, n=3,
                                             seed=4, response_format={"type": "json_object"})
    stopped = [c for c in sampled.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    choices = ["alpha", "beta", "gamma delta"]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                    extra_body={"guided_choice": choices})
    assert got.choices[0].text in choices
    vocabulary = specjax.Vocabulary.of(tokenizer, engine.target.config.vocab_size, EOS)
    want = _alone(engine, PROMPTS[0], 16, grammar=specjax.Grammar.choice(choices, vocabulary))
    assert got.choices[0].text == _text(tokenizer, want)
    got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0.7, seed=2,
                                    extra_body={"guided_regex": "[0-9]{2,4}-[a-c]+"})
    text, why = got.choices[0].text, got.choices[0].finish_reason
    assert re.fullmatch("[0-9]{2,4}-[a-c]+" if why == "stop" else "[0-9]{0,4}|[0-9]{2,4}-[a-c]*", text), (text, why)


def test_echo_with_logprobs_scores_the_prompt_too(engine, servers, monkeypatch):
    """Completions' echo with logprobs (what lm-evaluation-harness's loglikelihood requests
    send): the prompt's tokens first, the first with null logprobs, each other one's what
    generate(prompt_logprobs=) gives (a plain pass's), then the completion's as without echo;
    streamed, the echo's chunk carries the prompt's. The prompt is scored by the engine's
    thread, in its turn (at 53bdaf5, on a worker thread of the server's before admission,
    as many at once as came, outside the memory the engine keeps free)."""
    scored_on, score = [], engine.runner.score
    monkeypatch.setattr(engine.runner, "score", lambda *a: scored_on.append(threading.current_thread().name)
                        or score(*a))
    live = servers("main")
    client, tokenizer = live.client(), live.server.tokenizer
    prompt = PROMPTS[1]
    prompts, lengths = specjax.pad_prompts([prompt])
    out = specjax.generate(engine.target, prompts, lengths, max_new_tokens=3, eos_token_id=[EOS], logprobs=2,
                           prompt_logprobs=2)
    n, P = int(out.num_tokens[0]), len(prompt)
    piece = lambda i: tokenizer.decode([int(i)])  # noqa: E731
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = got.choices[0].logprobs
    ids = prompt + np.asarray(out.tokens[0, :n]).tolist()
    assert lp.tokens == [piece(i) for i in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = np.concatenate([np.asarray(out.prompt_logprobs.chosen[0, 1:P]), np.asarray(out.logprobs.chosen[0, :n])])
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
    for k in range(1, P):
        np.testing.assert_allclose(sorted(lp.top_logprobs[k].values(), reverse=True),
                                   np.asarray(out.prompt_logprobs.top[0, k]), atol=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True) if c.choices]
    assert sum((s.token_logprobs for s in streamed if s is not None), []) == lp.token_logprobs
    assert scored_on == ["specjax-engine"] * 2
    failures = engine.failures  # a scoring pass that fails fails its request alone (503), nothing in the state
    monkeypatch.setattr(engine.runner, "score", lambda *a: (_ for _ in ()).throw(RuntimeError("injected score")))
    r = httpx.post(live.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "logprobs": 1,
                                                       "echo": True}, timeout=60)
    assert r.status_code == 503 and "injected score" in r.text and engine.failures == failures
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0).choices[0].text


def test_bad_chat_requests_and_routes(servers):
    live = servers("main")
    for messages in ([], [{"role": "wizard", "content": "x"}], "hi",
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):
        r = httpx.post(live.url + "/v1/chat/completions", json={"messages": messages}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.get(live.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(live.url + "/v1/completions", timeout=10).status_code == 405


def test_models_and_health(servers):
    live = servers("main")
    models = live.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200


def test_an_api_key_guards_every_v1_route(servers):
    live = servers("key")
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").models.list()
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", live.url + path, json={"prompt": "x"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    got = live.client(api_key="sekret").completions.create(model="tiny", prompt=[5], max_tokens=3, temperature=0)
    assert got.usage.completion_tokens >= 1
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200  # not an API route


def _wait_idle(engine, seconds=20):
    deadline = time.time() + seconds
    while engine.load() != (0, 0):
        assert time.time() < deadline, f"slots not freed: {engine.load()}"
        time.sleep(0.05)


def test_a_client_that_leaves_frees_its_slot(engine, servers, monkeypatch):
    """Device calls slowed to 0.1 s each, so that a request of 80 tokens runs for seconds:
    the client leaves after its first chunk (streaming) or 0.5 s (waiting), and its engine
    request is cancelled, not run to its end."""
    live = servers("main")
    run, submit, submitted = engine.programs.run, engine.submit, []
    monkeypatch.setattr(engine.programs, "run", lambda *a, **k: (time.sleep(0.1), run(*a, **k))[1])
    monkeypatch.setattr(engine, "submit", lambda *a, **k: submitted.append(submit(*a, **k)) or submitted[-1])
    body = {"prompt": PROMPTS[1], "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    _wait_idle(engine, 5)
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.5)
    _wait_idle(engine, 5)
    assert [r.finish_reason for r in submitted] == ["cancelled", "cancelled"]
    assert all(len(r.tokens) < 80 for r in submitted)


def test_overload_refuses_at_once_and_loses_nothing(engine, servers):
    live = servers("small")

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*[client.post(live.url + "/v1/completions", json=body) for _ in range(16)])

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(200) >= SLOTS + 2 and 503 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 30
    _wait_idle(engine)


@pytest.mark.parametrize("call", ["run", "insert"])
def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(engine, servers, monkeypatch, call):
    """A device call that fails (a step, or the insert of a prefilled row, whose request is
    then in no queue) fails its requests with the error, and the engine serves on."""
    live = servers("main")
    original = getattr(engine.programs, call)
    calls = []

    def failing(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected device failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.programs, call, failing)
    failures = engine.failures
    with pytest.raises(openai.InternalServerError, match="injected device failure"):
        live.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0, timeout=60)
    assert engine.failures == failures + 1
    got = live.client().completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert got.choices[0].text == _text(live.server.tokenizer, _alone(engine, PROMPTS[0], 5))


def _scrape(live) -> dict:
    text = httpx.get(live.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move_with_requests(servers):
    live = servers("main")
    before = _scrape(live)
    live.client().completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = _scrape(live)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("specjax:generation_tokens_total") == 20
    assert moved("specjax:prompt_tokens_total") == len(PROMPTS[4])
    assert moved("specjax:time_to_first_token_seconds_count") == 1
    assert moved("specjax:e2e_request_latency_seconds_count") == 1
    assert moved("specjax:inter_token_latency_seconds_count") > 0
    assert moved("specjax:request_success_total", (("finished_reason", "length"),)) == 1
    drafts, drafted = moved("specjax:spec_decode_num_drafts_total"), moved("specjax:spec_decode_num_draft_tokens_total")
    assert drafts > 0 and drafted == 3 * drafts  # alone in the engine: K = 3
    accepted = moved("specjax:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert moved("specjax:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),)) <= drafts
    assert after[("specjax:num_slots", ())] == SLOTS
    assert after[("specjax:num_requests_running", ())] == 0
    assert after[("specjax:num_prefill_groups_compiling", ())] == 0


def test_an_idle_server_uses_no_cpu(engine, servers):
    servers("main")
    _wait_idle(engine)
    time.sleep(0.5)
    start = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(2.0)
    end = resource.getrusage(resource.RUSAGE_SELF)
    used = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    assert used < 0.1, f"{used:.3f} s of CPU in 2 s idle"


def test_the_detokenizer_never_emits_a_broken_character():
    tokenizer = specjax.load_tokenizer(SHIPPED_TOKENIZER)
    text = "naïve café 🙂 日本 — done"
    ids = tokenizer(text)["input_ids"]
    for stop in ((), ("日本",), ("🙂 ",)):
        d = Detokenizer(tokenizer, stop)
        pieces = [d.push([i]) for i in ids] + [d.finish()]
        assert all("\ufffd" not in p for p in pieces)
        expected = text if not stop else text[:text.index(stop[0])]
        assert "".join(pieces) == expected and d.stopped == bool(stop)


def test_a_stop_string_ends_the_reply_s_tokens_at_the_one_that_completed_it():
    """A speculative chunk holds several tokens: those after the token that completed a stop
    string are not the reply's (its usage and logprobs stop there; at 53bdaf5 they counted
    the whole chunk). One chunk of all the ids, and one id a chunk, give the same count."""
    from specjax.serve.generation import Choice

    tokenizer = specjax.load_tokenizer(SHIPPED_TOKENIZER)
    ids = tokenizer("def add(a, b):\n    return a + b\n\nprint(add(1, 2))")["input_ids"]
    through = next(n for n in range(1, len(ids) + 1) if "return" in tokenizer.decode(ids[:n]))
    for chunks in ([ids], [[i] for i in ids]):
        choice = Choice(0, [], Detokenizer(tokenizer, ("return",)))
        for chunk in chunks:
            choice.chunk_times.append((0.0, len(chunk)))
            choice.detokenizer.push(chunk)
            if choice.detokenizer.stopped:
                break
        assert choice.detokenizer.text == "def add(a, b):\n    " and choice.tokens == through < len(ids)


def test_constraints_are_bounded_in_states_time_and_memory_and_compiled_once(folder):
    """A constraint with more states than a row holds is refused before any array is built
    (at 53bdaf5: after compiling, by the engine), one with more masks or moves before any
    mask is, each naming the server's flags (Engine's arguments at 49c56b6); one whose compile outlasts the limit is
    answered 400 naming it, its process killed (a thread's compile ran on at 66d040c), and
    refused at once after; one that needs more memory than a compile may add ends its
    process, answered 400 naming the limit; the next compile starts a new process;
    identical ones asked together share one compile; too many distinct ones waiting: 503."""
    from specjax.serve import structured
    from specjax.serve.protocol import ApiError
    from specjax.grammar import Capacity
    from specjax.serve.structured import Constraints

    tokenizer = specjax.load_tokenizer(folder)
    constraints = Constraints(tokenizer, 4096, EOS, Capacity(300_000, 300_000, 10_000_000), timeout=3.0,
                              memory=200 << 20)

    def ask(*patterns, of=constraints):
        async def together():
            return await asyncio.gather(*[of.grammar(("regex", p, None, "guided_regex")) for p in patterns],
                                        return_exceptions=True)
        return asyncio.run(together())

    grammars = ask("[0-9]{3}", "[0-9]{3}", "[0-9]{3}")
    assert grammars[0] is grammars[1] is grammars[2] and grammars[0].num_states == 4, grammars
    worker = constraints.worker
    assert worker.starts == 1 and Path(f"/proc/{worker.pid}").exists()
    # (a|b)*a(a|b){16}: 2^18 states, about 22 s and 350 MB more here (its masks alone 128 MiB)
    slow, large = "(a|b)*a(a|b){16}", "(a|b)*b(a|b){16}"
    pid, start = worker.pid, time.perf_counter()
    [error] = ask(slow)
    assert isinstance(error, ApiError) and "takes longer than the 3 s" in error.message, error
    assert time.perf_counter() - start < 6 and not Path(f"/proc/{pid}").exists()
    start = time.perf_counter()
    [again] = ask(slow)
    assert time.perf_counter() - start < 0.1 and again.message == error.message
    constraints.timeout = 60.0
    [error] = ask(large)
    assert isinstance(error, ApiError) and "more than the 200 MiB of memory" in error.message, error
    [error] = ask("[0-9]{12}")
    assert worker.starts == 3 and error.num_states == 13, error  # a new process after each end
    constraints.capacity = Capacity(4, 1000, 1000)  # (a refusal names the server's flags, not Engine's arguments)
    [error] = ask("[0-9]{5}")
    assert isinstance(error, ApiError) and error.message.endswith(
        "compiles to 6 states; a row holds 4 states (--max-grammar-states)"), error.message
    constraints.capacity = Capacity(1000, 1, 0)
    [error] = ask("[0-9]{2}(a|bb)")
    assert isinstance(error, ApiError) and re.search(
        r"compiles to \d+ states, \d+ distinct token masks and \d+ exceptional moves; a row holds 1 token masks "
        r"\(--max-grammar-masks\), 0 exceptional moves \(--max-grammar-edges\)$", error.message), error.message
    assert "Engine" not in error.message
    constraints.close()

    waiting = Constraints(tokenizer, 4096, EOS, Capacity(4, 1000, 1000))
    release = threading.Event()
    waiting._pool.submit(release.wait)  # the compiler busy for a second
    threading.Timer(1.0, release.set).start()
    errors = ask(*[f"[0-9]{{{n}}}" for n in range(1, structured.PENDING + 2)], of=waiting)
    assert [getattr(e, "status", 200) for e in errors] == [200] * 3 + [400] * 5 + [503], errors  # (4 states held)
    waiting.close()


def test_a_compilation_cache_others_can_write_is_refused(tmp_path):
    """Its entries are native code the server runs: a folder (or a folder above it, but a
    sticky one like /tmp) that others can write is refused, naming it."""
    from specjax.serve.server import check_private  # (`use_compilation_cache` calls it before it sets jax's)

    (tmp_path / "mine").mkdir(mode=0o700)
    check_private(tmp_path / "mine")
    shared = tmp_path / "shared"
    (shared / "below").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"shared can be written by others .*drwxrwxrwx"):
        check_private(shared)
    with pytest.raises(ValueError, match=r"shared can be written by others"):
        check_private(shared / "below")


def test_serve_refuses_several_hosts_in_one_line(capsys):
    from specjax.cli import entry

    assert entry(["serve", "--distributed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one host" in err[0]


# The two `specjax serve` processes' settings (2 slots: grouped prefills compile in the background),
# and their compilation cache: the SIGTERM test's start fills it, the second-start test reads it.
# Their environment compiles without LLVM's optimisations (tests/children.py): neither compares bits.
SERVE_CHILD = ("--draft", "none", "--slots", "2", "--max-model-len", "32")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla")


def test_sigterm_drains_in_flight_requests_and_exits_0(folder, xla_cache):
    """SIGTERM while a request runs and programs still compile in the background (/health:
    "warming"; on a CPU the server answers at once): the request finishes, the compile stops
    after its program, and the process exits 0 (at 02042b0 it aborted, SIGABRT, from the
    compile thread inside XLA); an access log line for the request."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", str(folder), *SERVE_CHILD,
                             "--port", str(port), "--compilation-cache", str(xla_cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=children.env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = httpx.get(url + "/health", timeout=1)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.1)
        health = health.json()  # (on a CPU it serves at once, every program compiling in the background)
        assert health["status"] == "warming" and health["compiling"] > 0 and health["programs_compiling"] > 0, health
        while True:  # the steps are timed once the programs other than grouped prefills are compiled
            steps = {(s.labels["k"], s.labels["width"]): s.value for family in text_string_to_metric_families(
                httpx.get(url + "/metrics", timeout=10).text) for s in family.samples
                if s.name == "specjax:step_seconds"}
            if steps or time.time() > deadline + 300:
                break
            time.sleep(0.2)
        assert set(steps) == {("0", "1"), ("0", "2")}, steps  # K = 0 (no draft), widths 1 and 2
        assert all(0 < v < 1 for v in steps.values()), steps
        body = {"prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        result = {}

        def request():
            result["r"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
        assert proc.wait(60) == 0, proc.stdout.read()
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 24
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
        printed = proc.stdout.read()
        assert "serving at once; its" in printed and "compile in the background" in printed, printed
        assert re.search(r'127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200', printed), printed  # access log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_readmes_client_example_runs_against_a_server(servers):
    """The README's `openai` and curl examples, as written but for the address and the model's name."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(b for b in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M) if "OpenAI(" in b)
    live = servers("main")
    code = code.replace("http://127.0.0.1:8000", live.url).replace('model="target"', 'model="tiny"')
    assert live.url in code and 'model="tiny"' in code
    out = io.StringIO()  # (not capsys: a server started under it would log to a stream it closes)
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    assert "completion_tokens=" in printed and len(printed) > 40
    # Its curl example: the same body, streamed.
    curl = next(b for b in re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M) if b.startswith("curl "))
    body = json.loads(re.search(r"-d '(.*?)'", curl, re.S).group(1))
    assert body.pop("model") == "target" and body["stream"] is True
    with httpx.stream("POST", live.url + "/v1/completions", json={**body, "model": "tiny"}, timeout=60) as r:
        assert r.status_code == 200 and [line for line in r.iter_lines() if line][-1] == "data: [DONE]"


def test_a_second_start_compiles_nothing(folder, xla_cache):
    """`specjax serve` keeps its compiled programs in JAX's persistent compilation cache
    (--compilation-cache DIR; by default ~/.cache/specjax/xla): a start fills it (each child
    waits for its background compiles; the SIGTERM test's start, stopped while they ran, may
    have filled it before), and a second start on the same folder and settings finds every
    program the first one needed there."""
    cache = xla_cache
    child = [sys.executable, str(Path(__file__).parent / "serve_cache_child.py"), str(folder), *SERVE_CHILD,
             "--compilation-cache", str(cache)]
    env = children.env(PYTHONPATH=str(Path(__file__).parent.parent))
    runs = []
    for _ in range(2):
        result = subprocess.run(child, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
        assert f"compiled programs cached in {cache}" in result.stderr
    first, second = runs
    assert first["code"] == second["code"] == 0
    needed = first["hits"] + first["misses"]
    assert needed > 0 and second["misses"] == 0 and second["hits"] >= needed, runs


def test_usage_counts_each_prompt_once_and_its_cached_tokens():
    """`usage`: each prompt's tokens once whatever n, every choice's completion tokens, and
    OpenAI's prompt_tokens_details.cached_tokens: what each prompt's first request took from
    a paged engine's prefix cache."""
    from types import SimpleNamespace

    from specjax.serve.api import _usage

    def choice(prompt, tokens, cached):
        return SimpleNamespace(prompt=prompt, tokens=tokens, request=SimpleNamespace(cached_tokens=cached))

    generation = SimpleNamespace(choices=[choice([1] * 40, 3, 32), choice([1] * 40, 5, 32),
                                          choice([2] * 9, 4, 0), choice([2] * 9, 2, 0)])
    assert _usage(generation, 2) == {"prompt_tokens": 49, "completion_tokens": 14, "total_tokens": 63,
                                     "prompt_tokens_details": {"cached_tokens": 32}}


def test_serve_flags_reach_the_engine(monkeypatch):
    """`specjax serve`'s pool flags: prefix caching on unless --no-prefix-caching; the prefill
    chunk; paged unless --dense-kv-cache."""
    import specjax.serve.server as server_module
    from specjax.cli import entry

    seen = []
    monkeypatch.setattr(server_module, "serve", lambda *args, **kwargs: seen.append(kwargs) or 0)
    assert entry(["serve", "t", "--kv-pages", "64", "--page-size", "32", "--prefill-chunk", "256"]) == 0
    assert entry(["serve", "t", "--kv-cache-memory", "4GiB", "--no-prefix-caching"]) == 0
    assert entry(["serve", "t", "--dense-kv-cache", "--no-logprobs", "--max-grammar-states", "0",
                  "--max-grammar-masks", "7", "--max-grammar-edges", "9"]) == 0
    assert [(s["kv_pages"], s["kv_cache_bytes"], s["page_size"], s["prefix_caching"], s["prefill_chunk"],
             s["dense_kv_cache"]) for s in seen] == [(64, None, 32, True, 256, False),
                                                     (None, "4GiB", 16, False, None, False),
                                                     (None, None, 16, True, None, True)]
    assert [(s["max_logprobs"], s["logprobs_mode"]) for s in seen] == [(20, "raw"), (20, "raw"), (None, "raw")]
    assert [(s["max_grammar_states"], s["max_grammar_masks"], s["max_grammar_edges"]) for s in seen] == \
        [(None, None, None)] * 2 + [(0, 7, 9)]
    with pytest.raises(SystemExit):  # dense rows or a pool, not both
        entry(["serve", "t", "--dense-kv-cache", "--kv-pages", "8"])
    # Given neither, a server's caches are paged: on a CPU (no memory reported), the pages of its rows.
    assert server_module.default_pool(8, 1000, 16) == (8 * 63, None)
