"""The package map matches the tree (issue 43): docs/concepts.md's "Packages on one screen" lists
every package under qstrat/ with exactly its modules, and every package opens with a map (its
docstring) naming each of its modules and subpackages."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QSTRAT = ROOT / "qstrat"


def packages() -> dict[str, Path]:
    """``qstrat/x/y/`` -> folder, for every package under qstrat/ (not the serializers/strategies links)."""
    out = {"qstrat/": QSTRAT}
    for init in sorted(QSTRAT.rglob("__init__.py")):
        rel = init.parent.relative_to(QSTRAT)
        if init.parent == QSTRAT or "__pycache__" in rel.parts or (QSTRAT / rel.parts[0]).is_symlink():
            continue
        out[f"qstrat/{rel.as_posix()}/"] = init.parent
    return out


def members(folder: Path) -> set[str]:
    mods = {p.stem for p in folder.glob("*.py")}
    subs = {p.name + "/" for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and (p / "__init__.py").exists()}
    return (mods - {"__init__"} if folder != QSTRAT else mods) | (subs if folder != QSTRAT else set())


def concepts_rows() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "concepts.md").read_text()
    block = text[text.index("<!-- package-map"):text.index("<!-- /package-map -->")]
    rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`qstrat/"):
            rows[cells[0].strip("`")] = set(re.findall(r"`([\w]+/?)`", cells[2]))
    return rows


def test_the_concepts_map_lists_every_package_with_its_modules():
    rows, tree = concepts_rows(), packages()
    assert set(rows) == set(tree), (f"packages on disk, not in docs/concepts.md: {sorted(set(tree) - set(rows))}; "
                                    f"listed, not on disk: {sorted(set(rows) - set(tree))}")
    wrong = {p: (sorted(rows[p]), sorted(members(d))) for p, d in tree.items() if rows[p] != members(d)}
    assert not wrong, f"map row != folder (listed, on disk): {wrong}"


def test_every_package_opens_with_a_map_of_its_modules():
    missing = {}
    for p, folder in packages().items():
        if folder == QSTRAT:
            continue
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        dotted = "qstrat." + p[len("qstrat/"):].strip("/").replace("/", ".")
        absent = [m for m in members(folder)
                  if not re.search(rf"(?<![\w])(\.|{re.escape(dotted)}\.){re.escape(m.rstrip('/'))}(?!\w)", doc)]
        if absent:
            missing[p] = absent
    assert not missing, f"package docstrings that do not name these modules: {missing}"


def test_the_where_things_go_paths_exist():
    text = (ROOT / "docs" / "concepts.md").read_text()
    section = text[text.index("## Packages on one screen"):]
    section = section[:section.index("\n## ", 5)] if "\n## " in section[5:] else section
    paths = [p for p in re.findall(r"`((?:qstrat|serializers|strategies)/[\w/.]*)`", section) if "<" not in p]
    assert paths and not [p for p in paths if not (ROOT / p).exists()], \
        [p for p in paths if not (ROOT / p).exists()]
