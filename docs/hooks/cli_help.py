"""mkdocs hook: the command-line reference page is the CLI's own `--help` text, read when the
site builds, so that it cannot drift from the parser (a renamed flag changes the page).

In reference/cli.md, a line `<!-- specjax help: CMD ... -->` becomes the output of
`specjax CMD ... --help` in a code block; `<!-- specjax help: -->` the top level's.
"""

from __future__ import annotations

import contextlib
import io
import re

_MARK = re.compile(r"^<!-- specjax help:(.*?)-->$", re.M)


def _help(words: list[str]) -> str:
    from specjax import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main([*words, "--help"])
    text = out.getvalue().rstrip()
    if not text:
        raise RuntimeError(f"`specjax {' '.join(words)} --help` printed nothing")
    return text


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri != "reference/cli.md":
        return markdown
    return _MARK.sub(lambda m: "```text\n" + _help(m.group(1).split()) + "\n```", markdown)
