"""The node agent: one per Ray node; makes the replicas on its node match the log (docs/architecture.md §1, §4).

It appends `NodeJoined` (its GPUs and CPU cache memory), keeps a KV heartbeat, folds the event
stream with the same reducer as every component, and reconciles, level-triggered (acting on the
folded state, not on single events, so a restart simply re-folds and finishes what was pending):

    LoadRequested / Loading -> create the actor (or `from_cache` a WARM one), `ReplicaLoading`,
                               `ReplicaLoaded` with load seconds, or `ReplicaLoadFailed` with the error
    Draining                -> wait for the dispatcher's `ReplicaDrained`; after `drain_timeout_s`
                               the agent appends it itself
    UnloadRequested         -> `to_cache` + `ReplicaCached` (desired WARM) or kill + `ReplicaUnloaded`
    Restarting              -> kill, re-create with the same id and cards, load, `ReplicaRestarted`
    an actor that died      -> `ReplicaFailed` (the controller's policy restarts or replaces it)

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

import ray
import structlog

from controlplane.auth import Creds, resolve
from controlplane.context import observed
from controlplane.eventstore import JetStreamEventLog
from controlplane.follow import follow_log
from controlplane.heartbeats import STALE_S, last_heartbeat
from controlplane.ports import Stored
from controlplane.projections import ClusterState
from controlplane.projections.replica import ReplicaView
from controlplane.tasks import cancel_and_wait
from dataplane.node.actor import NAMESPACE, create_actor, get_actor, list_replica_actors, replica_resources
from schemas.errors import InfrastructureError
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
from schemas.status import Level, ReplicaState
from schemas.subjects import HEARTBEATS_BUCKET, node_token

log = structlog.get_logger("ndif.agent")
SCHEDULE_TIMEOUT_S = 60.0  # a replica actor Ray has not started by then is a failed load


class ReplicaNotScheduled(InfrastructureError):
    """Ray left the replica's actor pending: the node has no CPU or memory left for its request."""


class NodeIdHeld(InfrastructureError):
    """Another agent with this node id is alive (its heartbeat is fresh)."""


