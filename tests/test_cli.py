"""The README's first command: `specjax generate` on the shipped pair prints text and stats."""

import json
import os
from pathlib import Path

import pytest

import specjax
from specjax.cli import main

ROOT = Path(__file__).parent.parent
TARGET, DRAFT = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "draft"


def test_generate_on_the_shipped_pair(capsys):
    main(["generate", "def fibonacci(n):", "--max-new-tokens", "24", "--target", str(TARGET),
          "--draft", str(DRAFT)])
    out = capsys.readouterr().out
    text, stats = out.split("-" * 40)
    assert text.startswith("def fibonacci(n):") and len(text.strip()) > len("def fibonacci(n):")
    assert "tokens/s" in stats and "acceptance" in stats and "tokens per target pass" in stats
    assert "compile" in stats


# (the suite's time on 2 cores: prompt lookup and no draft with -m slow)
@pytest.mark.parametrize("drafter", [[], pytest.param(["--prompt-lookup"], marks=pytest.mark.slow),
                                     ["--early-exit", "2"], pytest.param(["--no-draft"], marks=pytest.mark.slow)])
def test_generate_json_batch_and_drafters(capsys, tmp_path, drafter):
    batch = tmp_path / "prompts.txt"
    batch.write_text("import os\nclass Stack:\\n    def push(self, x):\n")
    main(["generate", "--batch-file", str(batch), "--max-new-tokens", "8", "--json",
          "--target", str(TARGET), "--draft", str(DRAFT), "--temperature", "0.7", *drafter])
    result = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in result["outputs"]] == ["import os", "class Stack:\n    def push(self, x):"]
    assert all(0 < o["num_tokens"] <= 8 for o in result["outputs"])
    assert result["stats"]["tokens_per_s"] > 0


def test_info(capsys):
    main(["info", str(TARGET)])
    info = json.loads(capsys.readouterr().out)
    assert info["model_type"] == "llama" and info["params"] > 1_000_000


def test_missing_checkpoint_is_named(tmp_path):
    from specjax.hf import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        main(["generate", "x", "--target", str(tmp_path / "nope")])


@pytest.mark.slow  # test_tree checks trees against chains and transformers
def test_generate_with_a_tree_equals_the_chain(capsys):
    """--tree (dynamic and static, and a node budget chosen by -k auto from the shipped
    profile) on the shipped pair: greedy text equal to the chain's."""
    texts = {}
    for shape in ([], ["--tree", "4,2,8"], ["--early-exit", "3", "--tree", "[[0], [1], [0, 0]]"],
                  ["--tree", "4,2,12", "-k", "auto"]):
        main(["generate", "def add(a, b):", "--max-new-tokens", "16", "--json", "--target", str(TARGET),
              "--draft", str(DRAFT), *shape])
        result = json.loads(capsys.readouterr().out)
        texts[" ".join(shape)] = result["outputs"][0]["text"]
    assert len(set(texts.values())) == 1, texts
    # the last run's -k auto: the budget the shipped profile picks for one row and 16 new tokens
    from specjax import theory

    nodes = theory.choose_tree_nodes(theory.default_profile("cpu"), 4, 2, 1, 12, max_new_tokens=16)
    assert result["stats"]["num_draft_tokens"] == nodes
    assert result["stats"]["drafter"].endswith(f"(auto), tree of {nodes} nodes, depth 4" if nodes
                                               else "none (auto: speculation off at this batch size)")
    with pytest.raises(ValueError, match="DEPTH,TOP_K,NODES"):
        main(["generate", "x", "--tree", "4,2", "--target", str(TARGET), "--draft", str(DRAFT)])
    with pytest.raises(ValueError, match="needs a draft model"):
        main(["generate", "x", "--tree", "4,2,8", "--prompt-lookup", "--target", str(TARGET)])


def test_generate_with_the_shipped_heads_equals_autoregressive(capsys):
    """--drafter medusa / eagle (the shipped checkpoints), chain and tree: greedy text equal
    to plain decoding's, with drafts accepted."""
    texts, accepted = {}, {}
    for flags in (["--no-draft"], ["--drafter", "medusa"], ["--drafter", "eagle", "--tree", "4,2,8"]):
        main(["generate", "def add(a, b):", "--max-new-tokens", "24", "--json", "--target", str(TARGET), *flags])
        result = json.loads(capsys.readouterr().out)
        texts[" ".join(flags)] = result["outputs"][0]["text"]
        accepted[" ".join(flags)] = result["outputs"][0]["accepted"]
    assert len(set(texts.values())) == 1, texts
    assert accepted["--drafter eagle --tree 4,2,8"] > 0


