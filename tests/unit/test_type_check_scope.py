"""What CI's lint and type-check step covers: mypy is strict and its files name every package with
code (CI runs `ruff check . && mypy` as a step of its own, before the suite: .ci/run, README)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_covers_every_package_strictly():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert cfg.get("strict") is True
    code_dirs = {p.name for p in ROOT.iterdir()
                 if p.is_dir() and p.name not in ("tests", "docs") and not p.name.startswith(".")
                 and any(p.rglob("*.py"))}
    assert code_dirs and code_dirs <= set(cfg["files"]), f"not type-checked: {sorted(code_dirs - set(cfg['files']))}"
