"""What a new user meets first: the package without torch, its version, the command's flags,
help and one-line refusals (no model is compiled here, or only a tiny one)."""

import argparse
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import specjax
from specjax.cli import main

ROOT = Path(__file__).parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    """code run by a fresh Python that imports this checkout's specjax, offline."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_no_torch_advisory_without_torch():
    """Without torch (the plain install), importing specjax and loading a tokenizer prints
    nothing about PyTorch; transformers' other warnings still pass."""
    done = _python("import sys; sys.modules['torch'] = None\n"
                   "import specjax\n"
                   f"specjax.load_tokenizer({str(ROOT / 'checkpoints' / 'target')!r})\n"
                   "from transformers.utils import logging\n"
                   "logging.get_logger('transformers').warning('another warning')\n")
    assert done.returncode == 0, done.stderr
    assert "PyTorch" not in done.stderr and "another warning" in done.stderr, done.stderr


@pytest.mark.parametrize("session", ["command", "python"])
def test_a_session_on_a_machine_without_a_tpu_prints_no_libtpu_block(session):
    """With libtpu installed (the test extra's jax[tpu]) and JAX_PLATFORMS unset, a CPU
    command, and a Python session that imports specjax (at c925357 the second printed it),
    print none of libtpu's INVALID_ARGUMENT block and run on the CPU."""
    pytest.importorskip("libtpu")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    target = str(ROOT / "checkpoints" / "target")
    code = (f"import sys, jax; from specjax.cli import entry\ncode = entry(['info', {target!r}])\n"
            if session == "command" else
            f"import sys, jax, specjax\ncode = int(specjax.forward(specjax.load_model({target!r}), [[1, 2]]).ndim != 3)\n")
    code += "print(jax.default_backend()); sys.exit(code)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "INVALID_ARGUMENT" not in done.stderr and "TPU" not in done.stderr, done.stderr
    assert done.stdout.split()[-1] == "cpu"


def test_the_version_is_the_packages(capsys, monkeypatch):
    """specjax.__version__ is the installed metadata's, else pyproject.toml's (from source);
    `specjax --version` prints it."""
    from specjax import version

    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    try:
        installed = metadata.version("specjax")
    except metadata.PackageNotFoundError:
        installed = declared
    assert specjax.__version__ == installed
    monkeypatch.setattr(metadata, "version", lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))
    assert version.version() == declared
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"specjax {specjax.__version__}\n"


