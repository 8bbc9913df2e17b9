"""The import graph of lazyrt/, built from the sources: no cycles, and each package imports only what
its __init__ docstring allows.

Every import counts: module level, inside functions, and under `if TYPE_CHECKING:`. A package's
__init__ is not counted as imported by its own submodules (Python runs it first anyway).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lazyrt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name `path` imports (absolute; relative imports resolved), with `from a import b`
    giving both a.b and a (b may be a submodule or an attribute: resolved against the module list)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> lazyrt modules it imports (each name resolved to the longest existing module)."""
    mods = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imp in imported_names(path, name):
            if imp != "lazyrt" and not imp.startswith("lazyrt."):
                continue
            parts = imp.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            # a submodule does not depend on its own package's __init__ (or its parents')
            if target and not (name + ".").startswith(target + "."):
                deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of nodes (first == last), or None. Iterative DFS with colours."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt, 2) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif colour.get(nxt, 2) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


# The units of the layering: each sub-package of lazyrt/runtime/, each other sub-package of
# lazyrt/, and each top-level module.
def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["lazyrt", "runtime"] and len(parts) >= 3:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        u = unit_of(mod)
        units.setdefault(u, set()).update(unit_of(d) for d in deps if unit_of(d) != u)
    return units


ALLOWED_LINE = re.compile(r"^May import:(.*?)(?:\n\s*\n|\Z)", re.S | re.M)


def allowed_imports(package_init: Path) -> set[str] | None:
    doc = ast.get_docstring(ast.parse(package_init.read_text())) or ""
    m = ALLOWED_LINE.search(doc)
    if m is None:
        return None
    names = re.findall(r"lazyrt(?:\.\w+)+", m.group(1))
    return set(names)


def test_graph_sees_known_edges():
    # guards the parser itself: a type-only import, a function-level import, a from-import of a module
    g = import_graph()
    assert "lazyrt.runtime.scheduler.plan" in g["lazyrt.runtime.worker.model_runner"]
    assert "lazyrt.runtime.worker.model_worker" in g["lazyrt.runtime.worker.process"]  # inside a function
    assert "lazyrt.runtime.engine.engine" in g["lazyrt"]
    assert "lazyrt.runtime.scheduler.request" in g["lazyrt.runtime.scheduler.scheduler"]
    assert "lazyrt.config" in g["lazyrt.runtime.scheduler.scheduler"]


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_import_cycles():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


PACKAGES = sorted(
    p for p in PKG.rglob("__init__.py") if p.parent != PKG and p.parent != PKG / "runtime"
)


@pytest.mark.parametrize("init", PACKAGES, ids=lambda p: module_name(p))
def test_package_imports_only_what_its_docstring_allows(init: Path):
    allowed = allowed_imports(init)
    assert allowed is not None, f"{init}: docstring lacks a 'May import: ...' paragraph"
    unit = module_name(init)
    deps = package_graph(import_graph()).get(unit, set())
    extra = sorted(d for d in deps if d not in allowed)
    assert not extra, f"{unit} imports {extra}, which its docstring does not allow ({sorted(allowed)})"
