"""A griffe extension for the API reference: a docstring's argument lines ("name: what it
is", or "a, b: ...", at the docstring's own indent) become list items, so that the site
shows one argument a line instead of running them into one paragraph. Lines that follow an
item stay part of it (indented, or a wrapped first line at the docstring's indent); a line
at that indent after indented ones starts a paragraph; fenced code is left alone. Docstrings themselves
stay plain text, read as they are in a terminal."""

from __future__ import annotations

import re

import griffe

_ARGUMENT = re.compile(r"^([A-Za-z_]\w*(?:, [A-Za-z_]\w*)*): (?=\S)")


def listed(text: str) -> str:
    out, fenced, listing, indented = [], False, False, False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else _ARGUMENT.match(line)
        if match:
            if not listing and out and out[-1].strip():
                out.append("")  # a list starts after a blank line
            out.append(f"- `{match.group(1)}`: {line[match.end():]}")
            listing, indented = True, False
            continue
        if not line.strip():
            listing = False
        elif listing and line[0].isspace():
            indented = True
        elif listing and indented:  # back at the docstring's indent after an indented item: a paragraph
            out.append("")
            listing = False
        out.append(line)
    return "\n".join(out)


class ArgumentLists(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = listed(obj.docstring.value)
