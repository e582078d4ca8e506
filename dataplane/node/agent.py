"""The node agent: one per Ray node; makes the replicas on its node match the log (docs/architecture.md §1, §4).

It appends `NodeJoined` (its GPUs and CPU cache memory), keeps a KV heartbeat, folds the event
stream with the same reducer as every component, and reconciles, level-triggered (acting on the
folded state, not on single events, so a restart simply re-folds and finishes what was pending):

    LoadRequested / Loading -> create the actor (or `from_cache` a WARM one), `ReplicaLoading`,
                               `ReplicaLoaded` with load seconds, or `ReplicaLoadFailed` with the error
    Draining                -> no dispatcher serves the replica (`ReplicaServed`): `ReplicaDrained`
                               (unserved) at once; else wait for the dispatchers' `ReplicaDrained`,
                               and after `drain_timeout_s` append it itself (timeout)
    UnloadRequested         -> `to_cache` + `ReplicaCached` (desired WARM) or kill + `ReplicaUnloaded`
    Restarting              -> kill, re-create with the same id and cards, load, `ReplicaRestarted`
    an actor that died      -> `ReplicaFailed` (the controller's policy restarts or replaces it)

What to do is decided by a pure function over the fold (`plan_actions`, controlplane/core/nodeplan.py);
this module only runs its actions, through the node's `ReplicaRuntime` (dataplane/runtime/ports.py;
Ray's is dataplane/runtime/ray_adapter.py, tests use an in-memory one). The agent is given its
parts (the event log, where its heartbeats go, the runtime); `NodeAgent.open(url)` makes them for
`ndif agent` and `ndif up`.
A load onto cards that a leaving replica still occupies waits until that replica is off them.
On start it adopts the live detached actors of its node (contract names) and reconciles them with
the fold: an actor the log does not want is killed; a HOT replica whose actor is gone is reported
failed; a WARM one whose actor is gone is reported unloaded. No orphan, no duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Coroutine
from typing import Any

import structlog

from controlplane.core.nodeplan import Action, Do, Mark, current_marks, plan_actions, plan_adoption
from controlplane.core.ports import EventLog, Heartbeats, Stored
from controlplane.core.projections import ClusterState
from controlplane.core.projections.replica import ReplicaView
from controlplane.service.clock import observed, utcnow
from controlplane.service.follow import catch_up, follow_log
from controlplane.service.tasks import cancel_and_wait
from controlplane.store.credentials import Creds, resolve
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.heartbeats import STALE_S, JetStreamHeartbeats
from dataplane.replica.actor import NAMESPACE, replica_resources
from dataplane.replica.journal import Journal, Line, merge, stamp
from dataplane.runtime.ports import Liveness, ReplicaHandle, ReplicaRuntime, ReplicaSpec
from schemas import logs as L
from schemas.errors import InfrastructureError, InvalidCommand
from schemas.events import (
    Event,
    GpuInfo,
    NodeJoined,
    ReplicaCached,
    ReplicaDrained,
    ReplicaFailed,
    ReplicaLoaded,
    ReplicaLoadFailed,
    ReplicaLoading,
    ReplicaRestarted,
    ReplicaUnloaded,
)
from schemas.refusals import FactRefused
from schemas.status import DrainReason, Level, ReplicaState
from schemas.subjects import model_token, node_logs_subjects

logger = structlog.get_logger("ndif.agent")
SCHEDULE_TIMEOUT_S = 60.0  # a replica actor Ray has not started by then is a failed load
LOGS_TIMEOUT_S = 3.0  # how long `ndif logs` waits for a replica's own lines (the CLI waits up to 10 s)


class ReplicaNotScheduled(InfrastructureError):
    """Ray left the replica's actor pending: the node has no CPU or memory left for its request."""


class NodeIdHeld(InfrastructureError):
    """Another agent with this node id is alive (its heartbeat is fresh)."""


S = ReplicaState
RKey = tuple[str, int]


