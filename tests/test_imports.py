"""The package reads top to bottom: no module imports, directly or through others, a module
that imports it back, and no folder (subpackage) imports one that imports it back. Function-local
imports count too (one must not hide a cycle), and so do imports only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import splitmoe

ROOT = Path(splitmoe.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module mod where there is one
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    graph = _import_graph()
    assert "splitmoe.config" in graph and graph["splitmoe.llm"]  # the walk found the package
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto splitmoe's folders: ``a -> b`` when a module of folder ``a``
    (its modules and any folder inside it) imports one of folder ``b``. Modules at the top
    level (``splitmoe.config``, ``splitmoe.llm``) are not folders and are left out."""
    folders = {p.parent for p in ROOT.rglob("__init__.py")} - {ROOT}
    top = {_module_name(f / "__init__.py").split(".")[1] for f in folders}

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in top else None

    out: dict[str, set[str]] = {}
    for name, edges in graph.items():
        a = folder(name)
        if a is None:
            continue
        out.setdefault(a, set())
        out[a].update(b for b in map(folder, edges) if b is not None and b != a)
    return out


def test_no_folder_imports_one_that_imports_it_back():
    folders = _folder_graph(_import_graph())
    assert {"splitmoe.eplb", "splitmoe.expert_nodes", "splitmoe.scheduler"} <= set(folders)
    cycles = _cycles(folders)
    assert not cycles, "folder import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_folder_graph_sees_a_cycle():
    """The fold itself: two folders importing each other through any of their modules."""
    graph = {
        "splitmoe.scheduler.balancer": {"splitmoe.expert_nodes.experts"},
        "splitmoe.expert_nodes.worker": {"splitmoe.scheduler.placement"},
        "splitmoe.scheduler.placement": {"splitmoe.config"},
        "splitmoe.expert_nodes.experts": set(),
        "splitmoe.config": {"splitmoe.scheduler.placement"},
    }
    folders = _folder_graph(graph)
    assert _cycles(folders) == [
        ["splitmoe.expert_nodes", "splitmoe.scheduler", "splitmoe.expert_nodes"]
    ]


def test_the_graph_sees_a_cycle():
    """The check itself: a planted cycle is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
