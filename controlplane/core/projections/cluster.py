"""The cluster view: nodes, GPU cards and their memory, models, every replica (docs/architecture.md §3-4, §7).

Memory follows the observed state: a card's reservations are a map replica -> bytes, rebuilt from
each replica's view whenever it changes, so a redelivered or out-of-order event can never count a
replica twice or drive a card negative.

The fold's own memory follows the cluster, not the history: command records are kept for the last
MAX_COMMANDS_KEPT commands, and a model keeps at most MAX_GONE_KEPT of its replicas that are gone
(Unloaded, holding nothing, not wanted HOT); older ones are forgotten, deterministically, so a
snapshot plus the tail folds exactly as the whole history does.
"""

from __future__ import annotations

from collections import deque
from datetime import datetime
from typing import NamedTuple, Self

import msgspec

from controlplane.core.inventory import admit
from controlplane.core.projections.base import Anomaly, Projection
from controlplane.core.projections.replica import OBSERVED_RULES, ReplicaView, step
from schemas.autoscale import AutoscalePolicy
from schemas.events import (
    AGENT_FACTS,
    DISPATCHER_FACTS,
    AutoscaleDecided,
    AutoscalePolicySet,
    ClusterDown,
    CommandDecided,
    DeploymentRequested,
    Event,
    GpuInfo,
    ModelRegistered,
    ModelUndeployed,
    NodeDeclared,
    NodeJoined,
    NodeLost,
    PlacementRejected,
    ReplicaCached,
    ReplicaDrained,
    ReplicaEvent,
    ReplicaEvictionRequested,
    ReplicaScheduled,
    ReplicaUnloaded,
    RolloutUpdated,
    author_problem,
)
from schemas.inventory import NodeInventory, Requirements
from schemas.status import DeploymentOp, Level, ModelStatus, ReplicaState
from schemas.units import gib

RKey = tuple[str, int]  # (model_key, replica_id)
CardKey = tuple[str, int]  # (node_id, gpu index)

_replace = msgspec.structs.replace
_LIVE = frozenset({ReplicaState.AVAILABLE})
_DEAD = frozenset({ReplicaState.FAILED, ReplicaState.LOAD_FAILED})


_AUTHORED = AGENT_FACTS | DISPATCHER_FACTS

SNAPSHOT_SCHEMA = 5  # of ClusterSnapshot: a snapshot of another schema is never loaded (folded anew instead)
# Commands whose records (the idempotency of a command id, its events' positions) are kept: a
# command id sent again after this many newer commands is decided anew.
MAX_COMMANDS_KEPT = 10_000
# Gone replicas (Unloaded, no GPU or CPU bytes, not desired HOT) kept per model for `ndif status`
# and the dashboard; past that the oldest (by the seq it left at, then id) is forgotten. Replica ids
# are never reused, so a late report about a forgotten one is recognised by its id.
MAX_GONE_KEPT = 16
# What an Unloaded replica does with these: nothing (a late or repeated report).
_NOOP_WHEN_GONE = frozenset({ReplicaUnloaded, ReplicaEvictionRequested, ReplicaDrained})


class NodeView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A node as placement sees it: `gpus` and `cpu_cache_bytes` are its capacity, what was admitted of
    its agent's report (controlplane/core/inventory.py)."""

    node_id: str
    gpus: tuple[GpuInfo, ...]
    cpu_cache_bytes: int
    hostname: str = ""
    ray_node_id: str = ""
    alive: bool = True
    joined_at: datetime | None = None
    since_seq: int = 0
    labels: dict[str, str] = {}  # the operator's, from its inventory
    # The agent's own report, kept while an inventory is in force so that a later declaration is
    # checked against it again (None: no inventory when it joined; `gpus` is the report, bounded).
    reported: tuple[GpuInfo, ...] | None = None
    reported_cpu_cache_bytes: int | None = None

    @property
    def max_card_bytes(self) -> int:
        return max((g.memory_bytes for g in self.gpus), default=0)


class NodeFree(NamedTuple):
    card_bytes: int  # the node's largest card
    free: tuple[int, ...]  # total - committed bytes of each card, largest first
    min_footprint: int  # smallest total bytes (all its cards) of a replica on the node's GPUs; 0 if none
    # Total bytes (all its cards) of each replica on the node's GPUs, smallest first: placement's
    # lower bound on a node's evictions reads it without visiting the replicas.
    footprints: tuple[int, ...] = ()
    # Placement's memo of what it derives from this summary alone (its eviction lower bound per
    # replica shape): a pure function of the fields above, dropped with them when a card changes.
    memo: dict[object, object] | None = None


