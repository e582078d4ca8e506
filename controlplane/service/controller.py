"""The controller: serves `ndif.cmd.<verb>`, decides against the folded log, appends with OCC.

Several may run at once (queue group `ndif-controller`); optimistic concurrency on the whole stream
makes their decisions linearizable: a loser folds the tail and decides again (GroupCommitter). It
replies once the decision is in the log. Policies are decisions too: a failed replica is restarted
(then replaced), a node whose heartbeat expired is declared lost and its replicas placed elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from controlplane.core.autoscale import decide_autoscale, decision_id, evaluate
from controlplane.core.context import DecisionContext
from controlplane.core.decide import (
    MAX_RESTARTS,
    Registration,
    already_decided,
    decide,
    decide_failure,
    decide_inventory,
    decide_node_lost,
    decide_outage,
    decide_rollout,
    decide_unplaced,
    on_demand_user,
    summarize,
)
from controlplane.core.placement import MIN_DEPLOY_S, PADDING
from controlplane.core.ports import EventLog, Stored
from controlplane.core.projections import ClusterState
from controlplane.service.clock import new_id, utcnow
from controlplane.service.committer import GroupCommitter
from controlplane.service.follow import catch_up, caught_up, follow_log
from controlplane.service.parts import Connect, Parts, connect_url, given, start_or_stop
from controlplane.service.registry import ModelRoots
from controlplane.service.snapshots import SNAPSHOT_EVERY, SNAPSHOT_EVERY_S, SnapshotWriter
from controlplane.service.tasks import cancel_and_wait
from controlplane.store.credentials import JS_API, Creds
from controlplane.store.heartbeats import beat_counts, last_heard
from controlplane.store.rebuild import store_of
from schemas.autoscale import FIGURES_STALE_S, QueueFigures, decode_figures, sum_figures
from schemas.commands import MAX_COMMAND_BYTES, AnyCommand, CommandResult, Deploy, Limits, OnDemand, decode_command
from schemas.errors import NdifError
from schemas.events import (
    AutoscaleDecided,
    ClusterDown,
    Event,
    NodeDeclared,
    NodeJoined,
    ReplicaCached,
    ReplicaEvent,
    ReplicaFailed,
    ReplicaLoadFailed,
    ReplicaScheduled,
    ReplicaUnloaded,
    RolloutUpdated,
)
from schemas.guard import decode_any
from schemas.inventory import Inventory
from schemas.keys import canonical_model_key
from schemas.status import Level, ReplicaState
from schemas.subjects import COMMANDS_PREFIX, FIGURES_ANY, HEARTBEATS_BUCKET, model_token, node_token

logger = structlog.get_logger("ndif.controller")

QUEUE_GROUP = "ndif-controller"
AUTOSCALE_REFUSED_RETRY_S = 30.0  # a model whose autoscale decision was refused is evaluated again after this
_result_encoder = msgspec.json.Encoder()


def seed_of(command_id: str) -> int:
    """Placement's tie-break seed, derived from the command id (and recorded in its events)."""
    return int.from_bytes(hashlib.blake2b(command_id.encode(), digest_size=4).digest(), "big")


