"""Helpers for control-plane integration tests: the `ndif` CLI as a subprocess, settling the cluster."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.store.admin import AdminClient
from schemas.status import ReplicaState
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