def test_a_misspelled_flag_is_named_not_the_words_after_it(capsys):
    for argv, named in ((["generate", "--max-new-tokns", "5", "hi"], "--max-new-tokns"),
                        (["generate", "hi", "--max-new-tokns=5"], "--max-new-tokns=5")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert f"unrecognized arguments: {named} (did you mean --max-new-tokens?)" in err, err


def test_text_that_is_not_utf8_is_refused_naming_where(tmp_path, capsys):
    """A prompt of bytes that are not UTF-8 (in argv: surrogate escapes, as a shell's
    $'\\xff\\xfe' arrives) and a --batch-file line of them: one line naming the argument, or
    the file and line, and exit code 2 (before any model is loaded)."""
    from specjax.cli import entry

    batch = tmp_path / "prompts.txt"
    batch.write_bytes(b"fine\n\nalso fine \xc3\xa9\nnot \xff\xfe fine\n")
    for argv, message in (
            (["generate", "\udcff\udcfe"], "the PROMPT argument is not valid UTF-8 text (byte 0xff at character 1)"),
            (["generate", "--batch-file", str(batch)],
             f"--batch-file {batch}: line 4 is not valid UTF-8 text (byte 0xff at byte 5 of the line)")):
        assert entry([*argv, "--target", str(tmp_path / "never-read")]) == 2
        err = capsys.readouterr().err
        assert err == f"specjax: error: {message}\n", err


def _parsers():
    """Every (sub)command's parser of `specjax`, by its prog."""
    from specjax import cli

    captured = []

    class Stop(Exception):
        pass

    def grab(self, args=None, namespace=None):
        captured.append(self)
        raise Stop

    original = cli._Parser.parse_args
    cli._Parser.parse_args = grab
    try:
        main([])
    except Stop:
        pass
    finally:
        cli._Parser.parse_args = original
    found, todo = {}, captured
    while todo:
        parser = todo.pop()
        found[parser.prog] = parser
        todo += [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]
    return found


def test_every_flag_of_every_command_has_help():
    parsers = _parsers()
    assert {"specjax generate", "specjax bench", "specjax serve", "specjax datastore build", "specjax export"} \
        <= set(parsers)
    subcommands = argparse._SubParsersAction
    actions = [(prog, a) for prog, p in parsers.items() for a in p._actions if not isinstance(a, subcommands)]
    commands = [(prog, a) for prog, p in parsers.items() for s in p._actions if isinstance(s, subcommands)
                for a in s._choices_actions]  # each subcommand's line in its parent's help
    assert [f"{prog} {' '.join(a.option_strings) or a.dest}" for prog, a in actions + commands if not a.help] == []
    generate = " ".join(parsers["specjax generate"].format_help().split())
    assert "with both, this prompt is the batch's first row, before the file's" in generate
    assert "a PROMPT given too runs with them, as the batch's first row" in generate


def test_a_target_without_a_tokenizer_takes_one_from_tokenizer(hf_folder, tmp_path, capsys, monkeypatch):
    """A folder of weights alone (as save_model writes without a tokenizer) is refused in one
    whole sentence naming it and --tokenizer; with --tokenizer it runs (generate and serve). A PROMPT given with
    --batch-file runs as the batch's first row (as --help says)."""
    import json

    from specjax.cli import entry
    from tests import tiny

    folder = hf_folder("llama")[0]  # config.json and model.safetensors only
    tiny.save_tokenizer(tmp_path / "tok", ["the cat sat on the mat"] * 20)
    capsys.readouterr()  # the fixture's progress bars
    assert entry(["generate", "the cat", "--target", str(folder), "--no-draft"]) == 2
    assert capsys.readouterr().err == (f"specjax: error: {folder} has no tokenizer (no tokenizer.json, "
                                       f"tokenizer_config.json or the like): pass --tokenizer PATH, a folder or hub "
                                       f"id holding the target's tokenizer\n")
    batch = tmp_path / "prompts.txt"
    batch.write_text("the mat\n")
    main(["generate", "the cat", "--batch-file", str(batch), "--target", str(folder), "--tokenizer",
          str(tmp_path / "tok"), "--no-draft", "--max-new-tokens", "2", "--json"])
    assert [row["prompt"] for row in json.loads(capsys.readouterr().out)["outputs"]] == ["the cat", "the mat"]
    # specjax serve too: refused in the same sentence, and served with --tokenizer (its uvicorn stubbed).
    import specjax.serve.api as api
    import specjax.serve.server as server

    served = []
    monkeypatch.setattr(api, "create_app", lambda app_server, owns_engine: served.append(app_server.tokenizer))
    monkeypatch.setattr(server, "_server_class", lambda: lambda config: type("Run", (), {"run": lambda self: None})())
    monkeypatch.setattr("uvicorn.Config", lambda *a, **k: None)  # (its logging would write to capsys' stream)
    args = ["serve", str(folder), "--draft", "none", "--slots", "1", "--max-model-len", "32", "--no-warmup",
            "--no-compilation-cache"]
    assert entry(args) == 2
    assert "has no tokenizer (no tokenizer.json, tokenizer_config.json or the like): pass --tokenizer PATH" in \
        capsys.readouterr().err
    assert entry(args + ["--tokenizer", str(tmp_path / "tok")]) == 0
    assert served and served[0].encode("the cat") == specjax.load_tokenizer(tmp_path / "tok").encode("the cat")
    capsys.readouterr()  # a page pool from a budget (at most what the one slot holds): on the start-up line
    assert entry(args + ["--tokenizer", str(tmp_path / "tok"), "--kv-cache-memory", "64KiB", "--page-size", "8"]) == 0
    assert "KV cache in 4 pages of 8 positions (20.0 KiB): 32 tokens for 1 slots" in capsys.readouterr().err


def test_bench_synthetic_honours_out(tmp_path, monkeypatch, capsys):
    """`bench --synthetic --out DIR` writes DIR/synthetic.json (without --out, nothing, as
    before); --tokenizer, which it would not read, is refused."""
    import json

    from specjax.cli import entry
    from specjax.tools import synthetic
    from specjax.tools.measure import Run

    run = Run("small", 2, 0.0, 1, 0.5, 16, 8, 14, 7, tokens_per_s=32.0)
    monkeypatch.setattr(synthetic, "run_synthetic", lambda *a, **k: [run])
    monkeypatch.chdir(tmp_path)
    main(["bench", "--synthetic", "tiny"])
    assert list(tmp_path.iterdir()) == []
    main(["bench", "--synthetic", "tiny", "--out", "runs"])
    report = json.loads((tmp_path / "runs" / "synthetic.json").read_text())
    assert report["synthetic"] == "tiny" and report["runs"] == [run.as_dict()]
    assert entry(["bench", "--synthetic", "tiny", "--tokenizer", "x"]) == 2
    assert "--tokenizer encodes the held-out prompts" in capsys.readouterr().err


def test_a_tree_reports_its_tokens_per_pass_and_a_smaller_draft_vocabulary_is_noted(hf_folder, tmp_path, capsys):
    """A tree's summary gives its tokens per target pass (the name a chain's uses) and the
    tree's shape, no acceptance rate over its nodes and no K; a draft with a few ids fewer than the target's (padding
    of another size) gets a one-line note saying which ids it never proposes."""
    import dataclasses

    from tests import tiny

    target = specjax.load_model(hf_folder("llama")[0])
    params = {**target.params, "embedding": target.params["embedding"][:94],
              "lm_head": target.params["lm_head"][:, :94]}
    draft = specjax.Model(dataclasses.replace(target.config, vocab_size=94), params)
    specjax.save_model(draft, tmp_path / "draft")
    tiny.save_tokenizer(tmp_path / "tok", ["the cat sat on the mat"] * 20)
    capsys.readouterr()
    main(["generate", "the cat", "--target", str(hf_folder("llama")[0]), "--tokenizer", str(tmp_path / "tok"),
          "--draft", str(tmp_path / "draft"), "--tree", "3,2,4", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    summary = out.splitlines()[-1]
    assert re.search(r"\| \d\.\d\d tokens per target pass \|", summary), summary
    assert "tree of 4 nodes, depth 3" in summary and "acceptance" not in summary and "K=" not in summary, summary
    assert ("note: the draft's vocabulary has 94 tokens, the target's 97: the draft never proposes the target's ids "
            "94..96\n") in err, err


def test_serve_drafts_from_the_saved_vocabulary_on_a_mesh_too(monkeypatch, capsys):
    """The served draft model is the shipped recipe (its saved 1,024-token vocabulary), also
    when --mesh shards it (its model replaced, not rebuilt without the vocabulary)."""
    import specjax.serve.api as api
    import specjax.serve.server as server
    from specjax.cli import entry

    drafts = []
    monkeypatch.setattr(api, "create_app", lambda app_server, owns_engine: drafts.append(
        app_server.engine.programs.deepest))
    monkeypatch.setattr(server, "_server_class", lambda: lambda config: type("Run", (), {"run": lambda self: None})())
    monkeypatch.setattr("uvicorn.Config", lambda *a, **k: None)  # (its logging would write to capsys' stream)
    args = ["serve", "--slots", "1", "--max-model-len", "64", "--no-warmup", "--no-compilation-cache"]
    assert entry(args) == 0 and entry(args + ["--mesh", "1,1"]) == 0
    assert [int(d.vocab.shape[0]) for d in drafts] == [1024, 1024]


def test_serve_names_every_drafter_the_engine_runs():
    """--draft's names and folders give the drafters the engine serves: the shipped heads
    (medusa, eagle, eagle3), a datastore's folder (retrieval), prompt lookup, lookahead, early exit."""
    import specjax.serve.server as server
    from specjax.serve.engine import _supported
    from specjax.shipped import default_checkpoint

    target_path = default_checkpoint("target")
    target = specjax.load_model(target_path)
    datastore = str(Path(target_path).parent / "datastore")
    for spec, kind in (("medusa", "Medusa"), ("eagle", "Eagle"), ("eagle3", "Eagle3"), (datastore, "Retrieval"),
                       ("prompt-lookup", "PromptLookup"), ("lookahead", "Lookahead"), ("early-exit:2", "EarlyExit")):
        drafter = server.load_draft(spec, target, None, target_path)
        assert type(drafter).__name__ == kind, spec
        assert _supported(drafter) is drafter  # not refused by the engine