class Controller:
    """Decides commands and policies over an event log. Give it its parts (`Parts`, or a `Connect`
    that opens them on start); `Controller.from_url` opens a JetStream log on its own connection.
    Without a NATS connection (`Parts(MemoryEventLog(), None)`) it still folds, decides `handle()`d
    commands and runs the failure and unplaced-replica policies, but serves no subject and watches
    no heartbeats (so declares no node lost)."""

    def __init__(self, parts: Parts | Connect, *, name: str | None = None, min_deploy_s: float = MIN_DEPLOY_S,
                 max_restarts: int = MAX_RESTARTS, heartbeat_grace_s: float = 20.0,
                 policy_interval_s: float = 2.0, max_inflight: int = 512,
                 headroom: float = PADDING, max_replicas_per_model: int | None = None,
                 max_replicas_per_command: int | None = None, autoscale_interval_s: float = 0.5,
                 inventory: Inventory | None = None, model_roots: ModelRoots | None = None,
                 snapshot_every: int = SNAPSHOT_EVERY, snapshot_every_s: float = SNAPSHOT_EVERY_S,
                 snapshot_keep: int | None = None) -> None:
        self.parts = parts
        # The controller's own decisions' ids end with a secret of this process: an id read from the
        # log names a position, and anyone who may publish on an event subject may send any
        # Nats-Msg-Id, so a predictable id could be taken first and the decision dropped as its
        # duplicate. Two controllers deciding the same thing are kept apart by the append's
        # expected last sequence (the second re-folds and finds it done), not by the id.
        self._salt = new_id()[:12]
        # The operator's inventory, recorded in the log on start when it differs from the log's
        # (None: whatever the log holds stands). From the first one on, a node's capacity is what is
        # declared for it (controlplane/core/inventory.py).
        self.inventory = inventory
        # Where a deploy a request asked for (the dispatcher's) may find a checkpoint (registry.py).
        self.model_roots = model_roots or ModelRoots.from_env(os.environ)
        # Replica bounds, checked when a command is decoded (and the per-model one when decided):
        # a count past them is refused before placement runs. Defaults, then env, then arguments.
        self.limits = Limits.from_env(os.environ, max_replicas_per_model=max_replicas_per_model,
                                      max_replicas_per_command=max_replicas_per_command)
        # Who may have models deployed by their requests, and how many (NDIF_ON_DEMAND_*).
        self.on_demand = OnDemand.from_env(os.environ)
        self.name = name or default_name()
        # Settings that change decisions: every path that decides (commands, failure replacement,
        # node loss) gets them, and the events record what was used, so replay needs no flags.
        self.min_deploy_s = min_deploy_s
        self.headroom = headroom
        self.max_restarts = max_restarts
        self.heartbeat_grace_s = heartbeat_grace_s
        self.policy_interval_s = policy_interval_s
        # Snapshots of the fold (controlplane/service/snapshots.py): every `snapshot_every` events or
        # `snapshot_every_s` seconds (0: not by that), the newest `snapshot_keep` kept (None: all).
        self.snapshot_every, self.snapshot_every_s, self.snapshot_keep = snapshot_every, snapshot_every_s, snapshot_keep
        self.snapshots: SnapshotWriter | None = None
        self.log: EventLog | None = None
        self.nc: NatsClient | None = None
        self._close: Callable[[], Awaitable[None]] | None = None
        self.committer: GroupCommitter[ClusterState] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: Subscription | None = None
        self._resolve_lock = asyncio.Lock()
        self._bg: set[asyncio.Task[None]] = set()
        self.handled = 0  # commands answered by this controller (tests, `ndif controller` logs)
        self._inflight = asyncio.Semaphore(max_inflight)
        self._seen: dict[str, datetime] = {}  # node token -> last heartbeat change seen
        self._placing: asyncio.Task[None] | None = None  # the one unplaced-replica placement at a time
        self._place_again = False
        self.unplaced_placed = 0  # replicas placed by the level-triggered rule (tests, logs)
        # Queue figures heard from dispatchers: model key -> dispatcher -> (figures, monotonic time
        # heard). Inputs only: a decision records the sum it acted on.
        self.autoscale_interval_s = autoscale_interval_s
        self._figures: dict[str, dict[str, tuple[QueueFigures, float]]] = {}
        self._figures_sub: Subscription | None = None
        self.autoscale_decisions = 0  # AutoscaleDecided appended by this controller (tests, logs)
        self.gate: Any = None  # the fact gate, on a JetStream log with a connection

    @classmethod
    def from_url(cls, url: str, *, name: str | None = None, creds: Creds | None = None,
                 stream_replicas: int | None = None, **settings: Any) -> Controller:
        """A controller on its own connection to `url`, as `creds` (None: the controller role's local
        user). `stream_replicas`: R3 on a NATS cluster (deploy/nats/); None: NDIF_STREAM_REPLICAS, else 1."""
        name = name or default_name()
        return cls(connect_url(url, name=name, creds=creds, role="controller", replicas=stream_replicas),
                   name=name, **settings)

    def _own(self, cid: str) -> str:
        """A decision's command id: its position in the log, then this controller's secret."""
        return f"{cid}-{self._salt}"

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    @property
    def state(self) -> ClusterState:
        assert self.committer is not None
        return self.committer.state

    async def start(self) -> Controller:
        self.log, self.nc, self._close = await given(self.parts)
        return await start_or_stop(self._start, self.stop)

    async def _start(self) -> Controller:
        assert self.log is not None
        # The newest snapshot that matches the log, then the tail: a start costs the same at any length.
        self.committer = await GroupCommitter(self.log, await catch_up(self.log)).start()
        store = store_of(self.log)
        if store is not None and (self.snapshot_every or self.snapshot_every_s):
            self.snapshots = await SnapshotWriter(store, every=self.snapshot_every, every_s=self.snapshot_every_s,
                                                  keep=self.snapshot_keep).start(self.state.seq)
            self.snapshots.after_batch(self.state)  # a log long past its newest snapshot gets one now
        if self.nc is not None:
            await self._record_outage(self.nc)
        if self.inventory is not None:
            await self.declare(self.inventory)
        self._tasks.append(asyncio.create_task(self._follow(), name="controller-follow"))
        make_gate = getattr(self.log, "fact_gate", None)
        if self.nc is not None and make_gate is not None:
            # Observed facts reach the log only through the gate (controlplane/store/eventstore/gate.py).
            self.gate = make_gate(lambda: self.state, lambda: caught_up(self.log, lambda: self.state))
            self._tasks.append(asyncio.create_task(self.gate.run(), name="controller-fact-gate"))
        if self.nc is not None:
            self._tasks.append(asyncio.create_task(self._watch_heartbeats(self.nc), name="controller-heartbeats"))
        self._tasks.append(asyncio.create_task(self._policies(), name="controller-policies"))
        self._tasks.append(asyncio.create_task(self._autoscale_loop(), name="controller-autoscale"))
        if self.nc is not None:
            self._figures_sub = await self.nc.subscribe(FIGURES_ANY, cb=self._on_figures)
            self._sub = await self.nc.subscribe(f"{COMMANDS_PREFIX}.*", queue=QUEUE_GROUP, cb=self._on_command)
        logger.info("controller_started", name=self.name, seq=self.state.seq, serving=self.nc is not None)
        return self

    async def stop(self) -> None:
        for sub in (self._sub, self._figures_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        await cancel_and_wait([*self._tasks, *self._bg], owner=self.name)
        self._tasks.clear()
        if self.committer is not None:
            await self.committer.stop()
        if self.snapshots is not None:
            await self.snapshots.stop()
        if self._close is not None:
            await self._close()

    async def __aenter__(self) -> Controller:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- commands ----------------------------------------------------------------------------

    async def _on_command(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: hand each command to its own
        # task so that concurrent commands meet in the group committer (one append for many).
        self.handled += 1
        await self._inflight.acquire()
        self._background(self._answer(msg))

    async def _answer(self, msg: Msg) -> None:
        try:
            await self._answer_one(msg)
        finally:
            self._inflight.release()

    async def _answer_one(self, msg: Msg) -> None:
        try:
            result = await self.handle(msg.data, verb=msg.subject.rsplit(".", 1)[-1])
        except Exception as exc:
            logger.exception("command_crashed")
            result = CommandResult(command_id="", ok=False, error=type(exc).__name__,
                                   message=f"controller error: {exc}")
        if msg.reply:
            with contextlib.suppress(nats.errors.ConnectionClosedError):
                await msg.respond(_result_encoder.encode(result))

    async def handle(self, body: bytes, *, verb: str | None = None) -> CommandResult:
        """Decide one command body and append it; every failure becomes a typed error reply.

        `verb`: the subject's verb (`ndif.cmd.<verb>`), which must match the body's."""
        cid = _command_id_of(body)
        try:
            cmd = decode_command(body, self.limits, verb=verb)
            cid = cmd.command_id
            cmd = self._canonical(cmd)
            with structlog.contextvars.bound_contextvars(command_id=cid, model_key=getattr(cmd, "model_key", None)):
                return await self._decide(cmd)
        except NdifError as exc:
            logger.info("command_refused", command_id=cid, error=type(exc).__name__, message=str(exc))
            return CommandResult(command_id=cid, ok=False, error=type(exc).__name__, message=str(exc))

    def _canonical(self, cmd: AnyCommand) -> AnyCommand:
        # A relative checkpoint path means the sender's directory, which is not known here: the
        # client canonicalises before sending, and what still arrives relative is refused.
        mk = getattr(cmd, "model_key", None)
        if mk:
            try:
                canonical = canonical_model_key(mk, relative=False)
            except NdifError:
                if self.committer is not None and mk in self.state.models:  # a key an earlier version took:
                    # its model stays the operator's to manage
                    return cmd
                raise
            return msgspec.structs.replace(cmd, model_key=canonical)  # type: ignore[type-var]
        return cmd

    async def _decide(self, cmd: AnyCommand) -> CommandResult:
        assert self.committer is not None
        if already_decided(self.state, cmd):  # CommandIdConflict when the id was used for another command
            return await self._recorded(cmd.command_id)
        if isinstance(cmd, Deploy):
            on_demand_user(self.state, cmd, self.on_demand)  # refused before the checkpoint is measured
        registration = await self._registration(cmd)
        now = utcnow()

        def run(state: ClusterState) -> list[Event]:
            ctx = DecisionContext(now=now, actor=cmd.actor, command_id=cmd.command_id, seed=seed_of(cmd.command_id))
            return decide(state, cmd, ctx, registration=registration, min_deploy_s=self.min_deploy_s,
                          headroom=self.headroom, max_replicas_per_model=self.limits.max_replicas_per_model,
                          on_demand=self.on_demand)

        res = await self.committer.submit(run)
        if not res.events and already_decided(self.state, cmd):
            return await self._recorded(cmd.command_id)  # a twin of this command won the same turn
        logger.info("command_decided", verb=cmd.__struct_config__.tag, first_seq=res.first_seq, last_seq=res.last_seq,
                 events=len(res.events), attempts=res.attempts)
        return self._with_cards(summarize(cmd.command_id, res.events, res.first_seq))

    def _with_cards(self, result: CommandResult) -> CommandResult:
        """A replica restarted in place keeps its cards, which its restart event does not repeat: the
        reply names them from the fold, right after the decision."""
        if not any(r.action == "restarted" and not r.gpu_indices for r in result.replicas):
            return result
        out = []
        for r in result.replicas:
            view = self.state.replicas.get((r.model_key, r.replica_id))
            if r.action == "restarted" and not r.gpu_indices and view is not None and view.gpu_indices:
                r = msgspec.structs.replace(r, gpu_indices=tuple(view.gpu_indices))
            out.append(r)
        return msgspec.structs.replace(result, replicas=out)

    async def _recorded(self, command_id: str) -> CommandResult:
        """The first result of an already-decided command, rebuilt from its events in the log."""
        assert self.log is not None
        rec = self.state.commands[command_id]
        events = [e for _, e in [p async for p in self.log.read(rec.first_seq, stop_seq=rec.last_seq)]
                  if isinstance(e, Event) and e.command_id == command_id]
        return summarize(command_id, events, rec.first_seq, duplicate=True)

    async def _registration(self, cmd: AnyCommand) -> Registration | None:
        mk = getattr(cmd, "model_key", None)
        if mk is None or cmd.__struct_config__.tag not in ("deploy", "scale"):
            return None
        m = self.state.models.get(mk)
        if m is not None and m.registration is not None:
            return None
        from controlplane.service.registry import resolve  # torch/transformers: only when a model is new

        # A deploy a user's request asked for resolves only what the operator offers (registry.py).
        roots = self.model_roots if getattr(cmd, "for_request", False) else None
        async with self._resolve_lock:
            return await asyncio.to_thread(resolve, mk, getattr(cmd, "size_bytes", None), roots=roots)

    async def _record_outage(self, nc: NatsClient) -> None:
        """Starting on a log after a gap longer than the heartbeat grace: the span in which nothing
        of the cluster was heard is a `ClusterDown` in the log, so timelines show it as down."""
        assert self.committer is not None
        heard = await last_heard(nc, api=getattr(self.log, "api", JS_API))
        cid = self._own(f"outage-{self.state.seq}")

        def run(state: ClusterState) -> list[Event]:
            return decide_outage(state, heard, DecisionContext(now=utcnow(), actor=self.name, command_id=cid),
                                 self.heartbeat_grace_s)

        res = await self.committer.submit(run)
        for e in res.events:
            if isinstance(e, ClusterDown):
                logger.warning("cluster_was_down", down_from=e.down_from.isoformat(), down_s=round(e.down_s, 1),
                               seq=res.first_seq)

    async def declare(self, inventory: Inventory) -> int:
        """Record the operator's inventory (a `NodeDeclared` per node that changes); returns how many."""
        assert self.committer is not None
        digest = hashlib.blake2b(msgspec.json.encode(inventory), digest_size=6).hexdigest()
        cid = self._own(f"inventory-{digest}-{self.state.seq}")

        def run(state: ClusterState) -> list[Event]:
            return decide_inventory(state, inventory, DecisionContext(now=utcnow(), actor=self.name, command_id=cid))

        res = await self.committer.submit(run)
        if res.events:
            logger.info("inventory_declared", nodes=len(res.events), first_seq=res.first_seq)
        return len(res.events)

    # ---- the follower and the policies -------------------------------------------------------

    async def _follow(self) -> None:
        assert self.log is not None
        await follow_log(self.log, lambda: self.state.seq + 1, self._on_batch, logger=logger,
                         fold=lambda: self.state, refold=self._refold)

    async def _refold(self, state: ClusterState) -> None:
        """The log went back (a store that lost its tail, or restored): decide from what it holds now."""
        self.state.become(state)
        if self.snapshots is not None:  # snapshots past the log's end name a past it no longer holds
            await self.snapshots.start(state.seq)
        logger.warning("controller_refolded", seq=state.seq)
        self.place_unplaced_soon()

    def _on_batch(self, batch: list[Stored]) -> None:
        assert self.committer is not None
        room = False
        rollouts: set[str] = set()
        for seq, item in batch:
            self.committer.observe(seq, item)
            if isinstance(item, ReplicaFailed):
                self._background(self._on_failure(item.model_key, item.replica_id))
            elif isinstance(item, _ROOM_EVENTS):
                room = True
            if isinstance(item, ReplicaEvent | RolloutUpdated):
                m = self.state.models.get(item.model_key)
                if m is not None and m.rollout:
                    rollouts.add(item.model_key)
        if room:
            self.place_unplaced_soon()  # room may exist now for replicas wanted but unplaced
        for model_key in rollouts:
            self._background(self._on_rollout(model_key))

        if self.snapshots is not None:
            self.snapshots.after_batch(self.state)

    async def _on_rollout(self, model_key: str) -> None:
        """The next step of a rolling restart, if the replica restarted last is back (or failed).
        The step's id names the rollout's position; two controllers append it once (the second's
        expected last sequence fails, and it re-folds)."""
        assert self.committer is not None
        m = self.state.models.get(model_key)
        if m is None or not m.rollout:
            return
        cid = self._own(f"policy-rollout-{model_token(model_key)}-{m.rollout_current}-{len(m.rollout)}-{m.since_seq}")

        def run(state: ClusterState) -> list[Event]:
            ctx = DecisionContext(now=utcnow(), actor=self.name, command_id=cid, seed=seed_of(cid))
            return decide_rollout(state, model_key, ctx)

        with contextlib.suppress(NdifError):
            res = await self.committer.submit(run)
            for e in res.events:
                if isinstance(e, RolloutUpdated):
                    logger.info("rollout_step", model_key=model_key, restarted=e.current, remaining=list(e.remaining),
                                note=e.note)

    async def _on_failure(self, model_key: str, replica_id: int) -> None:
        assert self.committer is not None
        cid = self._own(f"policy-failure-{model_token(model_key)}-{replica_id}-{self.state.seq}")

        def run(state: ClusterState) -> list[Event]:
            ctx = DecisionContext(now=utcnow(), actor=self.name, command_id=cid, seed=seed_of(cid))
            return decide_failure(state, model_key, replica_id, ctx, max_restarts=self.max_restarts,
                                  min_deploy_s=self.min_deploy_s, headroom=self.headroom)

        with contextlib.suppress(NdifError):
            res = await self.committer.submit(run)
            if res.events:
                logger.info("replica_failure_handled", model_key=model_key, replica_id=replica_id,
                         action=type(res.events[0]).__name__)

    def place_unplaced_soon(self) -> None:
        """Run `decide_unplaced` (one at a time; a call while one runs makes it run once more)."""
        if self._placing is not None and not self._placing.done():
            self._place_again = True
            return
        self._placing = asyncio.create_task(self._place_unplaced(), name="controller-place-unplaced")
        self._bg.add(self._placing)
        self._placing.add_done_callback(self._bg.discard)

    async def _place_unplaced(self) -> None:
        assert self.committer is not None
        while True:
            self._place_again = False
            if any(r.state is ReplicaState.LOST and r.desired is Level.HOT for r in self.state.replicas.values()):
                cid = self._own(f"policy-unplaced-{self.state.seq}")

                def run(state: ClusterState, cid: str = cid) -> list[Event]:
                    ctx = DecisionContext(now=utcnow(), actor=self.name, command_id=cid, seed=seed_of(cid))
                    return decide_unplaced(state, ctx, headroom=self.headroom, min_deploy_s=self.min_deploy_s)

                with contextlib.suppress(NdifError):
                    res = await self.committer.submit(run)
                    n = sum(1 for e in res.events if isinstance(e, ReplicaScheduled))
                    if n:
                        self.unplaced_placed += n
                        logger.info("unplaced_replicas_placed", replicas=n, first_seq=res.first_seq)
            if not self._place_again:
                return

    async def _watch_heartbeats(self, nc: NatsClient) -> None:
        """Keep `_seen[node token]` = when its KV heartbeat last changed (a watch, not a poll: the
        cost follows the heartbeat rate, not the cluster size times the policy rate)."""
        kv = await nc.jetstream().key_value(HEARTBEATS_BUCKET)
        while True:
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:  # end of the initial values
                        continue
                    if entry.operation in ("DEL", "PURGE"):
                        self._seen.pop(entry.key, None)  # an agent that says goodbye
                    elif beat_counts(entry.key, entry.value):
                        self._seen[entry.key] = utcnow()
                    else:  # junk or another node's id on a node's key: no heartbeat
                        logger.warning("heartbeat_refused", key=entry.key[:80], bytes=len(entry.value or b""))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken watch is re-made; nodes are not lost meanwhile
                logger.warning("heartbeat_watch_restarting", error=str(exc) or type(exc).__name__)
                self._seen = {k: utcnow() for k in self._seen}
                await asyncio.sleep(0.5)

    async def _policies(self) -> None:
        """Failed replicas not yet handled (e.g. failed while no controller ran), and heartbeats: a
        node whose heartbeat has not changed for longer than the grace is lost."""
        assert self.log is not None and self.committer is not None
        started = utcnow()
        while True:
            await asyncio.sleep(self.policy_interval_s)
            if self.snapshots is not None:
                self.snapshots.after_batch(self.state)  # by time: the log moved, then went quiet
            unplaced = False
            for r in list(self.state.replicas.values()):
                if r.state is ReplicaState.FAILED and r.desired is Level.HOT:
                    await self._on_failure(r.model_key, r.replica_id)
                elif r.state is ReplicaState.LOST and r.desired is Level.HOT:
                    unplaced = True
            if unplaced:
                self.place_unplaced_soon()  # level-triggered: not only on the event that freed room
            for model_key, m in list(self.state.models.items()):
                if m.rollout:  # level-triggered too: a rollout a stopped controller left mid-way goes on
                    await self._on_rollout(model_key)
            if self.nc is None:
                continue  # no heartbeats watched: silence means nothing
            now = utcnow()
            for node_id, node in list(self.state.nodes.items()):
                if not node.alive:
                    continue
                # Silence is counted from the last heartbeat, at the earliest from when this
                # controller started watching or the node joined.
                last = max(self._seen.get(node_token(node_id), started), node.joined_at or started)
                if (now - last).total_seconds() >= self.heartbeat_grace_s:
                    await self._node_lost(node_id)

    async def _node_lost(self, node_id: str) -> None:
        assert self.committer is not None
        cid = self._own(f"policy-node-lost-{node_token(node_id)}-{self.state.nodes[node_id].since_seq}")

        def run(state: ClusterState) -> list[Event]:
            ctx = DecisionContext(now=utcnow(), actor=self.name, command_id=cid, seed=seed_of(cid))
            return decide_node_lost(state, node_id, ctx, "heartbeat expired", min_deploy_s=self.min_deploy_s,
                                    headroom=self.headroom)

        with contextlib.suppress(NdifError):
            res = await self.committer.submit(run)
            if res.events:
                logger.warning("node_lost", node_id=node_id, events=len(res.events))


    # ---- autoscaling -------------------------------------------------------------------------

    async def _on_figures(self, msg: Msg) -> None:
        try:
            self.observe_figures(decode_figures(msg.data))
        except Exception as exc:  # noqa: BLE001 - untrusted bytes: this message is dropped, the next read
            logger.warning("figures_refused", subject=msg.subject[:200], error=str(exc)[:200])

    def observe_figures(self, f: QueueFigures, heard_at: float | None = None) -> None:
        """One dispatcher's figures of one model (kept until newer ones, or stale after FIGURES_STALE_S)."""
        self._figures.setdefault(f.model_key, {})[f.dispatcher] = (f, time.monotonic() if heard_at is None else heard_at)

    def figures_of(self, model_key: str, now: float | None = None) -> QueueFigures | None:
        """The sum of the fresh figures of every dispatcher that serves the model (None: none fresh)."""
        now = time.monotonic() if now is None else now
        heard = self._figures.get(model_key, {})
        for d in [d for d, (_, t) in heard.items() if now - t > FIGURES_STALE_S]:
            del heard[d]
        return sum_figures(model_key, [f for f, _ in heard.values()])

    async def _autoscale_loop(self) -> None:
        """Evaluate every autoscaled model's policy on a tick; a decision is appended through the
        committer under an id naming the model and the position of its last autoscale event, so
        several controllers append it once."""
        refused: dict[str, tuple[str, float]] = {}  # model -> (why its last decision was refused, retry after)
        while True:
            await asyncio.sleep(self.autoscale_interval_s)
            now = time.monotonic()
            for model_key, m in list(self.state.models.items()):
                if m.autoscale is None or m.autoscale_manual or refused.get(model_key, ("", 0.0))[1] > now:
                    continue
                try:
                    await self.autoscale(model_key)
                    refused.pop(model_key, None)
                except NdifError as exc:
                    # e.g. no live node meets the model's requirements: said once per reason, and the
                    # model is not asked again for a while (no committer turn on every tick)
                    if refused.get(model_key, ("",))[0] != str(exc):
                        logger.warning("autoscale_refused", model_key=model_key, error=type(exc).__name__,
                                       message=str(exc), retry_s=AUTOSCALE_REFUSED_RETRY_S)
                    refused[model_key] = (str(exc), now + AUTOSCALE_REFUSED_RETRY_S)

    async def autoscale(self, model_key: str) -> list[Event]:
        """One evaluation of a model's policy now; the events appended (none: nothing to do)."""
        assert self.committer is not None
        figures = self.figures_of(model_key)
        now = utcnow()
        if evaluate(self.state, model_key, figures, now) is None:
            return []  # the common case, decided without a turn of the committer

        def run(state: ClusterState) -> list[Event]:
            cid = self._own(decision_id(state, model_key, model_token(model_key)))
            ctx = DecisionContext(now=now, actor=self.name, command_id=cid, seed=seed_of(cid))
            return decide_autoscale(state, model_key, figures, ctx, min_deploy_s=self.min_deploy_s,
                                    headroom=self.headroom)

        res = await self.committer.submit(run)
        for e in res.events:
            if isinstance(e, AutoscaleDecided):
                self.autoscale_decisions += 1
                logger.info("autoscale_decided", model_key=model_key, rule=e.rule, current=e.current, target=e.target,
                            condition=e.condition, first_seq=res.first_seq)
        return list(res.events)



# Events after which a wanted-but-unplaced replica may fit: a node (re)joined, or memory was freed.
_ROOM_EVENTS = (NodeJoined, NodeDeclared, ReplicaUnloaded, ReplicaCached, ReplicaLoadFailed)


def _command_id_of(body: bytes) -> str:
    """The command id of a body that may not decode, so a refusal still names its command."""
    obj = decode_any(body, limit=MAX_COMMAND_BYTES, what="command")
    cid = obj.get("command_id", "") if isinstance(obj, dict) else ""
    return cid[:200] if isinstance(cid, str) else ""


def default_name() -> str:
    return f"controller:{socket.gethostname()}"


async def run_controller(url: str, **kw: Any) -> None:
    """Run a controller until cancelled (`ndif controller`)."""
    async with Controller.from_url(url, **kw):
        await asyncio.Event().wait()