# ---- a tiny random Llama whose tokenizer adds BOS, with a generation_config.json ---------

CORPUS = ["the cat sat on the mat and the dog ate the hat while a bird sang in the tree"] * 20
CHAT = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} the{% endif %}"


@pytest.fixture(scope="module")
def tiny_target(hf_folder, tmp_path_factory):
    import shutil

    from tests import tiny

    folder = tmp_path_factory.mktemp("cli") / "target"
    shutil.copytree(hf_folder("llama")[0], folder)
    return folder, tiny.save_tokenizer(folder, CORPUS, chat_template=CHAT)


def _run_json(capsys, *argv):
    main(["generate", *argv, "--no-draft", "--json", "--max-new-tokens", "12"])
    return json.loads(capsys.readouterr().out)


def test_attention_kernels_are_a_flag(tiny_target, capsys, monkeypatch):
    """`--attention kernels` opts the models in to the platform's attention kernels (the
    loaded model carries it; the default is auto): on this CPU none applies, so the output is
    portable's; an unknown choice is refused."""
    folder, _ = tiny_target
    loaded, load = [], specjax.load_model
    monkeypatch.setattr(specjax, "load_model", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    portable = _run_json(capsys, "hello", "--target", str(folder), "--attention", "portable")
    kernels = _run_json(capsys, "hello", "--target", str(folder), "--attention", "kernels")
    auto = _run_json(capsys, "hello", "--target", str(folder))
    assert [m.attention for m in loaded] == ["portable", "kernels", "auto"]
    assert kernels["outputs"] == auto["outputs"] == portable["outputs"]
    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", "--target", str(folder), "--attention", "fast"])
    assert e.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="attention must be one of 'auto', 'portable', 'kernels', got 'fast'"):
        specjax.load_model(folder, attention="fast")


def test_generate_uses_bos_and_the_models_stop_ids(tiny_target, capsys):
    """Token ids as transformers builds them (BOS first), and generation_config.json's list
    of stop ids honoured by default: the row stops at its first stop id, which is not the
    list's first. Flags override both ways."""
    import specjax

    folder, tok = tiny_target
    prompt = "the cat sat on"
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id
    padded, lengths = specjax.pad_prompts([ids])
    free = specjax.generate(specjax.load_model(folder), padded, lengths, max_new_tokens=12).tokens[0].tolist()
    k = next(i for i in range(2, 12) if free[i] not in free[:i])  # a token first seen at k
    unused = next(t for t in range(2, 97) if t not in free)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, free[k]],
                                                               "bos_token_id": tok.bos_token_id}))
    try:
        result = _run_json(capsys, prompt, "--target", str(folder))
        assert result["outputs"][0]["prompt_ids"] == ids
        assert result["stats"]["eos_token_id"] == [unused, free[k]]
        assert result["outputs"][0]["num_tokens"] == k + 1
        assert _run_json(capsys, prompt, "--target", str(folder), "--ignore-eos")["outputs"][0]["num_tokens"] == 12
        result = _run_json(capsys, prompt, "--target", str(folder), "--eos-token-id", str(free[1]))
        assert result["outputs"][0]["num_tokens"] == 2
    finally:
        (folder / "generation_config.json").unlink()


def test_generate_chat_template_and_sampling_defaults(tiny_target, capsys):
    folder, tok = tiny_target
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.5, "top_k": 7}))
    try:
        result = _run_json(capsys, "the dog", "--target", str(folder), "--chat")
        ids = result["outputs"][0]["prompt_ids"]
        assert ids == tok("<s>the dog the", add_special_tokens=False)["input_ids"]
        assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
        assert {k: result["stats"][k] for k in ("temperature", "top_k", "top_p")} == \
            {"temperature": 0.5, "top_k": 7, "top_p": 1.0}
        stats = _run_json(capsys, "the dog", "--target", str(folder), "--temperature", "0")["stats"]
        assert stats["temperature"] == 0.0 and stats["eos_token_id"] == [2]
    finally:
        (folder / "generation_config.json").unlink()


def test_streamed_text_is_the_final_text(tiny_target, capsys):
    folder, _ = tiny_target
    texts = []
    for flags in ([], ["--no-stream"]):
        main(["generate", "the cat", "--target", str(folder), "--no-draft", "--max-new-tokens", "12",
              "--ignore-eos", *flags])
        texts.append(capsys.readouterr().out.split("-" * 40)[0])
    assert texts[0] == texts[1] and len(texts[0].strip()) > len("the cat")


