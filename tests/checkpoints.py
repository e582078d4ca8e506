"""The tests' tiny checkpoints (dataplane/node/tiny_models.py), built once per test run and copied to
where a test wants one: a copy is a few milliseconds, a build imports torch and transformers first.

The checkpoints are seeded, so a copy is byte for byte what a build at that path would make. The
build is shared by pytest-xdist's workers through a lock in the run's base temp directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest


class TinyModels:
    """Copies of the run's tiny checkpoints: `tiny_models.gpt2(dest)` is a GPT-2 at `dest`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _built(self, kind: str) -> Path:
        src = self.root / kind
        if _is_checkpoint(src):
            return src
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it
            if not _is_checkpoint(src):
                from dataplane.node.tiny_models import make_tiny_gpt2, make_tiny_llama

                tmp = self.root / f".{kind}.partial"
                shutil.rmtree(tmp, ignore_errors=True)
                {"gpt2": make_tiny_gpt2, "llama": make_tiny_llama}[kind](tmp)
                tmp.rename(src)  # whole or absent: a reader never sees half a checkpoint
        return src

    def copy(self, kind: str, dest: Path | str) -> Path:
        dest = Path(dest)
        if not _is_checkpoint(dest):  # as make_tiny_*: kept when already there
            shutil.copytree(self._built(kind), dest, dirs_exist_ok=True)
        return dest

    def gpt2(self, dest: Path | str) -> Path:
        return self.copy("gpt2", dest)

    def llama(self, dest: Path | str) -> Path:
        return self.copy("llama", dest)


def _is_checkpoint(path: Path) -> bool:
    """What dataplane/node/tiny_models.py takes for a checkpoint already made: a config and weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's directory every worker sees: under xdist, the parent of the worker's base temp."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny-checkpoints"
