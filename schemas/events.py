"""Every control-plane fact, as frozen msgspec Structs in one tagged union (docs/architecture.md §3).

The tag (`"type"` in JSON) is written out explicitly on every class: renaming a class must never
orphan stored history. New fields get defaults; a field's Python type never changes. Schema version
1. Model keys are written as fields (`ModelRef`) and read in either form (`_WireModelKey`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, Union

import msgspec

from schemas.autoscale import AutoscalePolicy, QueueFigures
from schemas.errors import InvalidCommand
from schemas.guard import MAX_DEPTH, body_problem
from schemas.inventory import NodeInventory, Requirements
from schemas.keys import model_parts
from schemas.status import DeploymentOp, DrainReason, EvictionReason, Level
from schemas.subjects import (
    COMMAND_EVENTS_PREFIX,
    FACTS_STREAM,
    HDR_EVENT,
    HDR_MSG_ID,
    HDR_SCHEMA,
    NODE_EVENTS_PREFIX,
    REPLICA_EVENTS_PREFIX,
    command_event_subject,
    is_fact_subject,
    model_subject,
    node_subject,
    node_token,
    replica_subject,
)

SCHEMA_VERSION: Final = 1
MAX_BATCH: Final = 1000  # JetStream atomic batch limit (err 10199 above it)
MAX_EVENT_BYTES: Final = 64 * 1024  # the event stream's `max_msg_size`: no stored event is larger


# ---- model keys on the wire -------------------------------------------------------------------


class _AnyStr(type):
    __instancecheck__ = str.__instancecheck__  # isinstance(x, cls) is isinstance(x, str), checked in C


class _WireModelKey(metaclass=_AnyStr):
    """The wire type of a model key field; in Python the field holds the canonical key, a plain `str`.

    On the wire a canonical key is an object, `{"class": ..., "repo_id": ..., "revision": ...}`
    (`class` left out when it is `WIRE_DEFAULT_CLASS`, `revision` when null), so `nats stream view` and `jq .model_key.repo_id` read it as
    fields. A string is accepted too and kept exactly as stored: events written before this
    encoding, and keys that are not canonical or carry kwargs other than repo_id/revision.
    msgspec hands a field of this (custom) type to `model_key_hook` and checks that what it returns
    `isinstance` the type: the metaclass makes every `str` pass.
    """


if TYPE_CHECKING:
    ModelKey = str
else:
    ModelKey = _WireModelKey


# What a stored ref without "class" means. Frozen with the wire format: it must never follow a change
# of schemas.keys.DEFAULT_MODEL_CLASS, or stored events would change model.
WIRE_DEFAULT_CLASS: Final = "nnsight.modeling.language.LanguageModel"


class ModelRef(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True,
               forbid_unknown_fields=True, rename={"cls": "class"}):
    """A canonical model key as structured fields: what `encode_event` writes for a model key."""

    cls: str = WIRE_DEFAULT_CLASS
    repo_id: str
    revision: str | None = None

    @property
    def model_key(self) -> str:
        return ref_key(self.cls, self.repo_id, self.revision)


def ref_key(cls: str, repo_id: str, revision: str | None) -> str:
    """The canonical key of (class, repo_id, revision), spelled as `canonical_model_key` spells it.

    Pure string work (no path is made absolute): a stored event decodes to the same key anywhere.
    """
    return f"{cls}:{json.dumps({'repo_id': repo_id, 'revision': revision}, ensure_ascii=False)}"


@lru_cache(maxsize=4096)
def model_ref(model_key: str) -> ModelRef | None:
    """The structured form of `model_key`, or None when the key must stay a string to round-trip.

    Only a key that is exactly canonical with no kwargs besides repo_id/revision gets a ref; any
    other string (a test's `"m"`, a key with extra kwargs) is written as the string it is.
    """
    try:
        cls, repo, rev = model_parts(model_key)
    except (InvalidCommand, ValueError, KeyError):
        return None
    if not repo or not (rev is None or isinstance(rev, str)) or ref_key(cls, repo, rev) != model_key:
        return None
    if cls == WIRE_DEFAULT_CLASS:
        return ModelRef(repo_id=repo, revision=rev)  # omit_defaults compares by identity: pass no class
    return ModelRef(cls=cls, repo_id=repo, revision=rev)


_KEYS: dict[tuple[str, str, str | None], str] = {}  # (class, repo_id, revision) -> key, checked ones
_KEYS_MAX: Final = 65536


def _key_from_wire(obj: Any) -> str:
    """A model key field as stored: a string is kept as it is; an object must be a `ModelRef`."""
    if obj.__class__ is str:
        return obj  # type: ignore[no-any-return]
    if obj.__class__ is not dict:
        raise ValueError('a model key is a string or {"class": ..., "repo_id": ..., "revision": ...}')
    try:  # the hot path: a ref seen before, with repo_id (+ class, revision) and nothing else
        if len(obj) == 1 + ("class" in obj) + ("revision" in obj):
            return _KEYS[(obj.get("class", WIRE_DEFAULT_CLASS), obj["repo_id"], obj.get("revision"))]
    except (KeyError, TypeError):
        pass
    try:
        ref = msgspec.convert(obj, ModelRef)
    except msgspec.ValidationError as exc:  # re-raised as ValueError so msgspec adds where: `$.model_key`
        raise ValueError(f"not a model ref: {exc}") from None
    if not ref.repo_id:
        raise ValueError("a model key's repo_id is empty")
    key = ref.model_key
    if len(_KEYS) < _KEYS_MAX:
        _KEYS[(ref.cls, ref.repo_id, ref.revision)] = key
    return key


def model_key_hook(typ: type, obj: Any) -> Any:
    """msgspec's `dec_hook` for a struct with `ModelKey` fields (events, statuses, requests)."""
    if typ is _WireModelKey:
        return _key_from_wire(obj)
    raise NotImplementedError(typ)  # msgspec's dec_hook contract: "not a type this hook decodes"


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """The envelope every event carries.

    `gc=False`: events are acyclic trees of primitives, so the cyclic GC need not track them (a
    fold keeps hundreds of thousands alive; tracking them made rebuilds spend time in GC passes).

    `command_id` is the causation (the command that produced it), `correlation_id` ties a chain of
    decisions together, `actor` says who appended it (`cli:alice`, `controller:<host>`,
    `agent:<node_id>`, `dispatcher:<host>`).
    """

    event_id: str
    ts: datetime
    actor: str
    model_key: ModelKey | None = None
    command_id: str | None = None
    correlation_id: str | None = None
    schema: int = SCHEMA_VERSION


# ---- nodes -------------------------------------------------------------------------------------


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    memory_bytes: int
    name: str = ""  # what the node's agent calls the card
    kind: str = ""  # what the operator's inventory calls it (schemas/inventory.py); "" when none is declared


class NodeJoined(Event, frozen=True, kw_only=True, tag="NodeJoined"):
    """An agent came up on a node with this inventory (appended by the agent)."""

    node_id: str
    gpus: tuple[GpuInfo, ...]
    cpu_cache_bytes: int
    hostname: str = ""
    ray_node_id: str = ""


class NodeDeclared(Event, frozen=True, kw_only=True, tag="NodeDeclared"):
    """The operator declared what a node may offer (the controller records its inventory file,
    schemas/inventory.py). From the first declaration on, a node's capacity is what is declared for
    it: its agent's `NodeJoined` can lower it, never raise it. Stored on the controller's subject
    `ndif.evt.cmd.<ctok>` (its `command_id`), which no agent may write."""

    node_id: str
    node: NodeInventory


class NodeLost(Event, frozen=True, kw_only=True, tag="NodeLost"):
    """The controller saw the node's heartbeat expire; everything on it is gone."""

    node_id: str
    reason: str = "heartbeat expired"


class ClusterDown(Event, frozen=True, kw_only=True, tag="ClusterDown"):
    """The cluster was off: nothing of it was heard from `down_from` (the time the server stamped on
    its last heartbeat or event) until `up_at` (a controller starting on this log). Recorded once,
    by that controller at its start, when the gap passes its heartbeat grace: timelines draw the span as "cluster down", not as the state the log held before it. Stored on
    `ndif.evt.cmd.<ctok>` (its `command_id`), as the controller's own records are."""

    down_from: datetime
    up_at: datetime

    @property
    def down_s(self) -> float:
        return max(0.0, (self.up_at - self.down_from).total_seconds())


# ---- models (desired) --------------------------------------------------------------------------


class ModelRegistered(Event, frozen=True, kw_only=True, tag="ModelRegistered"):
    """Where a model loads from and how big it is; recorded once so replays never recompute it."""

    model_key: ModelKey
    checkpoint: str
    revision: str | None = None
    size_bytes: int
    dtype: str = "float32"


class DeploymentRequested(Event, frozen=True, kw_only=True, tag="DeploymentRequested"):
    """An operator (or the dispatcher) asked for a replica count of `target_hot` (replicas desired HOT)."""

    model_key: ModelKey
    op: DeploymentOp
    replicas: int  # the number the operator typed
    target_hot: int  # the replica count this operation aims at (ModelView.target_hot)
    dedicated: bool = False
    # Charging settings of the model from here on (None: unchanged; absent in old events). The
    # headroom is the fraction over the measured size it is charged; `gpus` the exact card count
    # per replica (None: as few cards as hold the charge).
    headroom: float | None = None
    gpus: int | None = None
    # What a node must offer to hold its replicas; unset (and not written, so a decision without it
    # is stored byte for byte as before the field): unchanged.
    requires: Requirements | msgspec.UnsetType = msgspec.UNSET
    # A deploy a user's request asked for (the dispatcher's), and whose; unset (not written): the
    # operator's. The fold keeps it for the model until an operator deploys or scales it.
    for_user: str | msgspec.UnsetType = msgspec.UNSET


class PlacementRejected(Event, frozen=True, kw_only=True, tag="PlacementRejected"):
    """Part or all of a request could not be placed (CANT_ACCOMMODATE)."""

    model_key: ModelKey
    reason: str = "CANT_ACCOMMODATE"
    needed_bytes: int
    free_bytes: int
    replicas: int = 1  # how many replicas of the request were not placed
    # The settings the decision was made with (None in events written before they were recorded).
    headroom: float | None = None
    min_deploy_s: float | None = None


class ModelUndeployed(Event, frozen=True, kw_only=True, tag="ModelUndeployed"):
    """`ndif undeploy`: the model is being removed. Its replicas were asked to go COLD in the same
    decision; each is forgotten once Unloaded, the model (registration, ids) once none is left."""

    model_key: ModelKey
    replicas: int = 0  # replicas this decision asked to leave


class RolloutUpdated(Event, frozen=True, kw_only=True, tag="RolloutUpdated"):
    """A rolling restart of a model: `remaining` are the replicas still to restart, one at a time,
    each after the one restarted last (`current`) is Available again. Appended with each step's
    ReplicaRestartRequested; `remaining` empty ends the rollout, and `note` says why when it ends
    early (the replica restarted last failed, the others left)."""

    model_key: ModelKey
    remaining: tuple[int, ...] = ()
    current: int | None = None
    note: str = ""


class AutoscalePolicySet(Event, frozen=True, kw_only=True, tag="AutoscalePolicySet"):
    """`ndif autoscale`: the model's policy from here on (None: autoscaling off). It also ends a
    manual count an operator set since the last policy."""

    model_key: ModelKey
    policy: AutoscalePolicy | None = None


class AutoscaleDecided(Event, frozen=True, kw_only=True, tag="AutoscaleDecided"):
    """The autoscaler acted, or started or stopped watching a condition: the first event of its
    decision, with the figures it saw (summed over dispatchers), the rule that fired and the
    replica count it computed. With `target` != `current` the decision's placement or eviction
    events follow (same command id). `condition` is what the autoscaler watches from here on
    (`up`, `down`, or "" for nothing; a recorded `idle` holds no delay: the idle delay runs on the
    figures' `idle_s`) and `since` when that condition began (for a scale-down when idle: when the idle
    began): a restarted controller reads both from the log, so its delays run on from where they
    were."""

    model_key: ModelKey
    rule: str  # queue-above-target | oldest-wait | from-zero | queue-below-target | idle | min | max | watch
    current: int  # replicas (desired HOT) before the decision
    target: int
    figures: QueueFigures | None = None
    target_queue_per_replica: float = 0.0
    held_s: float = 0.0  # how long the condition had held when the rule fired
    condition: str = ""
    since: datetime | None = None
    level: Level = Level.COLD  # where replicas leaving go (idle: the policy's idle_to)
    note: str = ""


class CommandDecided(Event, frozen=True, kw_only=True, tag="CommandDecided"):
    """An operator command was decided: the first event of its decision, and the only one when the
    decision changed nothing. It makes every command id durable (a no-op included) and lets a
    reused id with another payload be refused (`fingerprint`, schemas.commands.fingerprint)."""

    verb: str
    fingerprint: str
    note: str = ""  # what the decision says beyond its events (e.g. why nothing was done)


# ---- replicas (desired, by the controller) -----------------------------------------------------


class ReplicaEvent(Event, frozen=True, kw_only=True):
    """Common fields of every replica event; `node_id` is where it is or goes."""

    model_key: ModelKey
    replica_id: int
    node_id: str = ""


class ReplicaScheduled(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaScheduled"):
    """Place the replica on `node_id`, exactly on `gpu_indices`, `bytes_per_gpu` on each card.

    `source` says whether it loads from disk (COLD) or from the node's CPU cache (WARM).
    `seed` is the tie-break seed placement used, so replay reproduces the decision.
    """

    gpu_indices: tuple[int, ...]
    bytes_per_gpu: int
    source: Level = Level.COLD
    dedicated: bool = False
    seed: int = 0
    # The settings the decision was made with, so replay needs no flags (None in events written
    # before they were recorded): the headroom the charge includes, the minimum deployment time
    # that decided which replicas pressure could evict.
    headroom: float | None = None
    min_deploy_s: float | None = None


class ReplicaEvictionRequested(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaEvictionRequested"):
    """Take the replica off its GPUs to `target` (WARM or COLD), after draining if `drain`."""

    reason: EvictionReason
    target: Level = Level.COLD
    drain: bool = False
    by_model_key: ModelKey | None = None  # for pressure evictions: who needed the room
    by_replica_id: int | None = None


class ReplicaRestartRequested(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaRestartRequested"):
    attempt: int = 1


# ---- replicas (observed, by agents and the dispatcher) -----------------------------------------


class ReplicaLoading(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaLoading"):
    pass


class ReplicaLoaded(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaLoaded"):
    load_seconds: float = 0.0


class ReplicaLoadFailed(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaLoadFailed"):
    error: str


class ReplicaDrained(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaDrained"):
    """A draining replica has nothing in flight, as far as its author knows: a dispatcher that serves
    it saw it idle (`idle`), or its agent found no dispatcher serving it (`unserved`) or gave up
    waiting (`timeout`). The replica is let go once every dispatcher that serves it said so, or on a
    timeout (controlplane/core/projections/replica.py)."""

    reason: DrainReason = DrainReason.IDLE


class ReplicaServed(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaServed"):
    """A dispatcher (the actor) calls this Available replica from now on: appended before its first
    call, so a drain waits for that dispatcher's `ReplicaDrained`; kept until the replica is
    scheduled anew."""


class ReplicaCached(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaCached"):
    """WARM: GPU memory freed, weights held in CPU memory (`cpu_bytes`)."""

    cpu_bytes: int


class ReplicaUnloaded(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaUnloaded"):
    """COLD: the actor is gone, nothing of the replica in memory. `cache_lost`: it was WARM in the
    log, but no process held its weights any more (its node or `ndif up` restarted)."""

    cache_lost: bool = False


class ReplicaRestarted(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaRestarted"):
    pass


class ReplicaFailed(ReplicaEvent, frozen=True, kw_only=True, tag="ReplicaFailed"):
    """The actor died at run time."""

    error: str


AnyEvent = Union[
    NodeJoined,
    NodeLost,
    NodeDeclared,
    ClusterDown,
    ModelRegistered,
    DeploymentRequested,
    PlacementRejected,
    ReplicaScheduled,
    ReplicaEvictionRequested,
    ReplicaRestartRequested,
    ReplicaLoading,
    ReplicaLoaded,
    ReplicaLoadFailed,
    ReplicaDrained,
    ReplicaCached,
    ReplicaUnloaded,
    ReplicaRestarted,
    ReplicaFailed,
    ModelUndeployed,
    CommandDecided,
    RolloutUpdated,
    AutoscalePolicySet,
    AutoscaleDecided,
    ReplicaServed,
]

EVENT_TYPES: Final[dict[str, type[Event]]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in AnyEvent.__args__  # type: ignore[attr-defined]
}


class Skipped(msgspec.Struct, frozen=True, kw_only=True):
    """Stands in for a stored message no reader of this version can use (malformed or newer type)."""

    reason: str
    type: str | None = None


class _TypeOnly(msgspec.Struct):
    type: str | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent, dec_hook=model_key_hook)
_type_decoder = msgspec.json.Decoder(_TypeOnly)


def encode_event(event: Event) -> bytes:
    """The stored body: the event as JSON, each canonical model key written as a `ModelRef` object."""
    key = event.model_key
    ref = model_ref(key) if key is not None else None
    if type(event) is ReplicaEvictionRequested and event.by_model_key is not None:
        by = model_ref(event.by_model_key)
        if by is not None:
            return _encoder.encode(msgspec.structs.replace(event, model_key=ref or key, by_model_key=by))
    return _encoder.encode(event if ref is None else msgspec.structs.replace(event, model_key=ref))


def decode_event(data: bytes) -> AnyEvent:
    """Decode one event body; raises msgspec.DecodeError/ValidationError."""
    event: AnyEvent = _decoder.decode(data)
    return event


def decode_or_skip(data: bytes) -> AnyEvent | Skipped:
    """Decode a stored body; what cannot be used becomes `Skipped` with the reason. Never raises,
    whatever the bytes (size, UTF-8 and nesting are checked before msgspec: schemas/guard.py)."""
    if not (data.__class__ is bytes and len(data) <= MAX_EVENT_BYTES and data.isascii()
            and data.count(b"[") + data.count(b"{") <= MAX_DEPTH):  # the usual body passes in ~0.1 us
        problem = body_problem(data, limit=MAX_EVENT_BYTES)
        if problem is not None:
            return Skipped(reason=f"unreadable body: {problem}")
    try:
        event: AnyEvent = _decoder.decode(data)
        return event
    except msgspec.DecodeError as exc:
        try:
            tag = _type_decoder.decode(data).type
        except msgspec.DecodeError:
            return Skipped(reason=f"malformed body: {exc}")
        if tag is not None and tag not in EVENT_TYPES:
            return Skipped(reason=f"unknown event type {tag[:80]!r} (written by a newer version?)", type=tag[:80])
        return Skipped(reason=f"invalid {tag or 'untyped'} event: {exc}", type=tag)
    except Exception as exc:  # noqa: BLE001 - checked above; whatever else msgspec or the key hook raises
        return Skipped(reason=f"unreadable body: {type(exc).__name__}: {exc}")


def check_batch(events: Sequence[Event]) -> None:
    """What no log accepts: an empty batch, more than MAX_BATCH events, one event id twice."""
    n = len(events)
    if n == 0:
        raise InvalidCommand("append: no events")
    if n > MAX_BATCH:
        raise InvalidCommand(f"append: {n} events exceed the atomic batch limit of {MAX_BATCH}")
    if len({e.event_id for e in events}) != n:
        raise InvalidCommand("append: the batch holds the same event id twice")


def event_tag(event: Event) -> str:
    return event.__struct_config__.tag  # type: ignore[return-value]


def is_sourced_fact(events: Sequence[Event], expected_last_seq: int | None) -> bool:
    """Whether this append is one observed fact whose subject carries its source (sent to the facts
    stream, from which the fact gate admits it into the log). Raises InvalidCommand for a fact in a batch or under an expected
    sequence: the facts stream takes no batches, and its sequence is not the log's."""
    facts = sum(is_fact_subject(event_subject(ev)) for ev in events)
    if facts and (len(events) > 1 or expected_last_seq is not None):
        raise InvalidCommand(
            f"append of {len(events)} events ({facts} observed facts) refused: an observed fact is appended "
            f"alone and without an expected sequence (it reaches the log through {FACTS_STREAM})")
    return facts > 0


# The largest observed fact a source may send, and the largest canonical form the gate appends (the
# facts stream refuses a larger one before it is kept): the log's limit less room for the gate's
# headers, so an admitted fact always fits the log. The agents' largest is a few KiB.
FACT_MAX_BYTES: Final = MAX_EVENT_BYTES - 4 * 1024

# Facts only the agent of the node they are about observes (and may append).
AGENT_FACTS: Final = frozenset({NodeJoined, ReplicaLoading, ReplicaLoaded, ReplicaLoadFailed, ReplicaCached,
                                ReplicaUnloaded, ReplicaRestarted, ReplicaFailed})
DISPATCHER_SOURCE: Final = "dispatcher"  # the source token of the dispatcher's observed replica facts
# Facts a dispatcher observes (and may append); an agent may also say a replica drained.
DISPATCHER_FACTS: Final = frozenset({ReplicaDrained, ReplicaServed})


def author_problem(event: Event) -> str | None:
    """Why an observed fact's author may not state it (None: it may).

    An agent's fact is accepted from `agent:<the node it is about>` only; `ReplicaDrained` also from
    a `dispatcher:...`; `ReplicaServed` from a `dispatcher:...` only. An actor without a `kind:` prefix (events written before authors were
    checked, test fixtures) is not checked; the server's per-node subject permissions cover those.
    """
    cls = event.__class__
    if cls not in AGENT_FACTS and cls not in DISPATCHER_FACTS:
        return None
    actor = event.actor
    kind, sep, _ = actor.partition(":")
    if not sep:
        return None
    if cls in DISPATCHER_FACTS and kind == DISPATCHER_SOURCE:
        return None
    node_id = event.node_id  # type: ignore[attr-defined]
    if cls is ReplicaServed:
        return f"ReplicaServed about node {node_id!r} appended by {actor!r}: only a dispatcher may state it"
    if actor == f"agent:{node_id}":
        return None
    return f"{event_tag(event)} about node {node_id!r} appended by {actor!r}: only that node's agent may state it"


def _source_token(event: ReplicaEvent | NodeJoined) -> str | None:
    """The last subject token of an observed fact: its node's token, or `dispatcher`."""
    kind, sep, _ = event.actor.partition(":")
    if event.__class__ in AGENT_FACTS or event.__class__ in DISPATCHER_FACTS:
        if kind == "agent" and sep and event.node_id:
            return node_token(event.node_id)
        if kind == DISPATCHER_SOURCE and sep:
            return DISPATCHER_SOURCE
    return None


def event_subject(event: Event) -> str:
    """The subject an event is stored on (docs/architecture.md §2).

    Observed facts carry their source as a last token (`ndif.evt.replica.<mtok>.<rid>.<ntok>` or
    `.dispatcher`, `ndif.evt.node.<ntok>.<ntok>`); an agent sends them to the facts stream on the
    same subject under `ndif.fact.` (`fact_inbox`), its own node's only (the server's permissions),
    and only the fact gate appends them to the log; decisions stay on `ndif.evt.replica.<mtok>.<rid>` and
    `ndif.evt.node.<ntok>` (NodeLost).
    """
    if isinstance(event, ReplicaEvent | NodeJoined):
        src = _source_token(event)
        base = (replica_subject(event.model_key, event.replica_id) if isinstance(event, ReplicaEvent)
                else node_subject(event.node_id))
        return base if src is None else f"{base}.{src}"
    if isinstance(event, NodeLost):
        return node_subject(event.node_id)
    if isinstance(event, NodeDeclared | ClusterDown) or (isinstance(event, CommandDecided) and event.model_key is None):
        return command_event_subject(event.command_id or event.event_id)
    if event.model_key is None:
        raise ValueError(f"{event_tag(event)} has no model_key; it has no subject")
    return model_subject(event.model_key)


def event_headers(event: Event) -> dict[str, str]:
    return {HDR_MSG_ID: event.event_id, HDR_EVENT: event_tag(event), HDR_SCHEMA: str(event.schema)}


def subject_problem(subject: str, item: AnyEvent | Skipped) -> str | None:
    """Why an event stored on `subject` does not belong there (None: it does).

    A fact on a node's subject, or on a source-tagged replica subject, must be the fact its body
    says: the server's permissions vouch for the subject (who appended it), the body for the rest.
    Replica facts stored before subjects carried their source (five tokens) are not checked; on a
    node's own subject (four tokens: NodeLost, which only the controller may publish there now, and
    NodeJoined stored before node facts carried their source) a node event must be about that node.
    """
    if item.__class__ is Skipped:
        return None
    if item.__class__ in (NodeDeclared, ClusterDown) and not subject.startswith(COMMAND_EVENTS_PREFIX):
        return (f"{event_tag(item)} stored on {subject}: the controller's own records are stored on "  # type: ignore[arg-type]
                f"{COMMAND_EVENTS_PREFIX}*")
    if subject.startswith(NODE_EVENTS_PREFIX) or (subject.startswith(REPLICA_EVENTS_PREFIX) and subject.count(".") >= 5):
        if subject.count(".") == 3 and isinstance(item, NodeJoined | NodeLost):
            want = node_subject(item.node_id)
        else:
            want = event_subject(item)  # type: ignore[arg-type]
        if want != subject:
            return f"{event_tag(item)} stored on {subject} belongs on {want}"  # type: ignore[arg-type]
    return None


def stored_item(subject: str, data: bytes) -> AnyEvent | Skipped:
    """One stored message as every reader takes it: the event, or `Skipped` with the reason (an
    unreadable body, or a body that does not belong on its subject). Never raises, so one message
    can never stop a feed: the next one is read."""
    try:
        item = decode_or_skip(data)
        problem = subject_problem(subject, item)
        if problem is not None:
            return Skipped(reason=problem, type=event_tag(item))  # type: ignore[arg-type]
        return item
    except Exception as exc:  # noqa: BLE001 - decode_or_skip never raises; the guard holds if a check does
        return Skipped(reason=f"unreadable message: {type(exc).__name__}: {str(exc)[:300]}")
