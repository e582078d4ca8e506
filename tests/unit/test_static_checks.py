"""The checks that keep the code as issue 14 left it: mypy strict over every package, ruff clean."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mypy_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_mypy_covers_every_package_strictly():
    cfg = _mypy_config()
    assert cfg.get("strict") is True
    code_dirs = {p.name for p in ROOT.iterdir()
                 if p.is_dir() and p.name not in ("tests", "docs") and not p.name.startswith(".")
                 and any(p.rglob("*.py"))}
    assert code_dirs and code_dirs <= set(cfg["files"]), f"not type-checked: {sorted(code_dirs - set(cfg['files']))}"


def test_mypy_strict_is_clean():
    pytest.importorskip("mypy", reason="mypy is a dev dependency: pip install -e '.[dev]'")
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_ruff_is_clean():
    pytest.importorskip("ruff", reason="ruff is a dev dependency: pip install -e '.[dev]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
