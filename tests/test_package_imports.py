"""The package's import graph: no module reaches into another's private names, and the
imports among ``jaxrlvr`` modules form no cycle, at module level nor through the lazy imports
inside functions.

Read from the source with ``ast`` (nothing is imported): every ``from M import _name`` and every
``alias._name`` where ``alias`` was bound by an import of a ``jaxrlvr`` module counts as a private
reach. Imports inside functions run after every module has loaded, so Python accepts a cycle
through them; it is still a knot of two modules that need each other, so it is checked too.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrlvr"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``current``."""
    if not level:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str, tree: ast.Module):
    """(target module, imported name or None, bound alias, module level?) of every import."""
    is_package = MODULES[name].name == "__init__.py"
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        at_top = id(node) in top or any(
            id(node) in set(map(id, ast.walk(stmt)))
            for stmt in tree.body
            if isinstance(stmt, (ast.If, ast.Try))
        )
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, a.asname or a.name.split(".")[0], at_top
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node.module or "", node.level, name, is_package)
            for a in node.names:
                yield src, a.name, a.asname or a.name, at_top


def _edges_and_private_reaches():
    """(module-level import edges, every import edge incl. lazy ones, private reaches)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    all_edges: dict[str, set[str]] = {m: set() for m in MODULES}
    reaches: list[str] = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        module_aliases: dict[str, str] = {}
        for src, imported, alias, at_top in _imports(name, tree):
            if not src.startswith("jaxrlvr"):
                continue
            target = src
            if imported is not None:
                if imported.startswith("_") and not imported.startswith("__"):
                    reaches.append(f"{name}: from {src} import {imported}")
                if f"{src}.{imported}" in MODULES:
                    target = f"{src}.{imported}"
                    module_aliases[alias] = target
            elif src in MODULES and alias == src.split(".")[0]:
                module_aliases[alias] = "jaxrlvr"
            if target in MODULES and target != name:
                all_edges[name].add(target)
                if at_top:
                    edges[name].add(target)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                reaches.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    return edges, all_edges, reaches


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


EDGES, ALL_EDGES, REACHES = _edges_and_private_reaches()


def test_the_walk_sees_the_package():
    """The walk finds the modules and their imports (a guard against a vacuous pass)."""
    assert "jaxrlvr.algos.step" in MODULES and "jaxrlvr.model.decoder" in MODULES
    assert "jaxrlvr.algos.batch" in EDGES["jaxrlvr.algos.step"]


def test_no_module_imports_another_modules_private_names():
    assert REACHES == []


def test_no_import_cycle_among_package_modules():
    assert _cycles(EDGES) == []


def test_no_cycle_even_through_lazy_imports():
    """Modules that need each other only inside functions still form one knot (placement and
    vllm_server did); one of them should own what both need."""
    assert _cycles(ALL_EDGES) == []


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_cycle_finder(edges, expected):
    assert _cycles(edges) == expected