def test_draft_with_another_tokenizer_is_refused(tiny_target, tmp_path):
    import shutil

    from specjax.text import TokenizerMismatchError
    from tests import tiny

    folder, tok = tiny_target
    draft = tmp_path / "draft"
    shutil.copytree(folder, draft)
    tiny.save_tokenizer(draft, ["a bird sang in the tree by the river"] * 20, vocab_size=len(tok))
    with pytest.raises(TokenizerMismatchError, match="a draft must share the target's tokenizer"):
        main(["generate", "the cat", "--target", str(folder), "--draft", str(draft)])


def test_the_command_reports_user_errors_in_one_line(tmp_path, capsys):
    """What the `specjax` command runs: a user's error is one line on stderr and exit code 2,
    no traceback; `--early-exit 0` is refused, not quietly replaced by the draft model."""
    from specjax.cli import entry

    bad_batch = tmp_path / "batch.txt"
    bad_batch.write_bytes(b"\xff\xfe\xfa not utf-8")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv, message in (
            (["generate", "x", "--target", str(tmp_path / "nope")], "does not exist"),
            (["generate", "x", "-k", "0", "--target", str(TARGET), "--draft", str(DRAFT)], "num_draft_tokens"),
            (["generate", "x", "--early-exit", "0", "--target", str(TARGET)], "EarlyExit(0)"),
            (["generate", "--batch-file", str(bad_batch), "--target", str(TARGET), "--draft", str(DRAFT)],
             "line 1 is not valid UTF-8"),
            # shapes past what the model verifies: refused before anything is traced
            (["generate", "x", "--tree", "100000,2,100000", "--target", str(TARGET), "--draft", str(DRAFT)],
             "a step would verify 100001 tokens"),
            (["generate", "x", "--drafter", "medusa", "--tree", "[[0], [5000]]", "--target", str(TARGET)],
             "the vocabulary has 4096 tokens"),
            # a flag's value is one word: what follows is the prompt, never swallowed
            (["generate", "--lookahead", "the cat", "--target", str(TARGET)], "a prompt goes before the flags"),
            (["generate", "--batch-file", str(fifo), "--target", str(TARGET)], "not a regular file"),
            (["generate", "--batch-file", "/dev/zero", "--target", str(TARGET)], "not a regular file"),
            (["generate", "x", "--seed", str(2**70), "--target", str(TARGET)], "expected an int in [0, 2**32)"),
            (["generate", "x", "--tree", "[" * 50_000, "--target", str(TARGET)], "nests too deeply"),
            (["generate", "x", "--tree", "2,2,3", "--no-draft", "--target", str(TARGET)], "--tree needs a draft"),
            (["generate", "x", "--temperature", "inf", "--target", str(TARGET), "--draft", str(DRAFT)],
             "temperature must be a finite number"),
            (["train-eagle", "--draft-vocab", "64", "--out", str(tmp_path / "run")], "--draft-vocab is EAGLE-3's"),
            (["train-eagle", "--eagle3", "--draft-vocab", "0", "--out", str(tmp_path / "run")], "got 0"),
            (["train-eagle", "--eagle3", "--draft-vocab", "5000", "--out", str(tmp_path / "run")],
             "a draft vocabulary has 1..4096 tokens (the target's), got 5000"),
            (["distill", "--draft-vocab", "0", "--out", str(tmp_path / "run")], "got 0")):
        try:
            assert entry(argv) == 2, argv
        except SystemExit as e:  # argparse's bad flags
            assert e.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("specjax") and err.count("\n") == 1 and message in err, (argv, err)


def test_no_flag_swallows_the_prompt(capsys):
    """--eos-token-id takes one word (ids joined by commas): a prompt after it stays the prompt."""
    result = _run_json(capsys, "--eos-token-id", "5,9", "17")
    assert result["outputs"][0]["prompt"] == "17" and result["stats"]["eos_token_id"] == [5, 9]


def test_bench_dispatches_to_its_sections(monkeypatch):
    """`specjax bench` without --synthetic runs bench.run_from_args (the command's own path,
    which the bench tests, calling bench directly, do not take)."""
    from specjax.tools import bench

    seen = []
    monkeypatch.setattr(bench, "run_from_args", lambda args: seen.append(args.dtype))
    main(["bench", "--dtype", "bfloat16"])
    assert seen == ["bfloat16"]