class Registration(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where a model loads from and how big it is: what `ModelRegistered` records.

    The one registration type: the controller resolves one offline for a model not yet in the log
    (controlplane/service/registry.py; `seq` 0), decide() records it, and the fold keeps it with the seq of
    its `ModelRegistered`.
    """

    checkpoint: str
    revision: str | None = None
    size_bytes: int
    dtype: str = "float32"
    seq: int = 0  # of its ModelRegistered; 0: resolved, not yet in the log


class RejectionView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    seq: int
    needed_bytes: int
    free_bytes: int
    replicas: int
    reason: str


class Outage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A span the cluster was off (`ClusterDown` at `seq`)."""

    seq: int
    down_from: datetime
    up_at: datetime


MAX_OUTAGES = 200  # the newest outages the fold keeps (each one a restart after a gap)


class ModelView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    model_key: str
    registration: Registration | None = None
    target_hot: int = 0
    dedicated: bool = False
    next_replica_id: int = 0  # ids are never reused: new ones come after the highest ever used
    last_rejection: RejectionView | None = None
    since_seq: int = 0
    headroom: float | None = None  # charged over the size; None: never recorded (the controller's default)
    gpus: int | None = None  # cards per replica; None: as few as hold the charge
    requires: Requirements | None = None  # what a node must offer to hold its replicas (None: any node)
    undeployed: bool = False  # `ndif undeploy`: forgotten once its last replica is Unloaded
    # A rolling restart under way: replicas still to restart, and the one restarted last.
    rollout: tuple[int, ...] = ()
    rollout_current: int | None = None
    # Autoscaling: the policy (None: off); `autoscale_manual` once an operator set the count by
    # hand since the policy was set (the autoscaler then leaves it alone); the autoscaler's own
    # state, from its last AutoscaleDecided: the condition it watches and since when, the time it
    # last changed the count, its command id (so its own DeploymentRequested is not taken for
    # a manual one), and the seq of the last autoscale event (the position its decisions' ids name).
    autoscale: AutoscalePolicy | None = None
    autoscale_manual: bool = False
    autoscale_condition: str = ""
    autoscale_since: datetime | None = None
    autoscale_last_at: datetime | None = None
    autoscale_cid: str = ""
    autoscale_seq: int = 0
    autoscale_scaled_seq: int = 0  # seq of its last decision that changed the count
    # Idle is counted from here at the earliest: the policy's setting, an operator's (or a
    # dispatcher's provisioning) change of the count under it, the autoscaler's own last raise.
    # Figures older than any of these do not show what the operator or the new count meant.
    autoscale_idle_from: datetime | None = None
    # The user whose request had it deployed (on demand; "" on an open server), until an operator
    # deploys or scales it; None: the operator's.
    on_demand_for: str | None = None


class CommandRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where a command's decision sits in the log: its events are first_seq..last_seq."""

    command_id: str
    first_seq: int
    last_seq: int
    events: int
    verb: str = ""  # from its CommandDecided (absent in logs written before it existed)
    fingerprint: str = ""  # schemas.commands.fingerprint of what it asked ("" = unknown)


class CardUsage(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    index: int
    total_bytes: int
    reserved_bytes: int  # every replica placed on the card, loading or loaded, leaving or not
    committed_bytes: int  # replicas meant to stay HOT (placement plans against this)
    used_bytes: int  # replicas that are loaded (HOT)
    replicas: tuple[tuple[str, int, int], ...]  # (model_key, replica_id, bytes)

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.committed_bytes


class ClusterSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """The whole cluster view as data: what snapshots store and what equality compares.

    Lists are sorted by key, except `event_ids`: the id window in the order it was filled (the
    oldest is forgotten first)."""

    kind: str = "cluster"
    schema: int = SNAPSHOT_SCHEMA
    seq: int
    skipped: int
    nodes: list[NodeView]
    models: list[ModelView]
    replicas: list[ReplicaView]
    commands: list[CommandRecord]
    anomalies: list[Anomaly]
    anomaly_count: int
    event_ids: list[str]
    undeployed: list[str] = []  # models forgotten by `ndif undeploy` (late events of theirs are ignored)
    declared: dict[str, NodeInventory] = {}  # the operator's inventory (`NodeDeclared`), by node id
    last_event_id: str = ""  # of the stored event at `seq` ("" when unreadable)
    max_ts: datetime | None = None  # the latest event time folded
    outages: list[Outage] = []  # the newest MAX_OUTAGES spans the cluster was off (`ClusterDown`)


class ClusterState(Projection):
    """Fold of NDIF_EVENTS into the cluster placement view."""

    __slots__ = ("_by_model", "_card_leaving", "_card_totals", "_cards", "_cpu", "_cpu_kept", "_cpu_pending_total", "_gone",
                 "_live_nodes", "_node_free", "commands", "declared", "models", "nodes", "outages", "replicas",
                 "undeployed")

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, NodeView] = {}
        self.models: dict[str, ModelView] = {}
        self.replicas: dict[RKey, ReplicaView] = {}
        self.commands: dict[str, CommandRecord] = {}
        self.undeployed: set[str] = set()  # models forgotten by undeploy (until deployed again)
        # The operator's inventory, node id -> what it may offer; empty: none declared yet, so the
        # agents' reports are capacity as they are (bounded).
        self.declared: dict[str, NodeInventory] = {}
        self.outages: list[Outage] = []  # oldest first, the newest MAX_OUTAGES
        # Derived indexes (not in snapshots): replica -> bytes per card and per node CPU cache.
        self._cards: dict[CardKey, dict[RKey, int]] = {}
        self._card_totals: dict[CardKey, int] = {}  # sum of _cards[k], kept alongside for O(1) reads
        # Part of that held by replicas asked to leave (desired WARM/COLD, still on the card).
        self._card_leaving: dict[CardKey, int] = {}
        self._cpu: dict[str, dict[RKey, int]] = {}
        self._cpu_kept: dict[str, int] = {}  # node -> sum of its _cpu bytes not ordered down to COLD
        # Replicas ordered to WARM, still on their cards (not yet `Cached`): node -> the bytes they
        # will take in its CPU cache (their GPU footprint), committed like GPU bytes. A replica's
        # share is derived from its view (`_promised`), so only the total is kept.
        self._cpu_pending_total: dict[str, int] = {}
        self._by_model: dict[str, dict[int, None]] = {}  # model -> replica ids (insertion-ordered set)
        self._gone: dict[str, set[int]] = {}  # model -> ids of its gone replicas (see MAX_GONE_KEPT)
        # node -> free (total - committed) bytes of its cards, largest first; computed on demand and
        # dropped whenever a card of the node changes. Lets placement skip full nodes in O(1).
        self._node_free: dict[str, NodeFree] = {}
        self._live_nodes: list[NodeView] | None = None  # live_nodes(), dropped on every node event

    # ---- the reducer -------------------------------------------------------------------------

    def _evolve(self, seq: int, ev: Event) -> None:
        if ev.__class__ in _AUTHORED:
            problem = author_problem(ev)
            if problem is not None:  # a forged or misdirected fact: refused (not even its command id), and flagged
                self._anomaly(seq, ev, problem, getattr(ev, "replica_id", None))
                return
        cid = ev.command_id
        if cid is not None:
            commands = self.commands
            rec = commands.get(cid)
            if rec is None:
                commands[cid] = CommandRecord(command_id=cid, first_seq=seq, last_seq=seq, events=1)
                if len(commands) > MAX_COMMANDS_KEPT:  # insertion order is first_seq order: the oldest goes
                    del commands[next(iter(commands))]
            else:
                commands[cid] = _replace(rec, last_seq=seq, events=rec.events + 1)
            if ev.__class__ is CommandDecided and not self.commands[cid].fingerprint:
                self.commands[cid] = _replace(self.commands[cid], verb=ev.verb,  # type: ignore[attr-defined]
                                              fingerprint=ev.fingerprint)  # type: ignore[attr-defined]
        rule = OBSERVED_RULES.get(ev.__class__)
        if rule is not None:
            # Hot path (most stored events): an observed event for a known replica from its own
            # node goes straight to its rule; everything else takes `step`, which words anomalies.
            key: RKey = (ev.model_key, ev.replica_id)  # type: ignore[attr-defined,assignment]
            old = self.replicas.get(key)
            if old is not None and (not ev.node_id or not old.node_id or ev.node_id == old.node_id):  # type: ignore[attr-defined]
                new, anomaly = rule(old, ev, seq, old.state)
                if anomaly:
                    self._anomaly(seq, ev, anomaly, old.replica_id)
                if new is not old:
                    self._put(key, new)
                    if ev.__class__ in _CPU_EVENTS:
                        self._check_cpu(seq, ev, new)
                    if new.state is ReplicaState.UNLOADED:
                        self._sweep(key[0], key)
                return
        if isinstance(ev, ReplicaEvent):
            self._replica_event(seq, ev)
            return
        if isinstance(ev, NodeJoined | NodeDeclared | NodeLost):
            self._live_nodes = None
        match ev:
            case NodeJoined():
                self._node_free.pop(ev.node_id, None)  # a node may re-join with other cards
                enforced = bool(self.declared)
                got = admit(ev.node_id, tuple(ev.gpus), ev.cpu_cache_bytes, self.declared.get(ev.node_id), enforced)
                if got.problems:
                    self._anomaly(seq, ev, f"inventory of {ev.node_id!r}: {'; '.join(got.problems)}")
                self.nodes[ev.node_id] = NodeView(
                    node_id=ev.node_id, gpus=got.gpus, cpu_cache_bytes=got.cpu_cache_bytes,
                    hostname=ev.hostname, ray_node_id=ev.ray_node_id, alive=True, joined_at=ev.ts, since_seq=seq,
                    labels=got.labels, reported=tuple(ev.gpus) if enforced else None,
                    reported_cpu_cache_bytes=ev.cpu_cache_bytes if enforced else None,
                )
            case ClusterDown():
                self.outages = [*self.outages[-(MAX_OUTAGES - 1):],
                                Outage(seq=seq, down_from=ev.down_from, up_at=ev.up_at)]
            case NodeDeclared():
                first = not self.declared
                self.declared[ev.node_id] = ev.node
                # The first declaration puts every node under the inventory; a later one, its own node.
                for node_id in (sorted(self.nodes) if first else [ev.node_id] if ev.node_id in self.nodes else []):
                    self._readmit(seq, ev, node_id)
            case NodeLost():
                node = self.nodes.get(ev.node_id)
                if node is None:
                    self._anomaly(seq, ev, f"NodeLost for unknown node {ev.node_id!r}")
                    return
                self.nodes[ev.node_id] = _replace(node, alive=False, since_seq=seq)
                for key, r in list(self.replicas.items()):
                    if r.node_id == ev.node_id and (r.on_gpu or r.cpu_bytes or r.state not in _GONE):
                        self._put(key, _replace(r, state=ReplicaState.LOST, on_gpu=False, cpu_bytes=0,
                                                since_seq=seq, error=f"node lost: {ev.reason}"))
            case ModelRegistered():
                self.undeployed.discard(ev.model_key)
                m = self._model(ev.model_key)
                if m.registration is not None:
                    if m.registration.size_bytes != ev.size_bytes or m.registration.checkpoint != ev.checkpoint:
                        self._anomaly(seq, ev, "ModelRegistered again with a different checkpoint or size; first kept")
                    return
                reg = Registration(checkpoint=ev.checkpoint, revision=ev.revision, size_bytes=ev.size_bytes,
                                   dtype=ev.dtype, seq=seq)
                self.models[ev.model_key] = _replace(m, registration=reg, since_seq=seq)
            case DeploymentRequested():
                self.undeployed.discard(ev.model_key)
                m = self._model(ev.model_key)
                self.models[ev.model_key] = _replace(
                    m, target_hot=ev.target_hot, dedicated=ev.dedicated, since_seq=seq,
                    headroom=m.headroom if ev.headroom is None else ev.headroom,
                    gpus=m.gpus if ev.gpus is None else ev.gpus,
                    requires=ev.requires if isinstance(ev.requires, Requirements) else m.requires,
                    autoscale_idle_from=(ev.ts if m.autoscale is not None and ((ev.command_id or "") != m.autoscale_cid
                                                                              or ev.target_hot > m.target_hot)
                                         else m.autoscale_idle_from),
                    # an operator's deploy/scale/scale-down of an autoscaled model: its count stands
                    # (a dispatcher's provisioning deploy of a model at zero is not an operator's)
                    autoscale_manual=m.autoscale_manual or (m.autoscale is not None
                                                            and (ev.command_id or "") != m.autoscale_cid
                                                            and not ev.actor.startswith("dispatcher:")),
                    on_demand_for=_on_demand_for(m, ev))
            case AutoscalePolicySet():
                m = self._model(ev.model_key)
                self.models[ev.model_key] = _replace(m, autoscale=ev.policy, autoscale_manual=False,
                                                     autoscale_condition="", autoscale_since=None,
                                                     autoscale_seq=seq, autoscale_idle_from=ev.ts)
            case AutoscaleDecided():
                m = self._model(ev.model_key)
                scaled = ev.target != ev.current
                self.models[ev.model_key] = _replace(
                    m, autoscale_condition=ev.condition, autoscale_since=ev.since if ev.condition else None,
                    autoscale_last_at=ev.ts if scaled else m.autoscale_last_at, autoscale_cid=ev.command_id or "",
                    autoscale_seq=seq, autoscale_scaled_seq=seq if scaled else m.autoscale_scaled_seq,
                    autoscale_idle_from=ev.ts if ev.target > ev.current else m.autoscale_idle_from)
            case PlacementRejected():
                m = self._model(ev.model_key)
                rej = RejectionView(seq=seq, needed_bytes=ev.needed_bytes, free_bytes=ev.free_bytes,
                                    replicas=ev.replicas, reason=ev.reason)
                self.models[ev.model_key] = _replace(m, last_rejection=rej, since_seq=seq)
            case CommandDecided():
                pass  # its record is kept above
            case RolloutUpdated():
                m = self._model(ev.model_key)
                self.models[ev.model_key] = _replace(m, rollout=ev.remaining,
                                                     rollout_current=ev.current,
                                                     since_seq=seq)
            case ModelUndeployed():
                known = self.models.get(ev.model_key)
                if known is None:
                    self._anomaly(seq, ev, "ModelUndeployed for a model that is not deployed")
                    return
                self.models[ev.model_key] = _replace(known, undeployed=True, target_hot=0, since_seq=seq)
                self._sweep(ev.model_key)
            case _:
                self._anomaly(seq, ev, f"no cluster rule for {type(ev).__name__}")

    def _replica_event(self, seq: int, ev: ReplicaEvent) -> None:
        key = (ev.model_key, ev.replica_id)
        old = self.replicas.get(key)
        if old is None and not isinstance(ev, ReplicaScheduled):
            if ev.model_key in self.undeployed:
                return  # a late report about a replica of a model undeploy has forgotten
            m = self.models.get(ev.model_key)
            if m is not None and ev.replica_id < m.next_replica_id:
                if ev.__class__ not in _NOOP_WHEN_GONE:
                    self._anomaly(seq, ev, f"{type(ev).__name__} for replica {ev.replica_id}, which was unloaded and "
                                  f"forgotten (a model keeps its last {MAX_GONE_KEPT} unloaded replicas)",
                                  ev.replica_id)
                return  # a late report about a replica unloaded long ago: nothing left to change
        if isinstance(ev, ReplicaScheduled):
            self.undeployed.discard(ev.model_key)
            problem = self._check_placement(ev)
            if problem:
                self._anomaly(seq, ev, problem, ev.replica_id)
                return
            m = self._model(ev.model_key)
            if ev.replica_id >= m.next_replica_id:
                self.models[ev.model_key] = _replace(m, next_replica_id=ev.replica_id + 1)
        new, anomaly = step(old, ev, seq)
        if anomaly:
            self._anomaly(seq, ev, anomaly, ev.replica_id)
        if new is not old and new is not None:
            self._put(key, new)
            if isinstance(ev, ReplicaScheduled):
                self._check_overcommit(seq, ev)
            elif ev.__class__ in _CPU_EVENTS:
                self._check_cpu(seq, ev, new)
            if new.state is ReplicaState.UNLOADED:
                self._sweep(ev.model_key, key)

    def _sweep(self, model_key: str, key: RKey | None = None) -> None:
        """Undeploy: forget the model's Unloaded replicas (one, or all), and the model once none is left."""
        m = self.models.get(model_key)
        if m is None or not m.undeployed:
            return
        ids = self._by_model.get(model_key, {})
        for k in [key] if key is not None else [(model_key, i) for i in ids]:
            r = self.replicas.get(k)
            if r is not None and r.state is ReplicaState.UNLOADED and not r.on_gpu and not r.cpu_bytes:
                del self.replicas[k]
                ids.pop(k[1], None)
                self._gone.get(model_key, set()).discard(k[1])
        if not ids:
            self._by_model.pop(model_key, None)
            self._gone.pop(model_key, None)
            del self.models[model_key]
            self.undeployed.add(model_key)

    def _readmit(self, seq: int, ev: Event, node_id: str) -> None:
        """Check a joined node's report again against the inventory as it is now."""
        node = self.nodes[node_id]
        gpus = node.reported if node.reported is not None else node.gpus
        cpu = node.reported_cpu_cache_bytes if node.reported_cpu_cache_bytes is not None else node.cpu_cache_bytes
        got = admit(node_id, gpus, cpu, self.declared.get(node_id), True)
        if got.problems:
            self._anomaly(seq, ev, f"inventory of {node_id!r}: {'; '.join(got.problems)}")
        self._node_free.pop(node_id, None)
        self.nodes[node_id] = _replace(node, gpus=got.gpus, cpu_cache_bytes=got.cpu_cache_bytes, labels=got.labels,
                                       reported=gpus, reported_cpu_cache_bytes=cpu)

    def _check_placement(self, ev: ReplicaScheduled) -> str | None:
        node = self.nodes.get(ev.node_id)
        if node is None:
            return f"scheduled on unknown node {ev.node_id!r}"
        if not node.alive:
            return f"scheduled on lost node {ev.node_id!r}"
        have = {g.index for g in node.gpus}
        missing = [i for i in ev.gpu_indices if i not in have]
        if missing or not ev.gpu_indices:
            return f"scheduled on GPUs {list(ev.gpu_indices)} but node {ev.node_id!r} has {sorted(have)}"
        return None

    def _check_overcommit(self, seq: int, ev: ReplicaScheduled) -> None:
        gpus = self.nodes[ev.node_id].gpus  # placement was checked: the node and cards exist
        for g in gpus:
            if g.index in ev.gpu_indices:
                committed = self.card_committed(ev.node_id, g.index)
                if committed > g.memory_bytes:
                    self._anomaly(seq, ev, f"GPU {g.index} of {ev.node_id!r} over-committed: "
                                  f"{gib(committed)} committed of {gib(g.memory_bytes)}", ev.replica_id)

    def _check_cpu(self, seq: int, ev: ReplicaEvent, r: ReplicaView) -> None:
        """A node's CPU cache holding (or committed to) more than its budget is an anomaly: a node
        out of host RAM kills every replica on it."""
        node = self.nodes.get(r.node_id)
        if node is None or not (r.cpu_bytes or _pending_warm(r)):
            return
        committed = self.cpu_committed(r.node_id)
        if committed > node.cpu_cache_bytes:
            self._anomaly(seq, ev, f"CPU cache of {r.node_id!r} over-committed: {gib(committed)} committed of "
                          f"{gib(node.cpu_cache_bytes)}", r.replica_id)

    def _model(self, model_key: str) -> ModelView:
        m = self.models.get(model_key)
        if m is None:
            m = self.models[model_key] = ModelView(model_key=model_key)
        return m

    def _put(self, key: RKey, new: ReplicaView) -> None:
        """Store a replica view and move its memory in the indexes: set, never add."""
        old = self.replicas.get(key)
        self.replicas[key] = new
        self._move(key, old, new)
        if new.state is _UNLOADED and _gone(new):
            if old is None or not _gone(old):
                self._forget_gone(key)
        elif old is not None and old.state is _UNLOADED:
            gone = self._gone.get(key[0])
            if gone:
                gone.discard(key[1])

    def _move(self, key: RKey, old: ReplicaView | None, new: ReplicaView) -> None:
        """Move a replica's memory in the indexes from its `old` view to its `new` one."""
        if old is None:
            self._by_model.setdefault(key[0], {})[key[1]] = None
        elif (old.on_gpu == new.on_gpu and old.cpu_bytes == new.cpu_bytes and old.node_id == new.node_id
              and old.gpu_indices == new.gpu_indices and old.bytes_per_gpu == new.bytes_per_gpu
              and old.desired is new.desired):
            return  # same footprint (most transitions): the indexes already hold it
        else:
            if _pending_warm(old):
                self._cpu_pending_total[old.node_id] -= _promised(old)
            if old.on_gpu:
                self._node_free.pop(old.node_id, None)
                leaving = old.desired is not Level.HOT
                for g in old.gpu_indices:
                    ck = (old.node_id, g)
                    card = self._cards.get(ck)
                    if card is not None and key in card:
                        b = card.pop(key)
                        self._card_totals[ck] -= b
                        if leaving:
                            self._card_leaving[ck] -= b
            if old.cpu_bytes:
                held = self._cpu.get(old.node_id, {}).pop(key, None)
                if held is not None and old.desired is not Level.COLD:
                    self._cpu_kept[old.node_id] -= held
        if new.on_gpu:
            self._node_free.pop(new.node_id, None)
            leaving = new.desired is not Level.HOT
            for g in new.gpu_indices:
                ck = (new.node_id, g)
                card = self._cards.setdefault(ck, {})
                if key in card:  # cannot happen after the removal above; kept exact regardless
                    self._card_totals[ck] -= card[key]
                card[key] = new.bytes_per_gpu
                self._card_totals[ck] = self._card_totals.get(ck, 0) + new.bytes_per_gpu
                if leaving:
                    self._card_leaving[ck] = self._card_leaving.get(ck, 0) + new.bytes_per_gpu
        if new.cpu_bytes:
            # (the old view's bytes left both maps above; a new replica had none)
            self._cpu.setdefault(new.node_id, {})[key] = new.cpu_bytes
            if new.desired is not Level.COLD:
                self._cpu_kept[new.node_id] = self._cpu_kept.get(new.node_id, 0) + new.cpu_bytes
        if _pending_warm(new):
            self._cpu_pending_total[new.node_id] = self._cpu_pending_total.get(new.node_id, 0) + _promised(new)

    def _forget_gone(self, key: RKey) -> None:
        """The replica at `key` just became gone: past MAX_GONE_KEPT of its model, forget the oldest gone one.

        The oldest by (seq it left at, replica id): a rule of the views alone, so a fold restored
        from a snapshot forgets exactly what the whole history's fold does."""
        gone = self._gone.setdefault(key[0], set())
        gone.add(key[1])
        if len(gone) <= MAX_GONE_KEPT:
            return
        mk = key[0]
        rid = min(gone, key=lambda i: (self.replicas[(mk, i)].since_seq, i))
        gone.discard(rid)
        del self.replicas[(mk, rid)]  # gone: it holds no card or CPU bytes, so no index has it
        ids = self._by_model.get(mk)
        if ids is not None:
            ids.pop(rid, None)

    # ---- reads -------------------------------------------------------------------------------

    def node_cards(self, node_id: str) -> list[CardUsage]:
        node = self.nodes.get(node_id)
        if node is None:
            return []
        out = []
        for g in node.gpus:
            card = self._cards.get((node_id, g.index), {})
            used = sum(b for k, b in card.items() if self.replicas[k].level is Level.HOT)
            out.append(CardUsage(
                node_id=node_id, index=g.index, total_bytes=g.memory_bytes, reserved_bytes=sum(card.values()),
                committed_bytes=self.card_committed(node_id, g.index),
                used_bytes=used, replicas=tuple(sorted((k[0], k[1], b) for k, b in card.items())),
            ))
        return out

    def card_reserved(self, node_id: str, index: int) -> int:
        """Bytes physically held or being loaded on a card (replicas on their way out included)."""
        return self._card_totals.get((node_id, index), 0)

    def card_committed(self, node_id: str, index: int) -> int:
        """Bytes of replicas meant to stay HOT on a card: what placement plans against.

        A replica asked to leave still occupies the card until its agent unloads it; the agent
        unloads before it loads anything new onto the same cards.
        """
        ck = (node_id, index)
        return self._card_totals.get(ck, 0) - self._card_leaving.get(ck, 0)

    def node_free(self, node_id: str) -> NodeFree:
        """The node's capacity summary placement scans with (cached until one of its cards changes)."""
        got = self._node_free.get(node_id)
        if got is None:
            node = self.nodes[node_id]
            seen = {k: b * len(self.replicas[k].gpu_indices) for g in node.gpus
                    for k, b in self._cards.get((node_id, g.index), {}).items()}
            footprints = sorted(seen.values())
            got = NodeFree(
                card_bytes=max((g.memory_bytes for g in node.gpus), default=0),
                free=tuple(sorted((g.memory_bytes - self.card_committed(node_id, g.index) for g in node.gpus),
                                  reverse=True)),
                min_footprint=min(footprints, default=0),
                footprints=tuple(footprints),
                memo={},
            )
            self._node_free[node_id] = got
        return got

    def card_replicas(self, node_id: str, index: int) -> dict[RKey, int]:
        """Replicas holding memory on a card, with their bytes there (read-only view)."""
        return self._cards.get((node_id, index), {})

    def cpu_replicas(self, node_id: str) -> dict[RKey, int]:
        return self._cpu.get(node_id, {})

    def cpu_cached(self, node_id: str) -> int:
        return sum(self._cpu.get(node_id, {}).values())

    def cpu_pending(self, node_id: str) -> int:
        """CPU cache bytes of replicas ordered to WARM on the node but not yet `Cached`."""
        return self._cpu_pending_total.get(node_id, 0)

    def cpu_committed(self, node_id: str) -> int:
        """What the node's CPU cache holds and keeps, plus what it was promised: what placement plans
        against. Copies ordered down to COLD are leaving (as on a card, the agent unloads them
        before it caches anything new)."""
        return self._cpu_kept.get(node_id, 0) + self._cpu_pending_total.get(node_id, 0)

    def live_nodes(self) -> list[NodeView]:
        """Live nodes with GPUs, sorted by id (placement's scan order before its rotation); kept
        until the next node event, so a decision does not sort a large fleet again."""
        if self._live_nodes is None:
            self._live_nodes = [n for _, n in sorted(self.nodes.items()) if n.alive and n.gpus]
        return self._live_nodes

    def model_replicas(self, model_key: str) -> list[ReplicaView]:
        """Every replica of a model ever scheduled, by replica id."""
        return [self.replicas[(model_key, i)] for i in sorted(self._by_model.get(model_key, ()))]

    def replica_count(self, model_key: str) -> int:
        """The replica count of a model: replicas whose desired level is HOT."""
        replicas = self.replicas
        return sum(1 for i in self._by_model.get(model_key, ()) if replicas[(model_key, i)].desired is Level.HOT)

    def model_status(self, model_key: str, min_ready: int = 1) -> ModelStatus:
        """The model's status, derived from its replicas (Available once min(`min_ready`, its target) serve)."""
        m = self.models.get(model_key)
        if m is not None and m.undeployed:
            return ModelStatus.UNDEPLOYING
        hot = [r for r in self.model_replicas(model_key) if r.desired is Level.HOT]
        if m is None:
            return ModelStatus.SCALED_DOWN
        if not hot:
            # No replica is meant to be on a GPU: nothing is in progress. A placement the cluster
            # refused since the last request for it is a failure; otherwise the model is scaled
            # down (every replica evicted, or none asked for), whatever count was asked before.
            if m.target_hot and m.last_rejection is not None and m.last_rejection.seq >= m.since_seq:
                return ModelStatus.FAILED
            return ModelStatus.SCALED_DOWN
        ready = sum(1 for r in hot if r.state in _LIVE)
        if ready >= max(1, min(min_ready, m.target_hot or 1)):
            return ModelStatus.AVAILABLE
        if all(r.state in _DEAD for r in hot):
            return ModelStatus.FAILED
        return ModelStatus.PROGRESSING

    # ---- snapshots, equality, copies ---------------------------------------------------------

    def to_snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            seq=self.seq,
            skipped=self.skipped,
            nodes=[self.nodes[k] for k in sorted(self.nodes)],
            models=[self.models[k] for k in sorted(self.models)],
            replicas=[self.replicas[k] for k in sorted(self.replicas)],
            commands=[self.commands[k] for k in sorted(self.commands)],
            anomalies=list(self.anomalies),
            anomaly_count=self.anomaly_count,
            event_ids=list(self.id_order),
            undeployed=sorted(self.undeployed),
            declared={k: self.declared[k] for k in sorted(self.declared)},
            last_event_id=self.last_event_id,
            max_ts=self.max_ts,
            outages=list(self.outages),
        )

    @classmethod
    def from_snapshot(cls, snap: ClusterSnapshot) -> ClusterState:
        s = cls()
        s.seq, s.skipped = snap.seq, snap.skipped
        s.nodes = {n.node_id: n for n in snap.nodes}
        s.models = {m.model_key: m for m in snap.models}
        # Insertion order is first_seq order (the oldest record is forgotten first).
        s.commands = {c.command_id: c for c in sorted(snap.commands, key=lambda c: c.first_seq)}
        s.anomalies, s.anomaly_count = list(snap.anomalies), snap.anomaly_count
        s.id_order = deque(snap.event_ids)
        s.event_ids = set(snap.event_ids)
        s.last_event_id, s.max_ts = snap.last_event_id, snap.max_ts
        s.undeployed = set(snap.undeployed)
        s.declared = dict(snap.declared)
        s.outages = list(snap.outages)
        for r in snap.replicas:
            s._put(r.key, r)
        return s

    def copy(self) -> Self:
        c = type(self)()
        self._copy_base(c)
        c.nodes, c.models, c.replicas = dict(self.nodes), dict(self.models), dict(self.replicas)
        c.commands = dict(self.commands)
        c.undeployed = set(self.undeployed)
        c.declared = dict(self.declared)
        c.outages = list(self.outages)
        c._cards = {k: dict(v) for k, v in self._cards.items()}
        c._card_totals = dict(self._card_totals)
        c._card_leaving = dict(self._card_leaving)
        c._cpu = {k: dict(v) for k, v in self._cpu.items()}
        c._cpu_kept = dict(self._cpu_kept)
        c._cpu_pending_total = dict(self._cpu_pending_total)
        c._by_model = {k: dict(v) for k, v in self._by_model.items()}
        c._gone = {k: set(v) for k, v in self._gone.items()}
        c._node_free = dict(self._node_free)
        return c

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterState) and self.to_snapshot() == other.to_snapshot()

    __hash__ = None  # type: ignore[assignment]


