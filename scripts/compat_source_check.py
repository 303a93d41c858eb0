"""Check qstrat's vLLM version table against a vLLM release's SOURCE, without importing it.

    python scripts/compat_source_check.py VERSION SOURCE [--json OUT]

SOURCE is the release's wheel (read in place, nothing extracted) or a directory holding its
``vllm/`` package (a site-packages). For every table entry (qstrat/vllm/adapter/names.py) the
location the table gives for VERSION is looked up in the parsed source: a module file, then each
attribute as a top-level def / class / assignment / import (followed into the module it re-exports
from), a class member (method, class attribute, enum member), an attribute a class or function sets
on an object (``self.x = ...``, ``layer.x = ...``, ``layer.register_buffer("x", ...)``,
``setattr(layer, "x", ...)``: an ``attribute`` entry, :func:`sets_attribute`) or a name in the
module's lazy-import list. An entry the table records as absent for VERSION must NOT be found at the
location it has in any other version. Exit status 0 when every entry agrees, 1 otherwise (each
disagreement printed). scripts/compat_matrix.sh runs it on the releases that cannot run here
(docs/compat.md).
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from qstrat.vllm.adapter import names


class Source:
    """A vLLM source tree, parsed on demand (module -> (file, AST))."""

    def __init__(self, site: Path) -> None:
        self.site = zipfile.Path(site) if site.suffix == ".whl" else site
        self._trees: dict[str, tuple[Any, ast.Module] | None] = {}

    def file(self, module: str) -> Any:
        base = self.site.joinpath(*module.split("."))
        for candidate in (base.parent / f"{base.name}.py", base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> tuple[Any, ast.Module] | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = None if path is None else (path, ast.parse(path.read_text()))
        return self._trees[module]

    def find(self, module: str, attrs: list[str], depth: int = 0) -> str | None:
        """Where ``module.attrs`` is defined (``"module:attr"``), or None."""
        parsed = self.tree(module)
        if parsed is None:
            return None
        path, tree = parsed
        if not attrs:
            return module
        name, rest = attrs[0], attrs[1:]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                if not rest:
                    return f"{module}:{name}"
                return f"{module}:{name}.{rest[0]}" if len(rest) == 1 and (
                    isinstance(node, ast.ClassDef) and declares(node, rest[0]) or sets_attribute(node, rest[0])) else None
            if not rest and _assigns(node, name):
                return f"{module}:{name}"
        for node in ast.walk(tree):  # re-exports, also inside try/if
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and depth < 6:
                        base = _absolute(module, path, node)
                        if not rest and self.file(f"{base}.{alias.name}"):
                            return f"{base}.{alias.name}"
                        return self.find(base, [alias.name, *rest], depth + 1)
        if not rest and self.file(f"{module}.{name}"):
            return f"{module}.{name}"
        if not rest and re.search(r"[\"']%s[\"']" % re.escape(name), path.read_text()):
            return f"{module}:{name} (lazy import)"
        return None


def declares(node: ast.ClassDef, member: str) -> bool:
    """Whether class ``node`` declares ``member`` itself: a method or property, a class attribute,
    an annotated field (a dataclass / pydantic field, ``x: T`` with or without a default)."""
    return _class_has(node, member) or any(isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name)
                                           and sub.target.id == member for sub in node.body)


def _class_has(node: ast.ClassDef, member: str) -> bool:
    for sub in node.body:
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == member:
            return True
        if _assigns(sub, member):
            return True
    return False


#: Calls that set an attribute named by a string argument: function name -> that argument's index.
_SETTERS = {"register_buffer": 0, "register_parameter": 0, "register_module": 0, "add_module": 0, "setattr": 1}


def sets_attribute(node: ast.AST, attr: str) -> bool:
    """Whether code inside ``node`` sets ``<object>.attr``: an assignment (``self.attr = ...``,
    ``layer.attr: T = ...``, ``layer.attr += ...``) or a call naming it (``layer.register_buffer("attr",
    ...)``, ``register_parameter`` / ``register_module`` / ``add_module``, ``setattr(layer, "attr", ...)``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            fn = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", None)
            i = _SETTERS.get(fn)
            if i is not None and len(sub.args) > i and isinstance(sub.args[i], ast.Constant) \
                    and sub.args[i].value == attr:
                return True
            continue
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
            return True
    return False


def _assigns(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name


def _absolute(module: str, path: Any, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def check(version: str, site: Path) -> list[dict[str, object]]:
    """One row per table entry: key, expected location (None: absent), found, ok."""
    source = Source(site)
    rows = []
    for key, entry in names.TABLE.items():
        placed = [where for spec, where in entry.locations.items()
                  if SpecifierSet(spec).contains(Version(version), prereleases=True)]
        if not placed:
            rows.append({"key": key, "expected": "table does not cover this version", "found": None, "ok": False})
            continue
        where = placed[0]
        if where is None:  # recorded absent: not at any place another version has it
            others = {w for w in entry.locations.values() if w}
            found = [f for f in (source.find(*_split(w)) for w in others) if f]
            rows.append({"key": key, "expected": None, "found": found[0] if found else None, "ok": not found})
        else:
            found = source.find(*_split(where))
            rows.append({"key": key, "expected": where, "found": found, "ok": found is not None})
    return rows


def _split(where: str) -> tuple[str, list[str]]:
    module, _, attrs = where.partition(":")
    return module, attrs.split(".") if attrs else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("version")
    p.add_argument("site", type=Path, help="the release's wheel, or a directory holding its vllm/ package")
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if Source(args.site).file("vllm") is None:
        p.error(f"{args.site} holds no vllm/__init__.py")
    rows = check(args.version, args.site)
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"vllm {args.version}: {r['key']}: table says {r['expected'] or 'absent'}, source has "
              f"{r['found'] or 'nothing there'}", file=sys.stderr)
    print(f"vllm {args.version}: {len(rows) - len(bad)}/{len(rows)} table entries agree with the source")
    if args.json:
        args.json.write_text(json.dumps({"version": args.version, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
