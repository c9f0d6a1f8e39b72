"""The package's modules import each other without circles: dependencies point one way.

Walks every `import` of every module under src/hf_switchback, function-local ones included (a local import
only hides a circle from Python, not from a reader), and looks for a cycle in the module graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_switchback

PACKAGE_DIR = Path(hf_switchback.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (`from . import x` counts as importing x)."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from pkg import sub` imports the submodule sub when there is one
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None. Package __init__ files are left out: importing a
    submodule runs its package's __init__ first by Python's rules, which is not a dependency of the code."""
    nodes = {n for n in graph if not (PACKAGE_DIR.parent / n.replace(".", "/") / "__init__.py").exists()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node] & nodes):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "hf_switchback.modules" in graph and "hf_switchback.kernels.options" in graph  # the walk saw them
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]


def test_leaf_modules_import_nothing_from_the_package():
    """The modules others lean on to break circles stay leaves; accelerate_fp8 may lean on the adapters, which
    import nothing from the package at all."""
    graph = import_graph()
    adapters = {name for name in graph if name.startswith("hf_switchback.adapters.")}
    assert "hf_switchback.adapters.accelerate" in adapters  # the walk saw them
    for leaf in ("hf_switchback.kernels.options", *sorted(adapters)):
        assert graph[leaf] == set(), (leaf, graph[leaf])
    assert graph["hf_switchback.accelerate_fp8"] <= adapters, graph["hf_switchback.accelerate_fp8"]
