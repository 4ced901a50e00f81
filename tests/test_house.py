"""The package's shape: no import cycle among specjax's modules (function-level imports
count), no module over 700 lines, the loop's entry point under 400, and the library's core
importing nothing of specjax.tools (the measuring and planning tools)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specjax"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the specjax modules it imports anywhere in its text. `from pkg import name`
    counts as importing pkg.name where that is a module, else pkg."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        deps.add(f"{base}.{a.name}")
                    elif base in modules:
                        deps.add(base)
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = import_graph()
    assert "specjax.loop" in graph and "specjax.drafters.base" in graph["specjax.loop"]
    assert cycles(graph) == []


def test_module_sizes():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert lines["specjax.generate"] <= 400
    assert {name: n for name, n in lines.items() if n > 700} == {}


# The command line is the tools' front door.
FRONT_DOOR = {"specjax.cli"}


def core_imports_of_tools(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Core module (all of specjax outside specjax.tools and FRONT_DOOR)
    -> the specjax.tools modules it imports, where it imports any."""
    def is_tool(name):
        return name == "specjax.tools" or name.startswith("specjax.tools.")

    core = {name for name in graph if not is_tool(name)} - FRONT_DOOR
    return {name: sorted(d for d in graph[name] if is_tool(d)) for name in sorted(core)
            if any(is_tool(d) for d in graph[name])}


def test_the_core_check_finds_an_import_of_the_tools():
    graph = {"specjax.loop": {"specjax.tools.measure"}, "specjax.cli": {"specjax.tools.plan"},
             "specjax.tools.measure": {"specjax.loop"}, "specjax.tools.plan": set(), "specjax.tree": set()}
    assert core_imports_of_tools(graph) == {"specjax.loop": ["specjax.tools.measure"]}


def test_the_core_imports_no_tools():
    """specjax.tools (measuring, planning, the bench, the notebooks' helpers) stands on the
    core; the core, at module level or in a function, never imports it."""
    graph, paths = import_graph(), _modules()
    assert "specjax.tools.plan" in graph["specjax.cli"]  # the walker sees the front door's imports
    offenders = {str(paths[name].relative_to(ROOT.parent)): tools
                 for name, tools in core_imports_of_tools(graph).items()}
    assert offenders == {}, f"the core imports specjax.tools: {offenders}"
