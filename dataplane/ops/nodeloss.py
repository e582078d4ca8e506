"""A node lost under traffic, on real multi-node Ray (raynodes.py, multinode.py): the scenario the long
test and tools/bench/nodeloss.py both run, and what it measured.

A model's replicas spread over the nodes; requests submitted at a steady pace; a worker node holding
one of them dies (its whole `ray start` process group and its `ndif agent`, SIGKILL). Its heartbeat
expires -> the controller appends NodeLost and places the replica again on a node with room ->
it loads -> requests complete on it. Every time is taken in this process as the event or status
arrives (a core subscription to the event and status subjects), from the kill. Then the node is
started again (same node id, address and inventory): its agent announces it (NodeJoined) and the
next scale-up places a replica on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from dataplane.client import Client
from dataplane.ops.multinode import Stack, until_available
from dataplane.ops.waiting import after_every_status, until_state
from schemas import events as E
from schemas.keys import canonical_model_key
from schemas.requests import StatusUpdate, status_decoder
from schemas.status import ReplicaState, RequestStatus
from schemas.subjects import EVENTS_ALL, STATUS_ALL

PAYLOAD = {"op": "forward", "input_ids": [[3, 1, 4, 1, 5]]}


@dataclass
class Seen:
    """Events and statuses as they arrived (monotonic time of arrival), from a core subscription."""

    events: list[tuple[float, Any]] = field(default_factory=list)
    statuses: list[tuple[float, StatusUpdate]] = field(default_factory=list)
    request_ids: set[str] = field(default_factory=set)  # every request id a status arrived for

    async def on_event(self, msg: Msg) -> None:
        self.events.append((time.monotonic(), E.decode_or_skip(msg.data)))

    async def on_status(self, msg: Msg) -> None:
        u = status_decoder.decode(msg.data)
        self.statuses.append((time.monotonic(), u))
        self.request_ids.add(u.request_id)

    def first_event(self, pred: Any, after: float) -> tuple[float, Any] | None:
        return next(((t, ev) for t, ev in self.events if t >= after and pred(ev)), None)


@dataclass
class NodeLossRun:
    """What one run measured. Times are seconds from the kill (None: not seen)."""

    nodes: int
    victim: str
    heartbeat_grace_s: float
    submitted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its result did not come
    completed: Counter[str] = field(default_factory=Counter)  # COMPLETED statuses per request id
    terminal: Counter[str] = field(default_factory=Counter)  # terminal statuses per request id
    retried: set[str] = field(default_factory=set)  # requests run again (a status with attempt > 1)
    detect_s: float | None = None  # kill -> NodeLost
    scheduled_s: float | None = None  # kill -> ReplicaScheduled on another node
    loaded_s: float | None = None  # kill -> that replica's ReplicaLoaded
    first_result_s: float | None = None  # kill -> first request COMPLETED on it
    max_gap_s: float | None = None  # the longest time after the kill with no request completing anywhere
    replaced_on: str | None = None  # the node the lost replica was placed again on
    spread: list[str] = field(default_factory=list)  # nodes of the Available replicas after recovery
    ray_node_before: str = ""  # the victim's Ray node id before the kill (its NodeJoined)
    ray_node_after: str = ""  # and in its NodeJoined after the restart (a fresh raylet: another id)
    rejoin_s: float | None = None  # node restarted -> NodeJoined
    rejoin_replica_s: float | None = None  # scale-up -> the replica on the rejoined node Available
    rejoined_replica_on: str | None = None

    @property
    def lost(self) -> int:
        """Requests submitted that did not end COMPLETED."""
        return sum(1 for rid in self.submitted if self.completed[rid] < 1)

    @property
    def run_twice(self) -> int:
        """Requests with more than one terminal status (completed twice, or completed and failed)."""
        return sum(1 for n in self.terminal.values() if n > 1)

    def figures(self) -> dict[str, Any]:
        def part(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 2)

        return {"nodes": self.nodes, "requests": len(self.submitted), "lost": self.lost,
                "run_twice": self.run_twice, "retried": len(self.retried), "node_loss_recovery_s": part(0.0, self.first_result_s),
                "detect_s": part(0.0, self.detect_s), "place_s": part(self.detect_s, self.scheduled_s),
                "load_s": part(self.scheduled_s, self.loaded_s),
                "first_result_s": part(self.loaded_s, self.first_result_s),
                "max_gap_s": None if self.max_gap_s is None else round(self.max_gap_s, 2),
                "heartbeat_grace_s": self.heartbeat_grace_s, "victim": self.victim,
                "replaced_on": self.replaced_on, "spread_after": self.spread,
                "rejoin_s": None if self.rejoin_s is None else round(self.rejoin_s, 2),
                "rejoin_replica_s": None if self.rejoin_replica_s is None else round(self.rejoin_replica_s, 2),
                "rejoined_replica_on": self.rejoined_replica_on}


async def node_loss(st: Stack, model: str, *, replicas: int, heartbeat_grace_s: float, head: str,
                    every_s: float = 0.25, before_s: float = 3.0, after_s: float = 3.0,
                    recovery_timeout_s: float = 120.0, rejoin: bool = True) -> NodeLossRun:
    """Deploy `model` at `replicas`, submit a request every `every_s`, kill a worker node holding a
    replica (never `head`: it holds Ray's GCS) `before_s` into the traffic, keep submitting until
    `after_s` after the first request completed on the replaced replica, wait for every result;
    then (`rejoin`) start the node again and scale up by one."""
    mk = canonical_model_key(model)
    seen = Seen()
    subs = [await st.log.nc.subscribe(EVENTS_ALL, cb=seen.on_event),
            await st.log.nc.subscribe(STATUS_ALL, cb=seen.on_status)]
    try:
        res = await st.admin.deploy(model, replicas)
        state = await st.admin.wait(res, timeout=180)
        holders = sorted({r.node_id for r in state.model_replicas(mk) if r.state is ReplicaState.AVAILABLE})
        victim = next(n for n in holders if n != head)
        run = NodeLossRun(nodes=len(st.specs), victim=victim, heartbeat_grace_s=heartbeat_grace_s,
                          ray_node_before=state.nodes[victim].ray_node_id)
        async with Client(st.url) as client:
            results: list[asyncio.Task[None]] = []

            async def one() -> None:
                job = await client.submit(model, PAYLOAD)
                run.submitted.append(job.request_id)
                try:
                    await job.result(timeout=recovery_timeout_s + 60)
                except Exception as exc:  # noqa: BLE001 - counted as lost, with its reason
                    run.failed[job.request_id] = f"{type(exc).__name__}: {exc}"

            async def traffic(stop: asyncio.Event) -> None:
                while not stop.is_set():
                    results.append(asyncio.create_task(one()))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), every_s)

            stop = asyncio.Event()
            pacer = asyncio.create_task(traffic(stop))
            try:
                await asyncio.sleep(before_s)
                kill = st.rn.kill_group(victim)
                st.kill_agent(victim)
                await _recovery(st, mk, run, seen, kill, recovery_timeout_s)
                await asyncio.sleep(after_s)
            finally:
                stop.set()
                await pacer
                await asyncio.gather(*results)
        await after_every_status(st.log, seen.request_ids)
        for _, u in seen.statuses:
            if u.status.terminal:
                run.terminal[u.request_id] += 1
            if u.status is RequestStatus.COMPLETED:
                run.completed[u.request_id] += 1
            if u.attempt > 1:
                run.retried.add(u.request_id)
        done = sorted(t for t, u in seen.statuses if u.status is RequestStatus.COMPLETED and t >= kill)
        run.max_gap_s = max((b - a for a, b in zip([kill, *done], done, strict=False)), default=None)
        state = await st.admin.state()
        run.spread = sorted(r.node_id for r in state.model_replicas(mk) if r.state is ReplicaState.AVAILABLE)
        if rejoin:
            await _rejoin(st, mk, model, run, replicas)
        return run
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def _recovery(st: Stack, mk: str, run: NodeLossRun, seen: Seen, kill: float, timeout_s: float) -> None:
    """Wait for NodeLost, the replica placed again elsewhere, loaded, and a request completed on it."""
    deadline = kill + timeout_s
    lost = scheduled = loaded = None
    while time.monotonic() < deadline:
        lost = lost or seen.first_event(lambda ev: isinstance(ev, E.NodeLost) and ev.node_id == run.victim, kill)
        if lost and scheduled is None:
            scheduled = seen.first_event(lambda ev: isinstance(ev, E.ReplicaScheduled) and ev.model_key == mk
                                         and ev.node_id != run.victim, lost[0])
        if scheduled and loaded is None:
            loaded = seen.first_event(lambda ev, rid=scheduled[1].replica_id: isinstance(ev, E.ReplicaLoaded)
                                      and ev.model_key == mk and ev.replica_id == rid, scheduled[0])
        if lost and scheduled and loaded:
            rid = loaded[1].replica_id
            first = next((t for t, u in seen.statuses if u.replica_id == rid and u.status is RequestStatus.COMPLETED),
                         None)
            if first is not None:
                run.detect_s, run.scheduled_s = lost[0] - kill, scheduled[0] - kill
                run.loaded_s, run.first_result_s = loaded[0] - kill, first - kill
                run.replaced_on = scheduled[1].node_id
                return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no recovery within {timeout_s:.0f} s of the kill: NodeLost {lost is not None}, "
                       f"placed again {scheduled is not None}, loaded {loaded is not None}")


async def _rejoin(st: Stack, mk: str, model: str, run: NodeLossRun, replicas: int) -> None:
    """Start the killed node again (same id, address, inventory); NodeJoined; the next scale-up lands on it."""
    started = time.monotonic()
    await asyncio.to_thread(st.rn.restart, run.victim)
    st.start_agent(run.victim)
    state = await until_state(st.admin, lambda s: run.victim in s.nodes and s.nodes[run.victim].alive, 120)
    run.rejoin_s = time.monotonic() - started
    run.ray_node_after = state.nodes[run.victim].ray_node_id
    before = {r.replica_id for r in (await st.admin.state()).model_replicas(mk)}
    scaled = time.monotonic()
    await st.admin.scale(model, replicas + 1)
    try:
        state = await until_available(st, mk, replicas + 1, timeout=180)
    except TimeoutError:
        # Say where it stopped: each replica's state and node, and the rejoined agent's last lines.
        now = await st.admin.state()
        reps = ", ".join(f"{r.replica_id}@{r.node_id or '-'}:{r.state}" for r in now.model_replicas(mk))
        log = st.rn.root / f"agent-{run.victim}.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no agent log)"
        raise TimeoutError(f"after the rejoin, {replicas + 1} replicas not Available within 180 s: {reps}; "
                           f"anomalies {[a.message for a in now.anomalies][-5:]}; agent {run.victim}'s log "
                           f"ends:\n{tail}") from None
    run.rejoin_replica_s = time.monotonic() - scaled
    new = [r.node_id for r in state.model_replicas(mk) if r.state is ReplicaState.AVAILABLE
           and r.replica_id not in before]
    run.rejoined_replica_on = new[0] if new else None
