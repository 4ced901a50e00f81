"""The README and the docs site: the README is short and its code runs as written; the site
builds with warnings as errors (a broken link, a renamed function in the API reference, a
docstring the renderer cannot read) and its reference lists every public name."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import specjax
from specjax import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


def test_readme_python_example_runs_as_written(capsys, monkeypatch):
    """The "Use from JAX" block, executed from the repository's root: it prints each row's
    decoded text, and the draft it loads drafts from the vocabulary saved beside it."""
    code = next(b for b in blocks("python") if "specjax.generate(" in b)
    scope: dict = {}
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), scope)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and all(line.startswith("'") and len(line) > 4 for line in printed[:2])
    assert scope["draft"].vocab is not None  # the shipped recipe, as `specjax generate` drafts


def test_readme_commands_parse(monkeypatch):
    """Every `specjax ...` line of the README's shell blocks is accepted by the CLI's parser
    (run: the set-up commands, by CI and tests/test_cli.py; the rest parsed, not run)."""
    lines = [line.split("  #")[0].strip() for b in blocks("bash") for line in b.splitlines()]
    commands = [shlex.split(line.split("&&")[-1])[1:] for line in lines if re.match(r"(pip .*&& )?specjax ", line)]
    assert len(commands) >= 8
    parse = cli._Parser.parse_args
    parsed = []

    def parse_only(self, argv=None, namespace=None):
        args = parse(self, argv, namespace)
        args.run = parsed.append
        return args

    monkeypatch.setattr(cli._Parser, "parse_args", parse_only)
    for words in commands:
        words = [w.replace("PATH_OR_HUB_ID", "checkpoints/target").replace("PATH", "checkpoints/target")
                 .replace("KEY", "sekret") for w in words]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                cli.main(words)
            except SystemExit as e:
                pytest.fail(f"specjax {shlex.join(words)}: {err.getvalue().strip() or e}")
    assert len(parsed) == len(commands)


def test_api_reference_lists_every_public_name():
    # `specjax.generate` names the module: its function is `specjax.generate.generate` there
    listed = set(re.findall(r"^::: specjax\.(?:generate\.)?(\w+)$", (ROOT / "docs/reference/api.md").read_text(), re.M))
    assert listed == {name for name in specjax.__all__ if not name.startswith("__")}
    assert "specjax.__version__" in (ROOT / "docs/reference/api.md").read_text()


def test_docs_site_builds_without_warnings(tmp_path):
    """mkdocs build --strict: the guides' links and anchors, the API reference (mkdocstrings
    reading every public docstring), the CLI reference (the parser's help). Not with -q: then
    strict mode's abort still exits 0 (a warning passed unseen until 53bdaf5's review)."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "WARNING" not in run.stdout + run.stderr, run.stdout + run.stderr
    cli_page = (tmp_path / "site/reference/cli/index.html").read_text()
    assert "usage: specjax serve" in cli_page and "--max-model-len" in cli_page
    api_page = (tmp_path / "site/reference/api/index.html").read_text()
    assert "Generates up to max_new_tokens per row" in api_page


NOT_RUN = re.compile(r"<!-- not run here: (.+?) -->\s*$")


def python_blocks() -> list[tuple[str, int, str, str | None]]:
    """(file, line, code, why it is not run or None) of every python block of the README and
    the docs site."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            before = text[:m.start()].rstrip("\n").splitlines()
            why = NOT_RUN.search(before[-1]) if before else None
            found.append((str(path.relative_to(ROOT)), text[:m.start()].count("\n") + 1, m.group(1),
                          why and why.group(1)))
    return found


def test_every_python_block_of_the_readme_and_guides_runs_from_anywhere(tmp_path, monkeypatch, capsys):
    """Each block runs as written, from a folder that is not the repository's, after the
    quickstart's names (target, draft, tokenizer, prompts, lengths on the shipped pair) and
    the few a guide's text names (token_lists, path, draft_path); a block that cannot run
    here says why just above it (`<!-- not run here: ... -->`), naming the test that does."""
    import jax

    blocks = python_blocks()
    assert len(blocks) >= 15
    monkeypatch.chdir(tmp_path)
    target = specjax.load_model(specjax.shipped_checkpoint("target"))
    tokenizer = specjax.load_tokenizer(specjax.shipped_checkpoint("target"))
    prompts, lengths = specjax.pad_prompts([tokenizer.encode(t) for t in ["def add(a, b):", "import os\n"]])
    names = dict(jax=jax, specjax=specjax, target=target, tokenizer=tokenizer, prompts=prompts, lengths=lengths,
                 draft=specjax.load_drafter(specjax.shipped_checkpoint("draft")),
                 token_lists=[tokenizer.encode(t) for t in ["def add(a, b):\n    return a + b\n", "import os\n"]],
                 path=specjax.shipped_checkpoint("target"), draft_path=specjax.shipped_checkpoint("draft"))
    skipped = []
    for file, line, code, why in blocks:
        if why is not None:
            assert len(why) > 20, (file, line, why)
            skipped.append((file, line))
            continue
        try:
            exec(compile(code, f"{file}:{line}", "exec"), dict(names))
        except Exception as e:  # noqa: BLE001 - named with its block
            pytest.fail(f"{file}:{line}: {type(e).__name__}: {e}")
    assert len(skipped) <= 5, skipped  # (the fifth: the MTP drafter of a 700 GB DeepSeek-V3, which tests/test_mtp.py runs tiny)
    clients = {code for file, _, code, why in blocks if why is not None and "OpenAI(" in code}
    assert len(clients) == 1  # the serving guide's is the README's, which tests/test_serve.py runs
