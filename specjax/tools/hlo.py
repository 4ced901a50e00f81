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
    """stack_frame_id -> "file:line" of the innermost frame outside JAX, Flax and specjax/tools/aot.py (which builds the programs)
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
            if not any(part in file for part in ("/jax/", "/jaxlib/", "/flax/", "specjax/tools/aot.py", "?")):
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
                 f"{short_path(source.group(1))}:{source.group(2)}" if source else "?")
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
        size = _bytes(f"{dtype}[{dims}]")
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


# ---- the bytes an optimised program's kernels move -----------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")  # dtype[dims] (an unknown dtype counts 4 bytes an element)
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id",
         "replica-id", "opt-barrier", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}  # read only what they return of their first operand
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # write their update into their first operand's buffer
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")


def _bytes(shape: str) -> int:
    """Bytes of an HLO shape's arrays ("bf16[8,128]{1,0}", or a tuple of them)."""
    return sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES.get(dtype, 4)
               for dtype, dims in _ARRAY.findall(shape))


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction, from the text after its opcode's "(" ."""
    depth, end = 1, 0
    for end, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _computations(hlo: str) -> tuple[dict, str | None]:
    """{name: [(name, shape, opcode, operands, line)]} of an HLO module's text, and its entry's name."""
    computations, current, entry = {}, None, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line) if current else None
        if m:
            name, shape, opcode, rest = m.groups()
            computations[current].append((name, shape, opcode, _operands(rest), line))
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of an optimised program and the bytes it moves (`kernels`)."""

    name: str  # the instruction's name ("loop_gather_fusion", "custom-call.3")
    op: str  # its opcode, or fusion(root opcode)
    bytes: int  # read and written, times its loop's trip count
    source: str  # the Python line behind it (as `large_copies` names them)

    def __str__(self):
        return f"{self.bytes / MB:10.1f} MB  {self.op:<28} {self.name} at {self.source}"


def traffic(hlo: str) -> int:
    """Bytes the kernels of an optimised HLO module move (`kernels`), all together."""
    return sum(k.bytes for k in kernels(hlo))


def kernels(hlo: str) -> list[Kernel]:
    """The kernels of an optimised HLO module (`compiled.as_text()`), largest first, with the
    bytes each reads and writes: each kernel (a fusion, a custom call, an unfused op) reading
    its operands and writing its result once, what a memory-bound program costs. A fusion
    reads only the slices or rows it takes of an operand used through dynamic-slice, slice or
    gather, and writes only the update of a dynamic-update-slice or scatter into an operand's
    buffer (in place), not the buffer. A loop's body counts its known trip count times (once where XLA knows none). A
    custom call (cuDNN, a Pallas kernel) counts its operands whole: what it skips inside
    (past a row's length) is not known here, nor what it re-reads.
    XLA's own cost analysis of a GPU program compiled here counts a gather's table and an
    in-place update's buffer whole, which is why this exists."""
    computations, entry = _computations(hlo)

    def fusion_bytes(called: str, operand_shapes: list[str], shape: str) -> int:
        body = computations.get(called, [])
        by_name = {i[0]: i for i in body}
        params = {int(re.search(r"parameter\((\d+)\)", i[4]).group(1)): i[0] for i in body if i[2] == "parameter"}
        users = {}
        for i in body:
            for o in i[3]:
                users.setdefault(o, []).append(i)
        root = next((i for i in body if i[4].lstrip().startswith("ROOT")), None)
        roots = [by_name[o] for o in root[3]] if root and root[2] == "tuple" else [root] if root else []
        buffers = {r[3][0] for r in roots if r[2] in _IN_PLACE}  # updated in place: not read whole

        def written(r):  # an in-place update writes its update alone
            return _bytes(by_name[r[3][-1]][1]) if r[2] in _IN_PLACE and r[3][-1] in by_name else _bytes(r[1])

        def sliced(u):  # whether a slicing reader takes the parameter (through bitcasts), not its indices
            return by_name.get(u[3][0], (None, None, "bitcast"))[2] in ("bitcast", "parameter")

        total = sum(map(written, roots)) if roots else _bytes(shape)
        for index, operand_shape in enumerate(operand_shapes):
            name = params.get(index)
            readers, through = [], list(users.get(name, []))
            while through:  # what reads the parameter, through bitcasts (a bitcast moves nothing)
                user = through.pop()
                if user[2] == "bitcast":
                    through += users.get(user[0], [])
                else:
                    readers.append(user)
            if name in buffers:
                continue
            if readers and all(u[2] in _SLICING and sliced(u) for u in readers):
                total += sum(_bytes(u[1]) for u in readers)
            else:
                total += _bytes(operand_shape)
        return total

    frames = _frames(hlo)
    roots = {c: next((i[2] for i in body if i[4].lstrip().startswith("ROOT")), "?") for c, body in computations.items()}

    def walk(computation: str, times: int, seen: tuple = ()) -> list[Kernel]:
        if computation in seen:
            return []
        shapes = {i[0]: i[1] for i in computations.get(computation, [])}
        found = []
        for name, shape, opcode, operands, line in computations.get(computation, []):
            operand_shapes = [shapes.get(o, "") for o in operands]
            called = _CALLED.findall(line)
            if opcode in _FREE:
                continue
            if opcode == "while":
                trips = _TRIPS.search(line)
                for c in called:
                    found += walk(c, times * (int(trips.group(1)) if trips else 1), seen + (computation,))
                continue
            if opcode in ("call", "conditional"):
                branches = [walk(c, times, seen + (computation,)) for c in called]
                found += max(branches, key=lambda ks: sum(k.bytes for k in ks), default=[])
                continue
            if opcode == "fusion" and called:
                moved, op = fusion_bytes(called[0], operand_shapes, shape), f"fusion({roots.get(called[0])})"
            elif opcode in _SLICING:
                moved, op = 2 * _bytes(shape) + sum(map(_bytes, operand_shapes[1:])), opcode
            elif opcode in _IN_PLACE:
                moved, op = 2 * _bytes(operand_shapes[-1]) + sum(map(_bytes, operand_shapes[1:-1])), opcode
            else:
                moved, op = _bytes(shape) + sum(map(_bytes, operand_shapes)), opcode
            frame = _FRAME_ID.search(line)
            found.append(Kernel(name, op, times * moved, frames.get(int(frame.group(1)), "?") if frame else "?"))
        return found

    return sorted(walk(entry, 1), key=lambda k: -k.bytes) if entry else []


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, element type, result shape) of every collective in compiled HLO text, each
    result of a combined one (XLA joins collectives into one of a tuple) on its own."""
    ops = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"
    found = []
    for results, op in re.findall(rf"= (\(?[\w\[\]{{}},\d ]*?\)?) ({ops})(?:-start)?\(", hlo):
        found += [(op, dtype, tuple(int(d) for d in dims.split(",") if d))
                  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", results)]
    return found
