"""pyproject.toml lists every package: setuptools installs only the packages it names, so a
package missing there imports from a checkout (editable install) and is absent from a wheel."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool["package-dir"]  # installed name -> source folder
    on_disk = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join((name, *rel.parts)))
    assert on_disk - set(tool["packages"]) == set(), "packages missing from pyproject.toml's packages list"
    assert set(tool["packages"]) - on_disk == set(), "packages listed that have no folder"