S = ReplicaState
RKey = tuple[str, int]
# States in which the replica's actor should exist on this node.
_LIVE = {S.LOAD_REQUESTED, S.LOADING, S.AVAILABLE, S.DRAINING, S.UNLOAD_REQUESTED, S.CACHED, S.RESTARTING, S.FAILED}


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
    def __init__(self, url: str, node_id: str | None = None, *, gpus: tuple[GpuInfo, ...] | None = None,
                 cpu_cache_bytes: int | None = None, heartbeat_s: float = 2.0, drain_timeout_s: float = 30.0,
                 health_interval_s: float = 1.0, execution_timeout_s: float = 60.0,
                 creds: Creds | None = None) -> None:
        self.url = url
        self.creds = creds  # this node's agent user (controlplane/auth.py); None: found locally
        self.node_id = node_id or socket.gethostname()
        self.gpus = gpus
        self.cpu_cache_bytes = default_cpu_cache_bytes() if cpu_cache_bytes is None else cpu_cache_bytes
        self.heartbeat_s = heartbeat_s
        self.drain_timeout_s = drain_timeout_s
        self.health_interval_s = health_interval_s
        self.execution_timeout_s = execution_timeout_s
        self.schedule_timeout_s = float(os.environ.get("NDIF_REPLICA_SCHEDULE_TIMEOUT_S", SCHEDULE_TIMEOUT_S))
        self.actor = f"agent:{self.node_id}"
        self.state = ClusterState()
        self.log_: JetStreamEventLog | None = None
        self.ray_node_id = ""
        self.actors: dict[RKey, Any] = {}  # replica -> live actor handle on this node
        self._busy: dict[RKey, asyncio.Task[None]] = {}  # one action per replica at a time
        self._drain_timers: dict[RKey, asyncio.Task[None]] = {}  # not actions: the drain report ends them early
        self._done: set[tuple[object, ...]] = set()  # actions taken, by (replica, what, state stamp)
        self._tasks: list[asyncio.Task[None]] = []
        self._kick = asyncio.Event()
        self._rejoined_after = -1  # seq of the NodeLost this agent last answered with a NodeJoined
        self.rejoins = 0
        self.log = log.bind(node_id=self.node_id)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> NodeAgent:
        if not ray.is_initialized():
            raise InfrastructureError("Ray is not initialised in this process: ray.init(namespace='ndif') first "
                                      "(`ndif up` does it)")
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        if self.gpus is None:
            self.gpus = detect_gpus()
        if self.creds is None:
            self.creds = resolve("agent", url=self.url, node_id=self.node_id)
        self.log_ = await JetStreamEventLog.open(self.url, ensure=False, name=self.actor, creds=self.creds,
                                                 role="agent", node_id=self.node_id)
        async for batch in self.log_.read_batches():
            for seq, item in batch:
                self.state.apply(seq, item)
        try:
            await self._refuse_if_held()  # before adopting: adoption would kill the live agent's actors
        except NodeIdHeld:
            await self.log_.close()
            raise
        await self._adopt()
        await self.heartbeat_once()
        await self._append(self._joined())
        self._tasks += [asyncio.create_task(self._heartbeat(), name="agent-heartbeat"),
                        asyncio.create_task(self._follow(), name="agent-follow"),
                        asyncio.create_task(self._reconcile_loop(), name="agent-reconcile"),
                        asyncio.create_task(self._health(), name="agent-health")]
        self.log.info("agent_started", ray_node_id=self.ray_node_id, gpus=len(self.gpus), adopted=len(self.actors),
                      seq=self.state.seq)
        return self

    async def stop(self) -> None:
        """Stop acting; the detached actors stay (a restarted agent adopts them)."""
        started = bool(self._tasks)
        await cancel_and_wait([*self._tasks, *self._busy.values(), *self._drain_timers.values()], owner=self.actor)
        if started and self.log_ is not None:
            # Goodbye: an empty heartbeat lets an agent started next under this node id take over
            # at once (a live one is refused). Best effort: a dead NATS must not hold up the stop.
            with contextlib.suppress(Exception):
                kv = await asyncio.wait_for(self.log_.js.key_value(HEARTBEATS_BUCKET), 2)
                await asyncio.wait_for(kv.put(node_token(self.node_id), b""), 2)
        self._tasks.clear()
        self._busy.clear()
        self._drain_timers.clear()
        if self.log_ is not None:
            await self.log_.close()

    async def __aenter__(self) -> NodeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _refuse_if_held(self) -> None:
        """Refuse a node id whose agent is alive: its heartbeat is fresh and still beats.

        A heartbeat younger than `max(3 * heartbeat_s, STALE_S)` is watched until it is that old: a
        new beat means a live agent (refused at once); none means its agent died (taken over).
        """
        assert self.log_ is not None
        js = self.log_.js
        try:
            first = await last_heartbeat(js, self.node_id)
        except Exception as exc:  # noqa: BLE001 - e.g. not allowed to read the bucket: say so, go on
            self.log.warning("node_id_check_skipped", error=str(exc) or type(exc).__name__)
            return
        if first is None or first.stopped:
            return
        window = max(3 * self.heartbeat_s, STALE_S)
        age0 = first.age_s()
        deadline = time.monotonic() + max(0.0, window - age0)
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            now = await last_heartbeat(js, self.node_id)
            if now is not None and now.seq != first.seq:
                raise NodeIdHeld(
                    f"node id {self.node_id!r} is held by a live agent (it beat {now.age_s():.1f}s ago): "
                    "stop that agent first, or give this one another --node-id")
        if age0 < window:
            self.log.warning("node_id_taken_over", heartbeat_age_s=round(age0, 1), waited_s=round(window - age0, 1))

    # ---- adoption ----------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Take over the live actors of this node: keep the ones the log wants, kill the others."""
        for model_key, rid, name in await asyncio.to_thread(list_replica_actors):
            handle = await _get(model_key, rid)
            if handle is None:
                continue
            try:
                info = await asyncio.wait_for(_aw(handle.info.remote()), 30)
            except Exception as exc:  # noqa: BLE001 - dead or wedged: not ours to keep
                self.log.warning("adopt_unreachable", actor=name, error=str(exc))
                continue
            if info.get("ray_node_id") != self.ray_node_id:
                continue  # another node's agent owns it
            r = self.state.replicas.get((model_key, rid))
            if r is None or r.node_id != self.node_id or r.state not in _LIVE:
                self.log.warning("orphan_killed", model_key=model_key, replica_id=rid,
                                 state=str(r.state) if r else None)
                await self._kill(handle)
                continue
            self.actors[(model_key, rid)] = handle
            self.log.info("actor_adopted", model_key=model_key, replica_id=rid, level=info.get("level"))

    # ---- the loops ---------------------------------------------------------------------------

    async def heartbeat_once(self) -> None:
        assert self.log_ is not None
        kv = await self.log_.js.key_value(HEARTBEATS_BUCKET)
        await kv.put(node_token(self.node_id), self.node_id.encode())

    def _joined(self) -> NodeJoined:
        assert self.gpus is not None
        return observed(NodeJoined, actor=self.actor, node_id=self.node_id, gpus=self.gpus,
                        cpu_cache_bytes=self.cpu_cache_bytes, hostname=socket.gethostname(),
                        ray_node_id=self.ray_node_id)

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
        self.log.warning("node_declared_lost_rejoining", lost_seq=lost_seq)
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
                self.log.warning("heartbeat_failed", error=str(exc) or type(exc).__name__)

    async def _follow(self) -> None:
        assert self.log_ is not None
        self._kick.set()
        await follow_log(self.log_, lambda: self.state.seq + 1, self._on_batch, logger=self.log)

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
                self.log.exception("reconcile_failed")

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
                    try:
                        await asyncio.wait_for(_aw(handle.ping.remote()), 10)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
                        error = f"actor died: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    except (TimeoutError, ray.exceptions.GetTimeoutError):
                        continue  # busy is not dead
                if error is not None and (key, "failed", r.since_seq) not in self._done:
                    self._done.add((key, "failed", r.since_seq))
                    self.actors.pop(key, None)
                    self.log.warning("replica_failed", model_key=key[0], replica_id=key[1], error=error)
                    await self._append(observed(ReplicaFailed, actor=self.actor, model_key=key[0], replica_id=key[1],
                                                node_id=self.node_id, error=error))

    # ---- reconcile ---------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Start what the folded state asks of this node (each replica one action at a time)."""
        mine = [r for r in self.state.replicas.values() if r.node_id == self.node_id]
        leaving = [r for r in mine if r.on_gpu and r.desired is not Level.HOT]
        for key, timer in list(self._drain_timers.items()):
            now = self.state.replicas.get(key)
            if timer.done() or now is None or now.state is not S.DRAINING:
                timer.cancel()  # drained (or moved on): the unload must not wait for the timeout
                del self._drain_timers[key]
        for r in sorted(mine, key=lambda r: (r.since_seq, r.model_key, r.replica_id)):
            key = r.key
            if key in self._busy:
                continue
            match r.state:
                case S.LOAD_REQUESTED | S.LOADING:
                    mark = (key, "load", r.scheduled_at)
                    if mark in self._done:
                        continue
                    cards = set(r.gpu_indices)
                    if any(o.key != key and cards & set(o.gpu_indices) for o in leaving):
                        continue  # the leaving replica's unload comes first; its event kicks us again
                    self._start(key, mark, self._load(r))
                case S.DRAINING:
                    mark = (key, "drain", r.since_seq)
                    if mark not in self._done:
                        self._done.add(mark)
                        self._drain_timers[key] = asyncio.create_task(self._drain_timer(r))
                case S.UNLOAD_REQUESTED:
                    mark = (key, "unload", r.since_seq)
                    if mark not in self._done:
                        self._start(key, mark, self._unload(r))
                case S.RESTARTING:
                    mark = (key, "restart", r.since_seq)
                    if mark not in self._done:
                        self._start(key, mark, self._restart(r))
                case S.CACHED:
                    mark = (key, "check-warm", r.since_seq)
                    if mark not in self._done and key not in self.actors:
                        # WARM in the log but no actor holds the weights (e.g. it died while we were away).
                        self._start(key, mark, self._lost_cache(r))
                case S.UNLOADED | S.LOAD_FAILED | S.LOST:
                    if key in self.actors:  # a leftover actor (e.g. after a failed load): not wanted
                        self._start(key, (key, "reap", r.since_seq), self._reap(key))

    def _start(self, key: RKey, mark: tuple[object, ...], coro: Coroutine[Any, Any, None]) -> None:
        self._done.add(mark)
        task = asyncio.create_task(self._guard(key, coro))
        self._busy[key] = task

    async def _guard(self, key: RKey, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("action_failed", model_key=key[0], replica_id=key[1])
        finally:
            self._busy.pop(key, None)
            self._kick.set()  # the state may have moved on while this replica was busy

    # ---- actions -----------------------------------------------------------------------------

    def _kw(self, r: ReplicaView) -> dict[str, Any]:
        return {"actor": self.actor, "model_key": r.model_key, "replica_id": r.replica_id, "node_id": self.node_id}

    async def _load(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        bound = self.log.bind(model_key=r.model_key, replica_id=r.replica_id)
        if r.state is S.LOAD_REQUESTED:
            await self._append(observed(ReplicaLoading, **kw))
        t0 = time.perf_counter()
        devices = list(r.gpu_indices)
        handle = self.actors.get(key)
        try:
            if handle is not None:
                info = await _aw(handle.info.remote())
                # Each card's share is what placement charged it (the device map's budget).
                if info["level"] == "WARM":
                    await _aw(handle.from_cache.remote(devices, r.bytes_per_gpu))
                elif info["level"] == "COLD":
                    await _aw(handle.load.remote(devices, r.bytes_per_gpu))
            else:
                # A leftover from before (same id) is reused, never duplicated.
                handle = await _get(*key) or await self._create(r)
                self.actors[key] = handle
                await self._scheduled(handle)
                await _aw(handle.load.remote(devices, r.bytes_per_gpu))
        except Exception as exc:  # noqa: BLE001 - whatever the load raised is the replica's error
            error = _error_text(exc)
            bound.warning("replica_load_failed", error=error)
            await self._reap(key)
            await self._append(observed(ReplicaLoadFailed, error=error, **kw))
            return
        took = time.perf_counter() - t0
        bound.info("replica_loaded", seconds=round(took, 3), devices=devices)
        await self._append(observed(ReplicaLoaded, load_seconds=round(took, 4), **kw))

    async def _scheduled(self, handle: Any) -> None:
        """Wait until Ray has started the actor; one it cannot place (no CPU or memory left for its
        request on this node) stays pending, which is a failed load after `schedule_timeout_s`."""
        try:
            await asyncio.wait_for(_aw(handle.info.remote()), self.schedule_timeout_s)
        except TimeoutError:
            cpus, memory = replica_resources()
            raise ReplicaNotScheduled(
                f"Ray did not start the replica's actor within {self.schedule_timeout_s:g}s: node {self.node_id} "
                f"has no room for its request of {cpus:g} CPU and {memory / 2**20:.0f} MiB "
                "(NDIF_REPLICA_CPUS, NDIF_REPLICA_MEMORY_MB; NDIF_REPLICA_SCHEDULE_TIMEOUT_S)") from None

    async def _create(self, r: ReplicaView) -> Any:
        """A new actor for the replica, from its model's registration in the log (nothing loaded yet)."""
        reg = self.state.models[r.model_key].registration if r.model_key in self.state.models else None
        if reg is None:
            raise InfrastructureError(f"{r.model_key} has no registration in the log")
        return await asyncio.to_thread(
            create_actor, r.model_key, r.replica_id, reg.checkpoint, revision=reg.revision, dtype=reg.dtype,
            ray_node_id=self.ray_node_id, node_id=self.node_id, execution_timeout_s=self.execution_timeout_s,
            nats_url=self.url, nats_creds=self.creds)

    async def _drain_timer(self, r: ReplicaView) -> None:
        """The dispatcher reports the drain; if it has not within the timeout, the agent does."""
        await asyncio.sleep(self.drain_timeout_s)
        now = self.state.replicas.get(r.key)
        if now is not None and now.state is S.DRAINING and now.since_seq == r.since_seq:
            self.log.info("drain_timeout", model_key=r.model_key, replica_id=r.replica_id,
                          seconds=self.drain_timeout_s)
            await self._append(observed(ReplicaDrained, **self._kw(r)))

    async def _unload(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        handle = self.actors.get(key) or await _get(*key)
        if r.desired is Level.WARM and handle is not None:
            try:
                cpu = await _aw(handle.to_cache.remote())
                self.actors[key] = handle
                await self._append(observed(ReplicaCached, cpu_bytes=int(cpu), **kw))
                return
            except Exception as exc:  # noqa: BLE001 - cannot cache: go all the way down
                self.log.warning("cache_failed", model_key=key[0], replica_id=key[1], error=_error_text(exc))
        await self._reap(key)
        await self._append(observed(ReplicaUnloaded, **kw))

    async def _restart(self, r: ReplicaView) -> None:
        key = r.key
        kw = self._kw(r)
        await self._reap(key)
        try:
            handle = self.actors[key] = await self._create(r)
            await _aw(handle.load.remote(list(r.gpu_indices)))
        except Exception as exc:  # noqa: BLE001
            await self._reap(key)
            await self._append(observed(ReplicaLoadFailed, error=_error_text(exc), **kw))
            return
        await self._append(observed(ReplicaRestarted, **kw))

    async def _lost_cache(self, r: ReplicaView) -> None:
        handle = await _get(*r.key)
        if handle is not None:
            self.actors[r.key] = handle
            return
        await self._append(observed(ReplicaUnloaded, **self._kw(r)))

    async def _reap(self, key: RKey) -> None:
        """Kill the replica's actor if there is one (and wait until its name is free)."""
        handle = self.actors.pop(key, None) or await _get(*key)
        if handle is not None:
            await self._kill(handle)
            for _ in range(100):  # the name is released asynchronously
                if await _get(*key) is None:
                    break
                await asyncio.sleep(0.05)

    async def _kill(self, handle: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(_aw(handle.unload.remote()), 10)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, handle, no_restart=True)

    async def _append(self, ev: Event) -> None:
        assert self.log_ is not None
        for attempt in range(20):
            try:
                await self.log_.append([ev], None)
                return
            except InfrastructureError as exc:
                self.log.warning("append_retry", event=type(ev).__name__, attempt=attempt, error=str(exc))
                await asyncio.sleep(min(0.1 * 2**attempt, 5))
        raise InfrastructureError(f"could not append {type(ev).__name__} after 20 tries; is NATS up?")


async def _get(model_key: str, replica_id: int) -> Any:
    """`get_actor` is a blocking GCS call: keep it off the event loop (heartbeats must not stall)."""
    return await asyncio.to_thread(get_actor, model_key, replica_id)


def _aw(ref: Any) -> Any:
    """An ObjectRef as an awaitable (Ray refs are awaitable in asyncio)."""
    return ref


def _error_text(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    base = cause if isinstance(cause, BaseException) else exc
    text = str(base).strip().splitlines()
    first = next((ln for ln in reversed(text) if ln.strip()), type(base).__name__) if text else type(base).__name__
    return f"{type(base).__name__}: {first}"[:500]


async def run_agent(url: str, **kw: Any) -> None:
    """Run an agent until cancelled (`ndif agent`); Ray must be initialised in namespace `ndif`."""
    async with NodeAgent(url, **kw):
        await asyncio.Event().wait()


__all__ = ["NAMESPACE", "NodeAgent", "declared_gpus", "detect_gpus", "run_agent"]
