"""Helpers for control-plane integration tests: the `ndif` CLI as a subprocess, settling the cluster,
a dispatcher's queue figures published by hand."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from controlplane.core.projections import ClusterState
from controlplane.store.admin import AdminClient
from schemas.autoscale import QueueFigures
from schemas.status import ReplicaState
from schemas.subjects import figures_subject
from tests import cli_zygote
from tests.waiting import until_state

S = ReplicaState
MOVING = {S.LOAD_REQUESTED, S.LOADING, S.DRAINING, S.UNLOAD_REQUESTED, S.RESTARTING}


@dataclass
class Ran:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def lines(self) -> list[Any]:
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


async def ndif(url: str, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None,
               cwd: str | os.PathLike[str] | None = None) -> Ran:
    """Run `ndif ARGS --nats URL` in a process of its own (tests/cli_zygote.py: forked from one that
    imported the CLI once); `env` adds to the environment (e.g. the NDIF_HOME whose credentials an
    `ndif up` made). TimeoutError (the process killed) after `timeout` seconds."""
    env = {**os.environ, "NDIF_LOG_LEVEL": "WARNING", **(env or {})}
    return Ran(*await cli_zygote.run([*args, "--nats", url], env=env, cwd=cwd, timeout=timeout))




async def settle(admin: AdminClient, timeout: float = 15.0) -> ClusterState:
    """The folded state once no replica is mid-transition (agents have answered everything)."""
    return await until_state(admin, lambda s: not any(r.state in MOVING for r in s.replicas.values()), timeout)


def by_id(status: dict[str, Any], model_key: str) -> dict[int, dict[str, Any]]:
    return {r["replica_id"]: r for r in status["replicas"] if r["model_key"] == model_key}


def model_row(status: dict[str, Any], model_key: str) -> dict[str, Any]:
    return next(m for m in status["models"] if m["model_key"] == model_key)


def config_only(root: Path, name: str, tiny: Path) -> str:
    """A checkpoint dir with only a config (sizes come from --size-gib): a model key for placement tests."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_bytes((tiny / "config.json").read_bytes())
    return str(d)


class Publisher:
    """A dispatcher's figures: `load` (queued, running) published every 0.2 s until stopped."""

    def __init__(self, admin: AdminClient, model_key: str) -> None:
        self.admin, self.model_key = admin, model_key
        self.load = (0, 0)
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            q, r = self.load
            f = QueueFigures(model_key=self.model_key, queued=q, running=r, dispatcher="dispatcher:test")
            await self.admin.log.nc.publish(figures_subject(self.model_key), msgspec.json.encode(f))
            await asyncio.sleep(0.2)

    def __enter__(self) -> Publisher:
        self.task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()


def up_running(proc: subprocess.Popen[bytes], out: Path, err: Path, timeout: float = 180.0) -> None:
    """Wait until an `ndif up` whose output goes to `out` says it is running (fail if it exits first)."""
    deadline = time.monotonic() + timeout
    while "running" not in out.read_text():
        assert proc.poll() is None, (out.read_text(), err.read_text()[-3000:])
        assert time.monotonic() < deadline, "ndif up did not come up"
        time.sleep(0.2)