_GONE = frozenset({ReplicaState.UNLOADED, ReplicaState.LOST})
_UNLOADED = ReplicaState.UNLOADED
_CPU_EVENTS = frozenset({ReplicaCached, ReplicaEvictionRequested})  # events that can grow a CPU cache


def _gone(r: ReplicaView) -> bool:
    """Unloaded, holding nothing and not wanted HOT: kept only for the record (MAX_GONE_KEPT)."""
    return r.state is ReplicaState.UNLOADED and not r.on_gpu and not r.cpu_bytes and r.desired is not Level.HOT


def _promised(r: ReplicaView) -> int:
    """The CPU cache bytes a replica ordered to WARM will take: its GPU footprint."""
    return r.bytes_per_gpu * len(r.gpu_indices)


def _pending_warm(r: ReplicaView) -> bool:
    """Ordered to WARM and still on its cards: its bytes are promised to the node's CPU cache."""
    return r.on_gpu and r.desired is Level.WARM and not r.cpu_bytes

_snapshot_encoder = msgspec.json.Encoder()
_snapshot_decoder = msgspec.json.Decoder(ClusterSnapshot)


def encode_snapshot(state: ClusterState) -> bytes:
    return _snapshot_encoder.encode(state.to_snapshot())


def decode_snapshot(data: bytes) -> ClusterState:
    return ClusterState.from_snapshot(_snapshot_decoder.decode(data))


def _on_demand_for(m: ModelView, ev: DeploymentRequested) -> str | None:
    """Whose request the model is deployed for after `ev`: its user when on demand; None once an
    operator deploys or scales it up; else unchanged (a scale-down, the autoscaler, the dispatcher
    bringing an operator's model back)."""
    if isinstance(ev.for_user, str):
        return ev.for_user
    grows = ev.op in (DeploymentOp.DEPLOY, DeploymentOp.SCALE, DeploymentOp.SCALE_UP)
    if grows and (ev.command_id or "") != m.autoscale_cid and not ev.actor.startswith("dispatcher:"):
        return None
    return m.on_demand_for
