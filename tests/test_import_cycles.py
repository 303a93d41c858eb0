"""No import cycles in product code, counting every import a reader sees.

The graph is built with :mod:`ast` from the source files, not from what Python happens to load:
a lazy import inside a function hides a cycle from Python, not from a reader.

Counting rule (issue 18):

- Nodes: every module of the installed packages, named as installed: ``qstrat/``, ``strategies/``
  as ``qstrat.strategies``, ``serializers/`` as ``qstrat.serializers`` (pyproject's
  ``package-dir``). A package is the node of its ``__init__.py``.
- Edges: every ``import`` / ``from ... import`` statement anywhere in a module - top level, inside
  functions and methods, under ``if TYPE_CHECKING:`` - and every ``importlib.import_module("...")``
  with a literal name. ``TYPE_CHECKING``-only imports count: an annotation naming
  ``qstrat.config.loader.RefitConfig`` is a dependency a reader (and a type checker) must follow, whether
  or not the interpreter executes the import.
- Relative imports are resolved against the importing module's package.
- ``import a.b.c`` and ``from a.b import c`` where ``a.b.c`` is a module depend on ``a.b.c``
  only; ``from a.b import name`` where ``name`` is not a submodule depends on ``a.b`` (its
  ``__init__``: re-exports count as the package's own names). Importing a submodule does NOT
  count as depending on its parent packages' ``__init__`` even though Python executes them: a
  package that re-exports its submodules would otherwise form a cycle with each of them, and the
  reader of ``from qstrat.errors import ConfigError`` depends on ``errors``, not on the facade.
  Product code that reads the facade (``import qstrat``, ``from qstrat import RefitDriver``)
  does depend on ``qstrat/__init__.py``, which is where such a cycle would show.

Run ``python tests/test_import_cycles.py`` to print the cycles with the import lines forming them.
"""
from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    """``src`` imports ``dst`` at ``path:line`` (``text``: the statement as written)."""

    src: str
    dst: str
    path: str
    line: int
    text: str


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> source file of every installed module, from pyproject's ``package-dir``.

    Every directory holding an ``__init__.py`` under a mapped root is a package (so a package
    missing from pyproject's ``packages`` list is still checked).
    """
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules: dict[str, Path] = {}
    for package, directory in tool["package-dir"].items():
        base = root / directory
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts or ".venv" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            name = ".".join((package, *rel))
            modules[name] = init
            for file in init.parent.glob("*.py"):
                if file.name != "__init__.py":
                    modules[f"{name}.{file.stem}"] = file
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    parts = module.split(".")
    package = parts if is_package else parts[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, target] if target else base)


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """The known modules one import node (or import_module call) depends on."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            for n in range(len(parts), 0, -1):  # the module itself, else its closest known parent
                if ".".join(parts[:n]) in known:
                    yield ".".join(parts[:n])
                    break
    elif isinstance(node, ast.ImportFrom):
        base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                else node.module or "")
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                yield f"{base}.{alias.name}"  # from pkg import submodule
            elif base in known:
                yield base  # a name defined (or re-exported) by the module
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "import_module")):
        if node.args[0].value in known:
            yield node.args[0].value


def import_edges(modules: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    """Every dependency edge between product modules (see the module docstring for the rule)."""
    known = set(modules)
    edges = []
    for module, path in sorted(modules.items()):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            for dst in dict.fromkeys(_targets(node, module, path.name == "__init__.py", known)):
                if dst != module:  # one edge per statement and target
                    edges.append(Edge(module, dst, str(path.relative_to(root)), node.lineno,
                                      lines[node.lineno - 1].strip()))
    return edges


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted (recursive:
    the depth is at most the number of modules, a few hundred)."""
    graph: dict[str, set[str]] = {n: set() for n in nodes}
    for e in edges:
        graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
    return sorted(found)


def describe(component: list[str], edges: list[Edge]) -> str:
    """The import lines inside one strongly connected component, one per line."""
    members = set(component)
    inner = [e for e in edges if e.src in members and e.dst in members]
    return "\n".join([f"cycle among {', '.join(component)}:"]
                     + [f"  {e.src} -> {e.dst}   {e.path}:{e.line}: {e.text}" for e in inner])


def cycles(root: Path = ROOT) -> tuple[list[list[str]], list[Edge]]:
    """The import cycles of the product code under ``root`` and all its edges."""
    modules = product_modules(root)
    edges = import_edges(modules, root)
    return strongly_connected(modules, edges), edges


def test_no_import_cycles_in_product_code():
    found, edges = cycles()
    assert not found, "import cycles (counting lazy and TYPE_CHECKING imports):\n" + "\n".join(
        describe(c, edges) for c in found)


def test_graph_covers_every_installed_package():
    modules = product_modules()
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["packages"]) <= set(modules)
    assert modules["qstrat.strategies.presets"] == ROOT / "strategies" / "presets.py"
    assert modules["qstrat.serializers.base"] == ROOT / "serializers" / "base.py"


def test_counting_rule_sees_lazy_type_checking_and_relative_imports(tmp_path):
    """The rule on a made-up tree: each kind of import forms an edge, and a cycle through a lazy
    import, a TYPE_CHECKING import or ``from pkg import submodule`` is found."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "top" = "top", "top.sub" = "sub" }\npackages = ["top", "top.sub"]\n')
    top, sub = tmp_path / "top", tmp_path / "sub"
    top.mkdir()
    sub.mkdir()
    (top / "__init__.py").write_text("from top.a import A\n")
    (top / "a.py").write_text("def f():\n    from top import b\n")          # lazy, from pkg import submodule
    (top / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    (top / "c.py").write_text("from top import A\n")                        # a re-exported name: the facade
    (top / "d.py").write_text("import importlib\ndef g():\n    importlib.import_module('top.sub.e')\n")
    (sub / "__init__.py").write_text("")
    (sub / "e.py").write_text("from ..d import g\n")                         # relative, two levels
    found, edges = cycles(tmp_path)
    pairs = {(e.src, e.dst) for e in edges}
    assert pairs == {("top", "top.a"), ("top.a", "top.b"), ("top.b", "top.a"), ("top.c", "top"),
                     ("top.d", "top.sub.e"), ("top.sub.e", "top.d")}
    assert found == [["top.a", "top.b"], ["top.d", "top.sub.e"]]


if __name__ == "__main__":
    found, edges = cycles()
    print("\n\n".join(describe(c, edges) for c in found) or "no import cycles")
    print(f"\n{len(found)} strongly connected component(s) with more than one module")
    sys.exit(1 if found else 0)