def detect_gpus() -> tuple[GpuInfo, ...]:
    """The node's real CUDA devices (none on a CPU-only machine)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(GpuInfo(index=i, memory_bytes=int(torch.cuda.get_device_properties(i).total_memory),
                         name=torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count()))


def declared_gpus(count: int, memory_bytes: int, name: str = "declared") -> tuple[GpuInfo, ...]:
    """An inventory from configuration (CPU machines and tests; Ray started with matching num_gpus)."""
    return tuple(GpuInfo(index=i, memory_bytes=memory_bytes, name=name) for i in range(count))


def default_cpu_cache_bytes() -> int:
    """Half of the machine's memory for WARM replicas."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError):
        return 16 * 2**30


class NodeAgent:
    """One node's agent over its parts: `log` (the event log), `heartbeats` (where it says it is
    alive) and `runtime` (where its replicas run). `owns_log`: `stop()` closes the log."""

    def __init__(self, log: EventLog, heartbeats: Heartbeats, runtime: ReplicaRuntime, node_id: str | None = None, *,
                 gpus: tuple[GpuInfo, ...] | None = None, cpu_cache_bytes: int | None = None,
                 heartbeat_s: float = 2.0, drain_timeout_s: float = 30.0, health_interval_s: float = 1.0,
                 execution_timeout_s: float = 60.0, hostname: str | None = None, owns_log: bool = False,
                 nc: Any = None) -> None:
        """`nc`: a NATS connection on which the agent answers `ndif logs` for its node's replicas
        (`ndif.logs.<ntok>.>`); None: it keeps the lines but answers no one."""
        self.log = log
        self.nc = nc
        # replica -> its recent lines on this node (what the agent saw of it, and what its process
        # said), the newest L.MAX_LINES kept; dropped when the fold forgets the replica
        self.lines: dict[RKey, Journal] = {}
        self._logs_sub: Any = None
        self.heartbeats = heartbeats
        self.runtime = runtime
        self.owns_log = owns_log
        self.node_id = node_id or socket.gethostname()
        self.hostname = hostname or socket.gethostname()
        self.gpus = gpus
        self.cpu_cache_bytes = default_cpu_cache_bytes() if cpu_cache_bytes is None else cpu_cache_bytes
        self.heartbeat_s = heartbeat_s
        self.drain_timeout_s = drain_timeout_s
        self.health_interval_s = health_interval_s
        self.execution_timeout_s = execution_timeout_s
        self.schedule_timeout_s = float(os.environ.get("NDIF_REPLICA_SCHEDULE_TIMEOUT_S", SCHEDULE_TIMEOUT_S))
        self.actor = f"agent:{self.node_id}"  # the author of this agent's events
        self.state = ClusterState()
        self.location = runtime.location  # Ray: the node id its replicas are pinned to
        self.actors: dict[RKey, ReplicaHandle] = {}  # replica -> its live process on this node
        self._busy: dict[RKey, asyncio.Task[None]] = {}  # one action per replica at a time
        self._drain_timers: dict[RKey, asyncio.Task[None]] = {}  # not actions: the drain report ends them early
        self._done: set[Mark] = set()  # actions taken, by (replica, what, state stamp); pruned to current_marks
        self._tasks: list[asyncio.Task[None]] = []
        self._kick = asyncio.Event()
        self._rejoined_after = -1  # seq of the NodeLost this agent last answered with a NodeJoined
        self.rejoins = 0
        self.logger = logger.bind(node_id=self.node_id)

    @classmethod
    async def open(cls, url: str, node_id: str | None = None, *, creds: Creds | None = None,
                   runtime: ReplicaRuntime | None = None, ray_node_id: str | None = None, pool_size: int = 0,
                   **kw: Any) -> NodeAgent:
        """An agent over NATS at `url` (not started): its event log and, by default, a Ray runtime
        whose replicas serve their NATS endpoints with this agent's credentials. Ray must be
        initialised in this process (`ndif up` and `ndif agent` do it). The replicas are pinned to
        `ray_node_id`, else to the Ray node labelled `ndif.node_id=<node_id>` (deploy/head.sh, deploy/worker.sh), else to
        the Ray node this process joined through. `pool_size`: idle replica processes the Ray
        runtime keeps ready on that node (dataplane/runtime/pool.py)."""
        node_id = node_id or socket.gethostname()
        if runtime is None:
            from dataplane.runtime import ray_adapter

            if not ray_adapter.is_initialized():
                raise InfrastructureError("Ray is not initialised in this process: ray.init(namespace='ndif') "
                                          "first (`ndif up` does it)")
        if creds is None:
            creds = resolve("agent", url=url, node_id=node_id)
        if runtime is None:
            from dataplane.runtime.ray_adapter import RayRuntime, ray_node_for

            location = ray_node_id or await asyncio.to_thread(ray_node_for, node_id)
            runtime = RayRuntime(nats_url=url, nats_creds=creds, location=location, pool_size=pool_size)
        log = await JetStreamEventLog.open(url, ensure=False, name=f"agent:{node_id}", creds=creds, role="agent",
                                           node_id=node_id)
        return cls(log, JetStreamHeartbeats(log.js, direct=True), runtime, node_id, owns_log=True, nc=log.nc, **kw)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> NodeAgent:
        if self.gpus is None:
            self.gpus = detect_gpus()
        self.state = await catch_up(self.log)  # the newest snapshot that matches the log, then the tail
        try:
            await self._refuse_if_held()  # before adopting: adoption would kill the live agent's actors
        except NodeIdHeld:
            await self._close_log()
            raise
        await self._adopt()
        start_pool = getattr(self.runtime, "start_pool", None)  # Ray's runtime keeps a process pool
        if start_pool is not None:
            await start_pool()
        await self.heartbeat_once()
        await self._append(self._joined())
        if self.nc is not None:
            self._logs_sub = await self.nc.subscribe(node_logs_subjects(self.node_id), cb=self._answer_logs)
        self._tasks += [asyncio.create_task(self._heartbeat(), name="agent-heartbeat"),
                        asyncio.create_task(self._follow(), name="agent-follow"),
                        asyncio.create_task(self._reconcile_loop(), name="agent-reconcile"),
                        asyncio.create_task(self._health(), name="agent-health")]
        self.logger.info("agent_started", ray_node_id=self.location, gpus=len(self.gpus), adopted=len(self.actors),
                         seq=self.state.seq)
        return self

    async def stop(self) -> None:
        """Stop acting; the detached actors stay (a restarted agent adopts them)."""
        started = bool(self._tasks)
        await self.halt()
        if started:
            # Goodbye: an empty heartbeat lets an agent started next under this node id take over
            # at once (a live one is refused). Best effort: a dead NATS must not hold up the stop.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.heartbeats.goodbye(self.node_id), 4)
        await self._close_log()

    async def halt(self) -> None:
        """Stop every loop and action at once, with no goodbye (what a dead node leaves behind)."""
        sub, self._logs_sub = self._logs_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await cancel_and_wait([*self._tasks, *self._busy.values(), *self._drain_timers.values()], owner=self.actor)
        stop_pool = getattr(self.runtime, "stop_pool", None)  # its members stay: a restarted agent takes them back
        if stop_pool is not None:
            await stop_pool()
        self._tasks.clear()
        self._busy.clear()
        self._drain_timers.clear()

    async def _close_log(self) -> None:
        if self.owns_log:
            close = getattr(self.log, "close", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> NodeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _refuse_if_held(self) -> None:
        """Refuse a node id whose agent is alive: its heartbeat is fresh and still beats.

        A heartbeat younger than `max(3 * heartbeat_s, STALE_S)` is watched until it is that old: a
        new beat means a live agent (refused at once); none means its agent died (taken over).
        """
        try:
            first = await self.heartbeats.last(self.node_id)
        except Exception as exc:  # noqa: BLE001 - e.g. not allowed to read the bucket: say so, go on
            self.logger.warning("node_id_check_skipped", error=str(exc) or type(exc).__name__)
            return
        if first is None or first.stopped:
            return
        window = max(3 * self.heartbeat_s, STALE_S)
        age0 = first.age_s(utcnow())
        deadline = time.monotonic() + max(0.0, window - age0)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            now = await self.heartbeats.last(self.node_id)
            if now is not None and now.seq != first.seq:
                raise NodeIdHeld(
                    f"node id {self.node_id!r} is held by a live agent (it beat {now.age_s(utcnow()):.1f}s ago): "
                    "stop that agent first, or give this one another --node-id")
        if age0 < window:
            self.logger.warning("node_id_taken_over", heartbeat_age_s=round(age0, 1), waited_s=round(window - age0, 1))

    # ---- adoption ----------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Take over the live actors of this node: keep the ones the log wants, kill the others."""
        here: dict[RKey, tuple[ReplicaHandle, dict[str, Any]]] = {}
        for found in await self.runtime.list():
            handle = await self.runtime.get(found.model_key, found.replica_id)
            if handle is None:
                continue
            try:
                info = await asyncio.wait_for(self.runtime.info(handle), 30)
            except Exception as exc:  # noqa: BLE001 - dead or wedged: not ours to keep
                self.logger.warning("adopt_unreachable", actor=found.name, error=str(exc))
                continue
            if info.get("location") != self.location:
                continue  # another node's agent owns it
            here[(found.model_key, found.replica_id)] = (handle, info)
        keep, kill = plan_adoption(self.state, self.node_id, here)
        for key in kill:
            r = self.state.replicas.get(key)
            self.logger.warning("orphan_killed", model_key=key[0], replica_id=key[1], state=str(r.state) if r else None)
            self.actors.pop(key, None)
            await self.runtime.kill(here[key][0])
        for key in keep:
            self.actors[key] = here[key][0]
            self.logger.info("actor_adopted", model_key=key[0], replica_id=key[1], level=here[key][1].get("level"))

    # ---- the loops ---------------------------------------------------------------------------

    async def heartbeat_once(self) -> None:
        report = getattr(self.runtime, "pool_report", None)  # a runtime with a process pool (Ray's)
        pool = report() if report is not None else None
        await self.heartbeats.beat(self.node_id, pool if pool is not None and pool[1] else None)

    def _joined(self) -> NodeJoined:
        assert self.gpus is not None
        return observed(NodeJoined, actor=self.actor, node_id=self.node_id, gpus=self.gpus,
                        cpu_cache_bytes=self.cpu_cache_bytes, hostname=self.hostname, ray_node_id=self.location)

    def _check_lost(self) -> None:
        """Declared lost while we run (a pause past the heartbeat grace, a network blip): rejoin.

        The log says NodeLost, this agent is alive and heartbeating: it announces itself again
        (`NodeJoined`, once per NodeLost), and the controller places the replicas it still wants."""
        node = self.state.nodes.get(self.node_id)
        if node is None or node.alive or node.since_seq <= self._rejoined_after:
            return
        self._rejoined_after = node.since_seq
        self._tasks.append(asyncio.create_task(self._rejoin(node.since_seq), name="agent-rejoin"))

    async def _rejoin(self, lost_seq: int) -> None:
        self.logger.warning("node_declared_lost_rejoining", lost_seq=lost_seq)
        with contextlib.suppress(Exception):
            await self.heartbeat_once()
        await self._append(self._joined())
        self.rejoins += 1

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.heartbeat_once()
            except Exception as exc:  # noqa: BLE001 - NATS away: keep trying, the controller will judge
                self.logger.warning("heartbeat_failed", error=str(exc) or type(exc).__name__)

    async def _follow(self) -> None:
        self._kick.set()
        await follow_log(self.log, lambda: self.state.seq + 1, self._on_batch, logger=self.logger,
                         fold=lambda: self.state, refold=self._refold)

    async def _refold(self, state: ClusterState) -> None:
        """The log went back: act on what it holds now. A replica running here that the log no longer
        knows (or wants here) is killed, with a warning, as on a start (`_adopt`); a node the log no
        longer holds joins again."""
        self.state.become(state)
        self._done.clear()  # its marks name positions (since_seq) of the log as it was
        self.logger.warning("agent_refolded", seq=state.seq)
        await self._adopt()
        if self.node_id not in self.state.nodes or not self.state.nodes[self.node_id].alive:
            await self._append(self._joined())  # the log lost this node's join: announce it again
        self._kick.set()

    def _on_batch(self, batch: list[Stored]) -> None:
        for seq, item in batch:
            self.state.apply(seq, item)
        self._kick.set()
        self._check_lost()

    async def _reconcile_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                self.reconcile()
            except Exception:
                self.logger.exception("reconcile_failed")

    async def _health(self) -> None:
        """An actor that died while serving is a `ReplicaFailed` (Ray does not restart it: max_restarts=0)."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for key, r in list(self.state.replicas.items()):
                if r.node_id != self.node_id or r.state not in (S.AVAILABLE, S.DRAINING) or key in self._busy:
                    continue
                handle = self.actors.get(key)
                error = None
                if handle is None:
                    error = "actor not found on this node"
                else:
                    alive, why = await self.runtime.ping(handle, 10)
                    if alive is Liveness.BUSY:
                        continue  # busy is not dead
                    if alive is Liveness.DEAD:
                        error = why
                if error is not None and (key, "failed", r.since_seq) not in self._done:
                    self._done.add((key, "failed", r.since_seq))
                    self.actors.pop(key, None)
                    self.logger.warning("replica_failed", model_key=key[0], replica_id=key[1], error=error)
                    await self._append(observed(ReplicaFailed, actor=self.actor, model_key=key[0], replica_id=key[1],
                                                node_id=self.node_id, error=error))

    # ---- reconcile: the plan (controlplane/core/nodeplan.py), run -----------------------------------

    def reconcile(self) -> None:
        """Start what the folded state asks of this node (each replica one action at a time)."""
        for key, timer in list(self._drain_timers.items()):
            now = self.state.replicas.get(key)
            if timer.done() or now is None or now.state is not S.DRAINING:
                timer.cancel()  # drained (or moved on): the unload must not wait for the timeout
                del self._drain_timers[key]
        self._done = current_marks(self.state, self.node_id, self._done)  # bounded by this node's replicas
        self._forget_lines()
        for action in plan_actions(self.state, self.node_id, self.actors.keys(), self._busy.keys(), self._done):
            if action.do is Do.DRAIN_TIMER:
                self._done.add(action.mark)
                self._drain_timers[action.key] = asyncio.create_task(self._drain_timer(action.replica))
            elif action.do is Do.DRAINED:
                self._start(action.key, action.mark, self._drained(action.replica))
            else:
                self._start(action.key, action.mark, self._run(action))

    def _run(self, action: Action) -> Coroutine[Any, Any, None]:
        r = action.replica
        match action.do:
            case Do.LOAD:
                return self._load(r)
            case Do.UNLOAD:
                return self._unload(r)
            case Do.RESTART:
                return self._restart(r)
            case Do.CHECK_WARM:
                return self._lost_cache(r)
            case Do.REAP:
                return self._reap(r.key)
        raise AssertionError(f"no executor for {action.do}")

    def _start(self, key: RKey, mark: Mark, coro: Coroutine[Any, Any, None]) -> None:
        self._done.add(mark)
        task = asyncio.create_task(self._guard(key, coro))
        self._busy[key] = task

    async def _guard(self, key: RKey, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.logger.exception("action_failed", model_key=key[0], replica_id=key[1])
        finally:
            self._busy.pop(key, None)
            self._kick.set()  # the state may have moved on while this replica was busy

    # ---- actions -----------------------------------------------------------------------------

    def _kw(self, r: ReplicaView) -> dict[str, Any]:
        return {"actor": self.actor, "model_key": r.model_key, "replica_id": r.replica_id, "node_id": self.node_id}

    async def _load(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        bound = self.logger.bind(model_key=r.model_key, replica_id=r.replica_id)
        if r.state is S.LOAD_REQUESTED:
            await self._append(observed(ReplicaLoading, **kw))
        t0 = time.perf_counter()
        devices = list(r.gpu_indices)
        handle = self.actors.get(key)
        try:
            if handle is not None:
                info = await self.runtime.info(handle)
                # Each card's share is what placement charged it (the device map's budget).
                if info["level"] == "WARM":
                    await self.runtime.from_cache(handle, devices, r.bytes_per_gpu)
                elif info["level"] == "COLD":
                    await self.runtime.load(handle, devices, r.bytes_per_gpu)
            else:
                # A leftover from before (same id) is reused, never duplicated.
                handle = await self.runtime.get(*key) or await self._create(r)
                self.actors[key] = handle
                await self._scheduled(handle)
                await self.runtime.load(handle, devices, r.bytes_per_gpu)
        except Exception as exc:  # noqa: BLE001 - whatever the load raised is the replica's error
            error = _error_text(exc)
            bound.warning("replica_load_failed", error=error)
            await self._reap(key)
            await self._append(observed(ReplicaLoadFailed, error=error, **kw))
            return
        took = time.perf_counter() - t0
        bound.info("replica_loaded", seconds=round(took, 3), devices=devices)
        await self._append(observed(ReplicaLoaded, load_seconds=round(took, 4), **kw))

    async def _scheduled(self, handle: ReplicaHandle) -> None:
        """Wait until Ray has started the actor; one it cannot place (no CPU or memory left for its
        request on this node) stays pending, which is a failed load after `schedule_timeout_s`."""
        if not await self.runtime.started(handle, self.schedule_timeout_s):
            cpus, memory = replica_resources()
            raise ReplicaNotScheduled(
                f"Ray did not start the replica's actor within {self.schedule_timeout_s:g}s: node {self.node_id} "
                f"has no room for its request of {cpus:g} CPU and {memory / 2**20:.0f} MiB "
                "(NDIF_REPLICA_CPUS, NDIF_REPLICA_MEMORY_MB; NDIF_REPLICA_SCHEDULE_TIMEOUT_S)")

    async def _create(self, r: ReplicaView) -> ReplicaHandle:
        """A new actor for the replica, from its model's registration in the log (nothing loaded yet)."""
        reg = self.state.models[r.model_key].registration if r.model_key in self.state.models else None
        if reg is None:
            raise InfrastructureError(f"{r.model_key} has no registration in the log")
        return await self.runtime.create(ReplicaSpec(
            model_key=r.model_key, replica_id=r.replica_id, checkpoint=reg.checkpoint, revision=reg.revision,
            dtype=reg.dtype, size_bytes=reg.size_bytes, node_id=self.node_id,
            execution_timeout_s=self.execution_timeout_s))

    async def _drain_timer(self, r: ReplicaView) -> None:
        """The dispatchers that serve the replica report the drain; if they have not within the
        timeout, the agent does, saying so (`timeout`)."""
        await asyncio.sleep(self.drain_timeout_s)
        now = self.state.replicas.get(r.key)
        if now is not None and now.state is S.DRAINING and now.since_seq == r.since_seq:
            waiting = [d for d in now.served_by if d not in now.drained_by]
            self.logger.warning("drain_timeout", model_key=r.model_key, replica_id=r.replica_id,
                                seconds=self.drain_timeout_s, waiting_for=waiting)
            await self._append(observed(ReplicaDrained, reason=DrainReason.TIMEOUT, **self._kw(r)))

    async def _drained(self, r: ReplicaView) -> None:
        """No dispatcher calls the replica (or every one that does said it is idle): nothing can be in
        flight on it, so its drain is over now. The fold lets it go only if that still holds at this
        event's place in the log (a dispatcher's `ReplicaServed` landing first keeps it draining)."""
        self.logger.info("drained_unserved", model_key=r.model_key, replica_id=r.replica_id)
        await self._append(observed(ReplicaDrained, reason=DrainReason.UNSERVED, **self._kw(r)))

    async def _unload(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        handle = self.actors.get(key) or await self.runtime.get(*key)
        if r.desired is Level.WARM and handle is not None:
            try:
                cpu = await self.runtime.to_cache(handle)
                self.actors[key] = handle
                await self._append(observed(ReplicaCached, cpu_bytes=int(cpu), **kw))
                return
            except Exception as exc:  # noqa: BLE001 - cannot cache: go all the way down
                self.logger.warning("cache_failed", model_key=key[0], replica_id=key[1], error=_error_text(exc))
        await self._reap(key)
        await self._append(observed(ReplicaUnloaded, **kw))

    async def _restart(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        await self._reap(key)
        try:
            handle = self.actors[key] = await self._create(r)
            await self.runtime.load(handle, list(r.gpu_indices), r.bytes_per_gpu)  # the same layout as its first load
        except Exception as exc:  # noqa: BLE001
            await self._reap(key)
            await self._append(observed(ReplicaLoadFailed, error=_error_text(exc), **kw))
            return
        await self._append(observed(ReplicaRestarted, **kw))

    async def _lost_cache(self, r: ReplicaView) -> None:
        handle = await self.runtime.get(*r.key)
        if handle is not None:
            self.actors[r.key] = handle
            return
        await self._append(observed(ReplicaUnloaded, **self._kw(r), cache_lost=True))

    async def _reap(self, key: RKey) -> None:
        """Kill the replica's actor if there is one (and wait until its name is free)."""
        handle = self.actors.pop(key, None) or await self.runtime.get(*key)
        if handle is not None:
            await self.runtime.kill(handle)
            for _ in range(100):  # the name is released asynchronously
                if await self.runtime.get(*key) is None:
                    break
                await asyncio.sleep(0.05)

    # ---- a replica's recent lines (`ndif logs`) ------------------------------------------------

    def note(self, key: RKey, text: str) -> None:
        """Keep one line about replica `key` (time-stamped, cut to L.MAX_LINE_CHARS)."""
        ring = self.lines.get(key)
        if ring is None:
            ring = self.lines[key] = Journal()
        ring.add(text, utcnow().timestamp())

    def _note_event(self, ev: Event) -> None:
        rid = getattr(ev, "replica_id", None)
        if ev.model_key is None or not isinstance(rid, int):
            return
        detail = " ".join(f"{k}={v}" for k in ("load_seconds", "cpu_bytes", "reason", "error")
                          if (v := getattr(ev, k, None)) not in (None, ""))
        self.note((ev.model_key, rid), f"agent: {type(ev).__name__}" + (f" {detail}" if detail else ""))

    def _forget_lines(self) -> None:
        for key in [k for k in self.lines if k not in self.state.replicas]:
            del self.lines[key]

    async def replica_lines(self, model_key: str, replica_id: int, n: int) -> L.LogsReply:
        """The newest `n` lines of a replica on this node: the agent's own and its process's
        (`ReplicaRuntime.recent_lines`, asked for at most `LOGS_TIMEOUT_S`), merged by time. A process
        that does not answer in time (or is gone) leaves the agent's lines, and `missing` says why.
        NotFound when this node has no such replica."""
        key = (model_key, replica_id)
        r = self.state.replicas.get(key)
        if (r is None or r.node_id != self.node_id) and key not in self.lines and key not in self.actors:
            return L.LogsReply(ok=False, node_id=self.node_id, replica_id=replica_id, error="NotFound",
                               message=f"node {self.node_id} has no replica {replica_id} of this model")
        # one line more than asked from each source: a source with more than `n` says `truncated`
        agent = self.lines[key].recent(n + 1) if key in self.lines else []
        own: list[Line] = []
        missing = ""
        handle = self.actors.get(key)
        if handle is None:
            missing = "the replica has no process on this node now: only the agent's lines are shown"
        else:
            try:
                # the runtime bounds the call itself; this bounds a runtime that overruns its own bound
                got = await asyncio.wait_for(self.runtime.recent_lines(handle, n + 1, LOGS_TIMEOUT_S),
                                             LOGS_TIMEOUT_S + 1)
                own = [Line(at=x.at, text=f"replica: {x.text}") for x in got[-(n + 1):]]
            except Exception as exc:  # noqa: BLE001 - the agent's lines still answer
                why = (f"it did not answer within {LOGS_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError)
                       else _error_text(exc))
                missing = f"the replica's own lines could not be read ({why}): only the agent's lines are shown"
        lines = merge(agent, own)
        return L.LogsReply(ok=True, node_id=self.node_id, replica_id=replica_id, lines=[stamp(x) for x in lines[-n:]],
                           truncated=len(lines) > n, missing=missing)

    async def _answer_logs(self, msg: Any) -> None:
        """`ndif.logs.<ntok>.<mtok>.<replica_id>`: the replica's lines, or why not (never raises)."""
        if not msg.reply:
            return
        try:
            parts = msg.subject.split(".")
            rid = int(parts[-1]) if parts[-1].isdigit() and len(parts[-1]) <= 9 else -1
            ask = L.decode_ask(msg.data)
            key = next((k for k in set(self.lines) | {rk for rk in self.state.replicas}
                        if k[1] == rid and model_token(k[0]) == parts[-2]), None) if len(parts) >= 2 else None
            if key is None:
                reply = L.LogsReply(ok=False, node_id=self.node_id, replica_id=rid, error="NotFound",
                                    message=f"node {self.node_id} has no replica {rid} of this model")
            else:
                reply = await self.replica_lines(key[0], key[1], ask.lines)
        except InvalidCommand as exc:
            reply = L.LogsReply(ok=False, node_id=self.node_id, error="InvalidCommand", message=str(exc))
        with contextlib.suppress(Exception):
            await msg.respond(L.encode_reply(reply))

    async def _append(self, ev: Event) -> None:
        self._note_event(ev)
        for attempt in range(20):
            try:
                await self.log.append([ev], None)
                return
            except FactRefused as exc:  # the gate kept it out of the log: sending it again changes nothing
                self.logger.error("fact_refused", event_type=type(ev).__name__, error=str(exc))
                return
            except InfrastructureError as exc:
                self.logger.warning("append_retry", event_type=type(ev).__name__, attempt=attempt, error=str(exc))
                await asyncio.sleep(min(0.1 * 2**attempt, 5))
        raise InfrastructureError(f"could not append {type(ev).__name__} after 20 tries; are NATS and a "
                                  "controller up (its fact gate admits facts into the log)?")


def _error_text(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    base = cause if isinstance(cause, BaseException) else exc
    text = str(base).strip().splitlines()
    first = next((ln for ln in reversed(text) if ln.strip()), type(base).__name__) if text else type(base).__name__
    return f"{type(base).__name__}: {first}"[:500]


async def run_agent(url: str, **kw: Any) -> None:
    """Run an agent until cancelled (`ndif agent`); Ray must be initialised in namespace `ndif`."""
    async with await NodeAgent.open(url, **kw):
        await asyncio.Event().wait()


__all__ = ["NAMESPACE", "NodeAgent", "declared_gpus", "detect_gpus", "run_agent"]
