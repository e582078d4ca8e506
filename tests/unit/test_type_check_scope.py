"""Ruff on the whole tree and strict mypy on every package with code, as part of the suite."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean():
    if shutil.which("ruff") is None and run("ruff", "--version").returncode != 0:
        pytest.fail("ruff is a dev dependency: pip install -e '.[dev]'")
    res = run("ruff", "check", "schemas", "controlplane", "dataplane", "tools", "tests")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_covers_every_package_strictly():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert cfg.get("strict") is True
    code_dirs = {p.name for p in ROOT.iterdir()
                 if p.is_dir() and p.name not in ("tests", "docs") and not p.name.startswith(".")
                 and any(p.rglob("*.py"))}
    assert code_dirs and code_dirs <= set(cfg["files"]), f"not type-checked: {sorted(code_dirs - set(cfg['files']))}"


def test_mypy_strict_clean():
    res = run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr
