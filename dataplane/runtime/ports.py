"""Ports of the runtime: what the node agent and the request path need from the thing that runs replicas.

`ReplicaRuntime` is the node agent's view (make, load, cache, kill, find the replica processes of
its node); `ReplicaCaller` is the request path's (call a replica's `run_batch`, and the two checks
the NATS replica link falls back on). `ray_adapter.py` implements both on Ray; tests implement
`ReplicaRuntime` in memory (tests/agent_sim.py). Handles are opaque: whatever `create` / `get`
returned, handed back to the same runtime.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from typing import Any, Protocol

import msgspec

from dataplane.replica.journal import Line
from dataplane.replica.wire import Answer

ReplicaHandle = Any  # opaque to callers: a Ray actor handle, a fake's object


class ReplicaSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a new replica process is made from: its model's registration in the log, and where it runs."""

    model_key: str
    replica_id: int
    checkpoint: str
    revision: str | None = None
    dtype: str = "float32"
    size_bytes: int = 0
    node_id: str = ""
    execution_timeout_s: float = 60.0


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"  # the process is gone: the replica failed
    BUSY = "busy"  # no answer in time; busy is not dead


class Found(msgspec.Struct, frozen=True, kw_only=True):
    """A live replica process, by its contract name."""

    model_key: str
    replica_id: int
    name: str


class ReplicaRuntime(Protocol):
    """Runs the replica processes of one node. Every method is safe to call from the event loop
    (blocking work goes to a thread) and raises what the replica raised, as is."""

    @property
    def location(self) -> str:
        """Where this runtime makes its replicas (Ray: the node id); replicas elsewhere are not this node's."""
        ...

    async def create(self, spec: ReplicaSpec) -> ReplicaHandle:
        """A new replica process holding nothing; it may still be starting when this returns."""
        ...

    async def started(self, handle: ReplicaHandle, timeout_s: float) -> bool:
        """Wait until the process runs; False when it was not started within `timeout_s`."""
        ...

    async def get(self, model_key: str, replica_id: int) -> ReplicaHandle | None:
        """The live process of a replica (made by any agent, before a restart too), or None."""
        ...

    async def info(self, handle: ReplicaHandle) -> dict[str, Any]:
        """The replica's own account: at least `level` (HOT/WARM/COLD) and `location`."""
        ...

    async def load(self, handle: ReplicaHandle, devices: list[int], bytes_per_gpu: int) -> None:
        """COLD -> HOT on these devices (each card's share is `bytes_per_gpu`)."""
        ...

    async def to_cache(self, handle: ReplicaHandle) -> int:
        """HOT -> WARM; the CPU bytes now held."""
        ...

    async def from_cache(self, handle: ReplicaHandle, devices: list[int], bytes_per_gpu: int) -> None:
        """WARM -> HOT."""
        ...

    async def unload(self, handle: ReplicaHandle) -> None:
        """Drop the weights (the process stays)."""
        ...

    async def kill(self, handle: ReplicaHandle) -> None:
        """End the process (best effort, never raises); its name is free once `get` returns None."""
        ...

    async def ping(self, handle: ReplicaHandle, timeout_s: float) -> tuple[Liveness, str]:
        """Is the process alive; with DEAD, why (one line)."""
        ...

    async def recent_lines(self, handle: ReplicaHandle, n: int, timeout_s: float) -> list[Line]:
        """The replica process's own newest `n` lines, oldest first (dataplane/replica/journal.py);
        TimeoutError when it does not answer within `timeout_s`."""
        ...

    async def list(self) -> list[Found]:
        """Every live replica process by contract name (all nodes: `info` tells where each runs)."""
        ...


class ReplicaCaller(Protocol):
    """The request path's calls into a replica process, and the fallback of the NATS replica link
    (dataplane/serving/link.py): answers too big for NATS, and whether calls are still known."""

    def lookup(self, model_key: str, replica_id: int) -> ReplicaHandle | None:
        """The replica's live process, or None."""
        ...

    def run_batch(self, handle: ReplicaHandle, payloads: list[dict[str, Any]],
                  users: list[str]) -> Awaitable[list[Answer]]:
        """Start `run_batch` through the runtime itself (not the NATS endpoint); `users[i]` is whose
        `payloads[i]` is (the replica's turns go by it)."""
        ...

    def take_answer(self, handle: ReplicaHandle, reply: str) -> Awaitable[list[Answer] | None]:
        """An endpoint call's answer the replica parked (too big for one NATS message)."""
        ...

    def calls_active(self, handle: ReplicaHandle, replies: list[str]) -> Awaitable[list[bool]]:
        """Which of these endpoint calls the replica still works on."""
        ...

    def gone(self, exc: BaseException) -> bool:
        """Did a call fail because the replica's process is gone (not because of the request)?"""
        ...
