"""Reading XLA's optimised HLO text: the large copies, transposes and converts a compiled
program holds, each named by the Python line behind it (its metadata's stack frames).

It knows nothing about specjax's programs or how they were built (see aot.py).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from specjax.memory import MB


@dataclasses.dataclass(frozen=True)
class Copy:
    """A large copy, transpose or convert in an optimised program."""

    op: str  # copy | transpose | convert (or the fusion made of one)
    shape: str  # "bf16[128256,2048]"
    bytes: int
    source: str  # "specjax/models/layers.py:123" (the Python line that made it), or the op's name

    def __str__(self):
        return f"{self.op} {self.shape} ({self.bytes / MB:.1f} MB) at {self.source}"



_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]([^ ]*)\s+([\w\-]+)\(")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")  # a layout's memory space other than HBM (VMEM, SMEM)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]+)"\s+source_line=(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
MOVES = ("copy", "transpose", "convert")


def _frames(hlo: str) -> dict[int, str]:
    """stack_frame_id -> "file:line" of the innermost frame outside JAX, Flax and specjax/aot.py (which builds the programs)
    (the HLO text's FileNames / FileLocations / StackFrames tables)."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in hlo.splitlines():
        word = line.strip()
        if word in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section, tables[word] = word, {}
            continue
        if not word or word.startswith(("%", "ENTRY", "HloModule", "ROOT")):
            if word.startswith(("%", "ENTRY")):
                section = None
            continue
        if section:
            number, _, rest = word.partition(" ")
            if number.isdigit():
                tables[section][int(number)] = rest
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        f, ln = re.search(r"file_name_id=(\d+)", v), re.search(r"\bline=(\d+)", v)
        if f and ln:
            locations[k] = (files.get(int(f.group(1)), "?"), int(ln.group(1)))
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc, parent = re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v)
        frames[k] = (int(loc.group(1)) if loc else 0, int(parent.group(1)) if parent else 0)

    def specjax_line(frame: int) -> str:
        seen = set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            location, parent = frames[frame]
            file, line = locations.get(location, ("?", 0))
            if not any(part in file for part in ("/jax/", "/jaxlib/", "/flax/", "specjax/aot.py", "?")):
                return f"{short_path(file)}:{line}"
            frame = parent
        return "?"

    return {k: specjax_line(k) for k in frames}


def large_copies(hlo: str, threshold: int) -> tuple[Copy, ...]:
    """The copies, transposes and converts in an optimised HLO module (`compiled.as_text()`)
    whose result holds at least `threshold` bytes and lives in HBM: plain ones, and fusions
    whose root is one (XLA fuses a relayout or a cast into a loop fusion); what a fusion
    computes inside itself is never written out, so fused computations are not read, and
    what XLA stages in on-chip memory (a layout's S(1)) is not counted. Each is named by the
    source line its metadata points to, or the argument it copies."""
    lines = hlo.splitlines()
    fused = {m.group(1) for line in lines if " fusion(" in line for m in [_CALLS.search(line)] if m}
    roots, current = {}, None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
        elif current and line.strip().startswith("ROOT") and _SHAPE.match(line):
            roots[current] = _SHAPE.match(line).group(5)
    frames = _frames(hlo)
    defined = {m.group(1): line for line in lines for m in [_SHAPE.match(line)] if m}

    def origin(line: str, hops: int = 4) -> str:
        """The specjax line (or argument) behind an instruction: its own metadata, else its
        first operand's (XLA's own relayout copies carry none)."""
        frame, source, name = _FRAME_ID.search(line), _SOURCE.search(line), _OP_NAME.search(line)
        where = (frames.get(int(frame.group(1)), "?") if frame else
                 f"{_short(source.group(1))}:{source.group(2)}" if source else "?")
        if where == "?" and name:
            where = name.group(1).replace("\\'", "'")  # HLO text escapes the quotes of params['...']
        operand = re.search(r"\w+\(%([\w.\-]+)", line.split("=", 1)[1])
        if where == "?" and hops and operand and operand.group(1) in defined:
            return origin(defined[operand.group(1)], hops - 1)
        return where

    found = []
    current = None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            continue
        m = _SHAPE.match(line)
        if not m or current in fused:
            continue
        _, dtype, dims, layout, opcode = m.groups()
        if _ON_CHIP.search(layout):  # staged in on-chip memory, not a buffer in HBM
            continue
        op = opcode
        if opcode == "fusion":
            calls = _CALLS.search(line)
            op = roots.get(calls.group(1)) if calls else None
            if op not in MOVES:
                continue
            op = f"fusion({op})"
        elif opcode not in MOVES:
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES.get(dtype, 4)
        if size < threshold:
            continue
        found.append(Copy(op, f"{dtype}[{dims}]", size, origin(line)))
    return tuple(sorted(found, key=lambda c: -c.bytes))


def short_path(path: str) -> str:
    """A source path from the repository's root (specjax/..., tests/...), else its name."""
    for root in ("specjax/", "tests/", "docs/"):
        i = path.rfind(root)
        if i >= 0:
            return path[i:]
    return os.path.basename(path)
