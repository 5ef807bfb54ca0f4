"""No import circle inside ds_hybrid: every module's imports (module level and inside functions,
where lazy imports used to hide circles) form a graph without cycles."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds_hybrid"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package (``__init__`` is the package)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that ``name`` imports anywhere in its file -> the first line doing so.
    ``from X import y`` counts as importing ``X.y`` when that is a module, else ``X``."""
    root = name.split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target.split(".")[0] == root and target in modules and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    modules = module_files(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), each as the
    path of modules that closes it, starting and ending at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:   # walk inside the component until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in component)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(cycle) + " (" + ", ".join(
        f"{a} line {graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])) + ")"


def test_no_import_cycle_in_ds_hybrid():
    graph = import_graph(PACKAGE)
    assert "ds_hybrid.train" in graph and "ds_hybrid.dynamics.encoder" in graph   # it walked the package
    cycles = find_cycles(graph)
    assert not cycles, "import circles in ds_hybrid:\n" + "\n".join(describe(c, graph) for c in cycles)


def test_the_two_circles_of_issue_16_are_gone():
    graph = import_graph(PACKAGE)
    assert "ds_hybrid.dynamics.encoder" not in graph["ds_hybrid.kernels"]
    # the planner is below the main job: train may ask it (its pre-flight estimate), never the reverse
    assert "ds_hybrid.train" not in graph["ds_hybrid.memory.planner"]
    # what they shared lives below both
    assert "ds_hybrid.dynamics.window" in graph["ds_hybrid.kernels"]
    assert "ds_hybrid.arguments" in graph["ds_hybrid.train"]
    assert "ds_hybrid.arguments" in graph["ds_hybrid.memory.planner"]


def test_a_circle_through_a_lazy_import_is_found_and_named(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    from ..c import g\n    return g\n")
    (pkg / "c.py").write_text("from pkg import a\n\ng = 1\n")
    (pkg / "d.py").write_text("from . import a\n")   # into the circle, not part of it
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.c": 5}
    [cycle] = find_cycles(graph)
    assert cycle == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert describe(cycle, graph) == ("pkg.a -> pkg.sub.b -> pkg.c -> pkg.a (pkg.a line 1 imports pkg.sub.b, "
                                      "pkg.sub.b line 5 imports pkg.c, pkg.c line 1 imports pkg.a)")
    (pkg / "c.py").write_text("g = 1\n")
    assert find_cycles(import_graph(pkg)) == []
