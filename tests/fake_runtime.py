"""An in-memory `ReplicaRuntime` (dataplane/runtime/ports.py): replica "processes" that are plain objects.

The real `NodeAgent` runs over it in tests without Ray or torch (tests/agent_sim.py). A process
takes `start_delay_s` to start (so a fresh load takes that long; a restart or a load from the CPU
cache does not), `fail_loads(model_key)` makes its loads fail, `crash()` kills one behind the
agent's back (what a dead actor looks like to `ping`). `loads` records every `load` and
`from_cache` it was asked for, with the devices and per-card bytes it was given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from dataplane.replica.journal import Journal, Line
from dataplane.replica.model import LoadError
from dataplane.replica.wire import Answer, Completed, NotRun
from dataplane.runtime.ports import Found, Liveness, ReplicaSpec

RKey = tuple[str, int]


class LoadCall(msgspec.Struct, frozen=True, kw_only=True):
    """One `load` or `from_cache` as the runtime was asked for it."""

    key: RKey
    how: str  # "load" | "from_cache"
    devices: tuple[int, ...]
    bytes_per_gpu: int


class FakeProcess:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.level = "COLD"
        self.devices: list[int] = []
        self.dead: str | None = None  # why it died
        self.said = Journal()  # what the process wrote (the runtime's `recent_lines`)
        self.silent = False  # True: it does not answer `recent_lines` (a replica busy or stuck)


class FakeRuntime:
    """`ReplicaRuntime` in memory; one per node (its `location`)."""

    def __init__(self, location: str, *, start_delay_s: float = 0.0,
                 fail_loads: Callable[[str], bool] = lambda mk: False) -> None:
        self._location = location
        self.start_delay_s = start_delay_s
        self.fail_loads = fail_loads
        self.processes: dict[RKey, FakeProcess] = {}
        self.created = 0
        self.loads: list[LoadCall] = []

    @property
    def location(self) -> str:
        return self._location

    async def create(self, spec: ReplicaSpec) -> FakeProcess:
        key = (spec.model_key, spec.replica_id)
        if key in self.processes:  # as Ray: one live actor per name
            raise ValueError(f"a process named {key} already exists")
        proc = self.processes[key] = FakeProcess(spec)
        self.created += 1
        return proc

    async def started(self, handle: FakeProcess, timeout_s: float) -> bool:
        if self.start_delay_s:
            await asyncio.sleep(min(self.start_delay_s, timeout_s))
        return self.start_delay_s <= timeout_s

    async def get(self, model_key: str, replica_id: int) -> FakeProcess | None:
        return self.processes.get((model_key, replica_id))

    async def info(self, handle: FakeProcess) -> dict[str, Any]:
        self._alive(handle)
        return {"model_key": handle.spec.model_key, "replica_id": handle.spec.replica_id, "level": handle.level,
                "location": self._location}

    async def load(self, handle: FakeProcess, devices: list[int], bytes_per_gpu: int) -> None:
        self._alive(handle)
        self._record(handle, "load", devices, bytes_per_gpu)
        if self.fail_loads(handle.spec.model_key):
            raise LoadError("sim: config.json is corrupt")
        handle.level, handle.devices = "HOT", list(devices)
        handle.said.add(f"sim: loaded onto cards {list(devices)}")

    async def to_cache(self, handle: FakeProcess) -> int:
        self._alive(handle)
        handle.level, handle.devices = "WARM", []
        return handle.spec.size_bytes

    async def from_cache(self, handle: FakeProcess, devices: list[int], bytes_per_gpu: int) -> None:
        self._alive(handle)
        self._record(handle, "from_cache", devices, bytes_per_gpu)
        handle.level, handle.devices = "HOT", list(devices)

    async def unload(self, handle: FakeProcess) -> None:
        self._alive(handle)
        handle.level, handle.devices = "COLD", []

    async def kill(self, handle: FakeProcess) -> None:
        key = (handle.spec.model_key, handle.spec.replica_id)
        if self.processes.get(key) is handle:
            del self.processes[key]
        handle.dead = handle.dead or "killed"

    async def ping(self, handle: FakeProcess, timeout_s: float) -> tuple[Liveness, str]:
        return (Liveness.DEAD, f"actor died: {handle.dead}") if handle.dead else (Liveness.ALIVE, "")

    async def recent_lines(self, handle: FakeProcess, n: int, timeout_s: float) -> list[Line]:
        """The process's own newest `n` lines; a silent one is waited for `timeout_s`, as Ray's."""
        self._alive(handle)
        if handle.silent:
            await asyncio.sleep(timeout_s)
            raise TimeoutError(f"the replica did not answer within {timeout_s:g} s")
        return handle.said.recent(n)

    async def list(self) -> list[Found]:
        return [Found(model_key=mk, replica_id=rid, name=f"ModelActor:{mk}:{rid}") for mk, rid in self.processes]

    def crash(self, model_key: str, replica_id: int, error: str) -> None:
        """The process dies behind the agent's back (its name is free, its handle answers DEAD)."""
        proc = self.processes.pop((model_key, replica_id), None)
        if proc is not None:
            proc.dead = error

    def _record(self, handle: FakeProcess, how: str, devices: list[int], bytes_per_gpu: int) -> None:
        key = (handle.spec.model_key, handle.spec.replica_id)
        self.loads.append(LoadCall(key=key, how=how, devices=tuple(devices), bytes_per_gpu=bytes_per_gpu))

    def _alive(self, handle: FakeProcess) -> None:
        if handle.dead:
            raise RuntimeError(f"the replica's process died: {handle.dead}")


class FakeCaller:
    """`ReplicaCaller` (dataplane/runtime/ports.py) over FakeRuntimes: the dispatcher's request path
    without Ray. A call to a HOT process answers each request after `run_s` (the result echoes the
    payload); a process that is not HOT answers NotRun, as a replica that left does."""

    def __init__(self, runtimes: list[FakeRuntime], *, run_s: float = 0.01) -> None:
        self.runtimes = runtimes
        self.run_s = run_s
        self.calls = 0

    def lookup(self, model_key: str, replica_id: int) -> FakeProcess | None:
        for rt in self.runtimes:
            p = rt.processes.get((model_key, replica_id))
            if p is not None and p.dead is None and p.level == "HOT":
                return p
        return None

    async def run_batch(self, handle: FakeProcess, payloads: list[dict[str, Any]], users: list[str]) -> list[Answer]:
        self.calls += 1
        await asyncio.sleep(self.run_s)
        if handle.dead is not None or handle.level != "HOT":
            return [NotRun(reason=f"replica is {handle.level}") for _ in payloads]
        return [Completed(result={"echo": p}, seconds=self.run_s) for p in payloads]

    async def take_answer(self, handle: FakeProcess, reply: str) -> list[Answer] | None:
        return None

    async def calls_active(self, handle: FakeProcess, replies: list[str]) -> list[bool]:
        return [False for _ in replies]

    def gone(self, exc: BaseException) -> bool:
        return False
