"""Ruff on the whole tree and strict mypy on schemas/ and controlplane/, as part of the suite."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_clean():
    if shutil.which("ruff") is None and run("ruff", "--version").returncode != 0:
        pytest.fail("ruff is a dev dependency: pip install -e '.[dev]'")
    res = run("ruff", "check", "schemas", "controlplane", "dataplane", "tools", "tests")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict_on_schemas_and_controlplane():
    res = run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr
