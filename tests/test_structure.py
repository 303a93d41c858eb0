"""No broad classes: every class of the installed packages stays under :data:`LIMIT` lines of code
(issue 32, "no class over ~120 lines doing more than one job").

Counted with :mod:`ast` from the source: the lines of the class body that hold code, without
docstrings, comments or blank lines (a contract documented at length is not a broad class). A
class over the limit is a failure unless :data:`KNOWN` names it with the reason it is one job or
why it is not split yet; an entry for a class that shrank under the limit fails too, so the list
only shrinks.

Run ``python tests/test_structure.py`` to print every class over 80 lines.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from test_import_cycles import product_modules

#: Lines of code (no docstrings, comments, blank lines) a class may hold.
LIMIT = 120

#: ``module.Class`` -> why it is over :data:`LIMIT` (one job, or what keeps it from being split now).
KNOWN: dict[str, str] = {}


def code_lines(source_lines: list[str], node: ast.ClassDef) -> int:
    """Lines of ``node`` holding code: not blank, not a comment, not inside a docstring of the
    class or of anything defined in it."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for n in ast.walk(node):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines -= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in lines if (text := source_lines[i - 1].strip()) and not text.startswith("#"))


def class_sizes() -> dict[str, int]:
    """``module.Class`` (nested classes as ``module.Outer.Inner``) -> :func:`code_lines`, for every
    class of every installed module."""
    sizes = {}
    for module, path in product_modules().items():
        source = path.read_text()
        lines = source.splitlines()

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    sizes[f"{prefix}.{child.name}"] = code_lines(lines, child)
                    visit(child, f"{prefix}.{child.name}")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{prefix}.{child.name}")

        visit(ast.parse(source, filename=str(path)), module)
    return sizes


def test_no_class_over_the_limit():
    sizes = class_sizes()
    over = {name: n for name, n in sizes.items() if n > LIMIT and name not in KNOWN}
    assert not over, f"classes over {LIMIT} lines of code (split them by job, or justify in KNOWN): {over}"


def test_every_known_class_is_still_over_the_limit():
    sizes = class_sizes()
    stale = {name: sizes.get(name) for name in KNOWN if sizes.get(name, 0) <= LIMIT}
    assert not stale, f"no longer over {LIMIT} lines (or gone): drop from KNOWN: {stale}"


def test_the_count_skips_docstrings_comments_and_blank_lines():
    source = '''class A:
    """Doc
    string."""

    # a comment
    x = 1

    def f(self):
        """Doc."""
        return 2
'''
    tree = ast.parse(source)
    assert code_lines(source.splitlines(), tree.body[0]) == 4  # class A:, x = 1, def f, return 2


if __name__ == "__main__":
    for name, n in sorted(class_sizes().items(), key=lambda kv: -kv[1]):
        if n > 80:
            print(f"{n:5d}  {name}{'  (known)' if name in KNOWN else ''}")
    sys.exit(0)
