"""The README's first command: `specjax generate` on the shipped pair prints text and stats."""

import json
from pathlib import Path

import pytest

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


def test_generate_json_batch_and_drafters(capsys, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("import os\nclass Stack:\\n    def push(self, x):\n")
    for drafter in ([], ["--prompt-lookup"], ["--early-exit", "2"], ["--no-draft"]):
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


def test_generate_with_a_tree_equals_the_chain(capsys):
    """--tree (dynamic and static) on the shipped pair: greedy text equal to the chain's."""
    texts = {}
    for shape in ([], ["--tree", "4,2,8"], ["--early-exit", "3", "--tree", "[[0], [1], [0, 0]]"]):
        main(["generate", "def add(a, b):", "--max-new-tokens", "16", "--json", "--target", str(TARGET),
              "--draft", str(DRAFT), *shape])
        result = json.loads(capsys.readouterr().out)
        texts[" ".join(shape)] = result["outputs"][0]["text"]
    assert len(set(texts.values())) == 1, texts
    with pytest.raises(SystemExit, match="DEPTH,TOP_K,NODES"):
        main(["generate", "x", "--tree", "4,2", "--target", str(TARGET), "--draft", str(DRAFT)])
    with pytest.raises(SystemExit, match="needs a draft model"):
        main(["generate", "x", "--tree", "4,2,8", "--prompt-lookup", "--target", str(TARGET)])
