"""What a new user meets first: the package without torch, its version, the command's flags,
help and one-line refusals (no model is compiled here, or only a tiny one)."""

import os
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
