"""The deploy scripts' `--help`: their opening comment, whole, and nothing of their code."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["head.sh", "worker.sh"])
def test_help_is_the_scripts_opening_comment_and_no_code(name: str) -> None:
    path = ROOT / "deploy" / name
    ran = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    out = ran.stdout.splitlines()
    comment = [ln for ln in path.read_text().splitlines()[1:]]
    comment = comment[:next(i for i, ln in enumerate(comment) if not ln.startswith("#"))]
    assert len(out) == len(comment) and out[-1] == comment[-1].removeprefix("# "), out[-3:]
    assert not any(ln.startswith(("set -", "SCRIPT=", "source ")) for ln in out), out[-3:]
    assert f"deploy/{name} start" in ran.stdout and f"deploy/{name} stop" in ran.stdout
    bare = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and bare.stdout == ran.stdout  # no command: the same help, and exit 2
