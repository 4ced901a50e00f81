"""Large buffers and relayout copies in an optimised XLA program (`compiled.as_text()`).

    python hlo_audit.py HLO.txt [MIN_MB]      or   audit(text, min_bytes) -> list of dicts

Rules (what a buffer is, in optimised HLO):
- Only instructions of *scheduled* computations own buffers: ENTRY, while body/condition,
  conditional branches, call / async-wrapped computations. Fusion bodies (`calls=` of a
  `fusion`) and reducer / comparator lambdas (`to_apply=`) do not.
- parameter, get-tuple-element, bitcast, tuple, constant, opt-barrier alias other buffers;
  while / conditional / call outputs alias their bodies' roots. `*-start` async ops carry
  their operand in their shape: their `*-done` is the buffer.
- Size is the *laid-out* size: the layout's first tile pads the minor dimensions
  (TPU `{1,2,0:T(8,128)}` on f32[1,5,128256] puts the 5 in the lanes: 65.7 MB, not 2.6 MB).
- `S(n)` in a layout is memory space n (TPU: 1 = on-chip VMEM, placed by memory-space
  assignment; not part of memory_analysis().temp_size_in_bytes). No S(): HBM.
A `copy` whose operand has the same shape and another layout is a relayout; traced back
through bitcast / get-tuple-element / copy-done / slice-done / custom-call(ConcatBitcast) to
an ENTRY parameter, it is a copy of an argument (a weight) in the layout its consumer wants.
In ENTRY, feeding a while, it is live for the whole loop.
"""
from __future__ import annotations

import re
import sys

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\](?:\{([^{}]*)\})?")
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
ALIASES = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "opt-barrier", "after-all",
           "partition-id", "replica-id", "while", "conditional", "call"}
SCHEDULED = re.compile(r"\b(?:body|condition|true_computation|false_computation|branch_computations|"
                       r"async_wrapped_computation|calls)=(\{[^}]*\}|%?[\w.\-]+)")
PASS_THROUGH = {"bitcast", "get-tuple-element", "copy-done", "slice-done", "custom-call", "copy-start", "slice-start"}


def arrays(shape: str):
    """[(dtype, dims, minor_to_major or None, first tile or None, memory space)] of a shape."""
    out = []
    for dt, dims, layout in ARRAY.findall(shape):
        dims = [int(d) for d in dims.split(",") if d]
        order, tile, space = None, None, 0
        if layout:
            m2m, _, rest = layout.partition(":")
            order = [int(x) for x in m2m.split(",") if x.strip().isdigit()] or None
            t = re.match(r"T\(([\d,]+)\)", rest)
            tile = [int(x) for x in t.group(1).split(",")] if t else None
            s = re.search(r"S\((\d+)\)", rest)
            space = int(s.group(1)) if s else 0
        out.append((dt, dims, order, tile, space))
    return out


def nbytes(shape: str, space: int | None = None) -> int:
    """Laid-out bytes of the arrays of a shape (those in memory space `space`, if given)."""
    total = 0
    for dt, dims, order, tile, sp in arrays(shape):
        if space is not None and sp != space:
            continue
        phys = [dims[i] for i in reversed(order)] if order and len(order) == len(dims) else list(dims)
        for k, t in enumerate(reversed(tile or [])):
            if k < len(phys):
                phys[-1 - k] = -(-phys[-1 - k] // t) * t
        n = 1
        for d in phys:
            n *= d
        total += n * DTYPE_BYTES.get(dt, 4)
    return int(total)


def parse(text: str):
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        h = HEADER.match(line)
        if h and "=" not in line.split("(")[0]:
            cur = h.group(2)
            comps[cur] = []
            entry = cur if h.group(1) else entry
            continue
        m = INSTR.match(line)
        if m and cur:
            root, name, shape, op, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0] if op != "fusion" else rest.split("), kind")[0])
            comps[cur].append(dict(comp=cur, name=name, shape=shape, op=op, rest=rest, operands=operands,
                                   op_name=(re.search(r'op_name="([^"]*)"', rest) or [None, ""])[1],
                                   frame=int((re.search(r"stack_frame_id=(\d+)", rest) or [None, 0])[1])))
    return comps, entry


def scheduled(comps, entry):
    seen, todo = set(), [entry]
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for i in comps[c]:
            if i["op"] != "fusion":
                for grp in SCHEDULED.findall(i["rest"]):
                    todo += [n.strip().lstrip("%") for n in grp.strip("{}").split(",") if n.strip()]
    return seen


def stack_index(text: str):
    """stack_frame_id -> [(file, function, line)], innermost first, from the module's
    FileNames / FunctionNames / FileLocations / StackFrames tables. (As printed by this XLA,
    a frame's parent_frame_id reads one past its parent's id; repeated frames are dropped.)"""
    sec, tab = None, {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    for line in text.splitlines():
        if line in tab:
            sec = line
            continue
        if sec is None:
            continue
        k, _, v = line.partition(" ")
        if not k.isdigit():
            if tab["StackFrames"]:
                break
            continue
        if sec in ("FileNames", "FunctionNames"):
            tab[sec][int(k)] = v.strip('"')
        else:
            tab[sec][int(k)] = {a: int(b) for a, b in re.findall(r"(\w+)=(\d+)", v)}

    def resolve(fid):
        out, seen = [], set()
        while fid in tab["StackFrames"] and fid not in seen:
            seen.add(fid)
            fr = tab["StackFrames"][fid]
            loc = tab["FileLocations"][fr["file_location_id"]]
            item = (tab["FileNames"][loc["file_name_id"]], tab["FunctionNames"][loc["function_name_id"]], loc["line"])
            if item not in out:
                out.append(item)
            fid = fr["parent_frame_id"] - 1
        return out
    return resolve


def audit(text: str, min_bytes: float = 50e6, project: str = "specjax/", space: int | None = 0):
    """Buffers of >= min_bytes in memory space `space` (0: HBM; None: any), largest first."""
    comps, entry = parse(text)
    live = scheduled(comps, entry)
    resolve = stack_index(text)
    by_name = {i["name"]: i for c in live for i in comps[c]}
    params = {i["name"] for i in comps[entry] if i["op"] == "parameter"}
    feeds_while = set()
    for i in comps[entry]:
        if i["op"] == "while":
            feeds_while.update(i["operands"])
    for i in comps[entry]:  # the while's init tuple's operands
        if i["op"] == "tuple" and any(i["name"] in w["operands"] for w in comps[entry] if w["op"] == "while"):
            feeds_while.update(i["operands"])

    def origin(name, depth=0):
        i = by_name.get(name)
        if i is None or depth > 8:
            return None
        if i["op"] == "parameter" and i["comp"] == entry:
            return i["name"]
        if i["op"] in PASS_THROUGH and i["operands"]:
            return origin(i["operands"][0], depth + 1)
        return None

    rows = []
    for c in live:
        for i in comps[c]:
            if i["op"] in ALIASES or i["op"].endswith("-start"):
                continue
            size = nbytes(i["shape"])
            if (size if space is None else nbytes(i["shape"], space)) < min_bytes:
                continue
            src = by_name.get(i["operands"][0]) if i["operands"] else None
            relayout = (i["op"] in ("copy", "transpose") and src is not None)
            frames = [f"{f.split(project)[-1]}:{ln}" for f, _, ln in resolve(i["frame"]) if project in f]
            rows.append(dict(
                name=i["name"], op=i["op"], bytes=size, hbm_bytes=nbytes(i["shape"], 0),
                shape=re.sub(r"\s+", "", i["shape"]),
                from_shape=re.sub(r"\s+", "", src["shape"]) if relayout else "",
                argument=origin(i["operands"][0]) if relayout else None,
                hoisted=c == entry and i["name"] in feeds_while,
                computation="ENTRY" if c == entry else c, op_name=i["op_name"], source=" < ".join(frames[:4])))
    return sorted(rows, key=lambda r: -r["bytes"])


if __name__ == "__main__":
    text = open(sys.argv[1]).read()
    for r in audit(text, float(sys.argv[2]) * 1e6 if len(sys.argv) > 2 else 50e6):
        kind = ("ARG-RELAYOUT " + r["argument"] if r["argument"] else "relayout") if r["from_shape"] else r["op"]
        print(f'{r["bytes"] / 1e6:8.1f} MB (HBM {r["hbm_bytes"] / 1e6:6.1f}) {kind[:60]:60s} {r["shape"][:56]:56s}'
              f'{" <- " + r["from_shape"][:48] if r["from_shape"] else ""}'
              f'{"  [ENTRY, feeds the while: live for the whole loop]" if r["hoisted"] else ""}'
              f'  {r["source"] or r["op_name"][-70:]}')
