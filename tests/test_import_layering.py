"""The package's module-level imports form no circle (imports point one way: docs/architecture.md's layering).

Read from the source with ``ast`` (nothing is imported): a module's imports at import time, not those inside
functions or classes, nor under ``if TYPE_CHECKING``. ``from . import x`` counts as importing the module ``x``
when ``x`` is one; a package's import reaches its ``__init__``. A module's own parent packages are no edge: Python
initializes them before it, whatever it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "paged_hf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(nodes):
    """Statements that run at import time (``if`` / ``try`` / ``with`` bodies included, ``TYPE_CHECKING`` not)."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _top_level(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _top_level(getattr(node, field, []) or [])


def module_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: the package's modules it imports at import time}``."""
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in _top_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.add(target)
                found |= {f"{target}.{alias.name}" for alias in node.names}
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in found if m in modules and m != name and m not in ancestors}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = module_imports(modules)
    assert graph["paged_hf.cache"], "the reader found no imports: it is broken"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
