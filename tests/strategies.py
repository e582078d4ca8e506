"""Hypothesis strategies: events of every type, and event histories that exercise the state machine.

Histories are drawn from a small world (2 nodes x 2 cards, 2 models, 4 replica ids) so collisions,
races and duplicates are frequent: lifecycles that follow the table, then shuffled, duplicated and
mixed with arbitrary events.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from hypothesis import strategies as st

from schemas import events as E
from schemas.autoscale import AutoscalePolicy, QueueFigures
from schemas.inventory import CardGroup, NodeInventory
from schemas.status import DeploymentOp, EvictionReason, Level

NODES = ("node-a.cluster", "node-b.cluster")
MODELS = (
    'nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}',
    'nnsight.modeling.language.LanguageModel:{"repo_id": "meta-llama/Llama-3.1-8B", "revision": "main"}',
)
CARD = 80 * 2**30
T0 = datetime(2026, 1, 1, tzinfo=UTC)

_counter = iter(range(10**12))

# What msgspec raises for invalid UTF-8 inside a JSON string: UnicodeDecodeError before 0.23,
# DecodeError since (pyproject.toml allows both; schemas/guard.py refuses it first either way).
MSGSPEC_BAD_UTF8: type[Exception] = (
    UnicodeDecodeError if tuple(int(p) for p in msgspec.__version__.split(".")[:2]) < (0, 23) else msgspec.DecodeError)


def _env(actor: str = "test", **kw: Any) -> dict[str, Any]:
    n = next(_counter)
    return {"event_id": f"ev-{n}", "ts": T0 + timedelta(milliseconds=n), "actor": actor, **kw}


def node_joined(node: str) -> E.NodeJoined:
    return E.NodeJoined(**_env("agent"), node_id=node, cpu_cache_bytes=4 * CARD,
                        gpus=(E.GpuInfo(index=0, memory_bytes=CARD), E.GpuInfo(index=1, memory_bytes=CARD)))


models = st.sampled_from(MODELS)
nodes = st.sampled_from(NODES)
rids = st.integers(0, 3)
gpu_sets = st.sampled_from([(0,), (1,), (0, 1)])
nbytes = st.integers(1, 50).map(lambda g: g * 2**30)
texts = st.text(max_size=20)


@st.composite
def any_event(draw: st.DrawFn) -> E.Event:
    """One event of any type with fields from the small world (valid or not for the current state)."""
    kind = draw(st.sampled_from(sorted(E.EVENT_TYPES)))
    m, rid, node = draw(models), draw(rids), draw(nodes)
    rep = {"model_key": m, "replica_id": rid, "node_id": node}
    match kind:
        case "NodeJoined":
            return node_joined(node)
        case "NodeLost":
            return E.NodeLost(**_env(), node_id=node)
        case "NodeDeclared":
            cards = (CardGroup(count=draw(st.integers(0, 2)), memory_bytes=draw(st.sampled_from([CARD, CARD // 2]))),)
            return E.NodeDeclared(**{**_env("controller"), "command_id": "inventory"}, node_id=node,
                                  node=NodeInventory(cards=cards))
        case "ModelRegistered":
            return E.ModelRegistered(**_env(), model_key=m, checkpoint="/ckpt", size_bytes=draw(nbytes))
        case "DeploymentRequested":
            return E.DeploymentRequested(**_env(), model_key=m, op=draw(st.sampled_from(list(DeploymentOp))),
                                         replicas=draw(st.integers(0, 4)), target_hot=draw(st.integers(0, 4)))
        case "PlacementRejected":
            return E.PlacementRejected(**_env(), model_key=m, needed_bytes=draw(nbytes), free_bytes=draw(nbytes))
        case "ReplicaScheduled":
            return E.ReplicaScheduled(**_env(), **rep, gpu_indices=draw(gpu_sets), bytes_per_gpu=draw(nbytes),
                                      source=draw(st.sampled_from([Level.COLD, Level.WARM])),
                                      dedicated=draw(st.booleans()))
        case "ReplicaEvictionRequested":
            return E.ReplicaEvictionRequested(**_env(), **rep, reason=draw(st.sampled_from(list(EvictionReason))),
                                              target=draw(st.sampled_from([Level.WARM, Level.COLD])),
                                              drain=draw(st.booleans()))
        case "ReplicaRestartRequested":
            return E.ReplicaRestartRequested(**_env(), **rep)
        case "ReplicaLoaded":
            return E.ReplicaLoaded(**_env(), **rep, load_seconds=draw(st.floats(0, 100)))
        case "ReplicaLoadFailed" | "ReplicaFailed":
            return E.EVENT_TYPES[kind](**_env(), **rep, error=draw(texts))  # type: ignore[call-arg]
        case "ReplicaCached":
            return E.ReplicaCached(**_env(), **rep, cpu_bytes=draw(nbytes))
        case "RolloutUpdated":
            return E.RolloutUpdated(**_env(), model_key=m, remaining=tuple(draw(st.lists(rids, max_size=3))),
                                    current=draw(st.none() | rids))
        case "ModelUndeployed":
            return E.ModelUndeployed(**_env(), model_key=m, replicas=draw(st.integers(0, 4)))
        case "CommandDecided":
            return E.CommandDecided(**{**_env(), "command_id": draw(st.sampled_from(["c1", "c2"]))},
                                    model_key=draw(st.sampled_from([m, None])), verb="scale",
                                    fingerprint=draw(st.sampled_from(["f1", "f2"])), note=draw(texts))
        case "RolloutUpdated":
            remaining = tuple(draw(st.lists(st.integers(0, 3), max_size=3, unique=True)))
            return E.RolloutUpdated(**_env(), model_key=m, remaining=remaining,
                                    current=draw(st.one_of(st.none(), st.integers(0, 3))), note=draw(texts))
        case "AutoscalePolicySet":
            policy = draw(st.none() | st.builds(AutoscalePolicy, min_replicas=st.integers(0, 2),
                                                max_replicas=st.integers(2, 4),
                                                idle_to=st.sampled_from([Level.WARM, Level.COLD])))
            return E.AutoscalePolicySet(**_env(), model_key=m, policy=policy)
        case "AutoscaleDecided":
            figures = QueueFigures(queued=draw(st.integers(0, 50)), running=draw(st.integers(0, 8)))
            return E.AutoscaleDecided(**_env(), model_key=m, rule=draw(st.sampled_from(["queue-above-target", "idle"])),
                                      current=draw(st.integers(0, 4)), target=draw(st.integers(0, 4)),
                                      figures=draw(st.none() | st.just(figures)),
                                      condition=draw(st.sampled_from(["", "up", "down", "idle"])),
                                      since=draw(st.none() | st.just(T0)))
        case "ClusterDown":
            gap = timedelta(seconds=draw(st.integers(21, 86_400)))
            return E.ClusterDown(**{**_env(), "command_id": draw(st.sampled_from(["o1", "o2"]))},
                                 down_from=T0, up_at=T0 + gap)
        case _:
            return E.EVENT_TYPES[kind](**_env(), **rep)  # type: ignore[call-arg]


@st.composite
def lifecycle(draw: st.DrawFn, model: str, rid: int) -> list[E.Event]:
    """A path through the table for one replica (what a healthy controller and agent would write)."""
    node = draw(nodes)
    gpus, size = draw(gpu_sets), draw(nbytes)
    rep = {"model_key": model, "replica_id": rid, "node_id": node}
    out: list[E.Event] = []
    source = Level.COLD
    for _ in range(draw(st.integers(1, 3))):
        out.append(E.ReplicaScheduled(**_env("controller"), **rep, gpu_indices=gpus, bytes_per_gpu=size,
                                      source=source))
        out.append(E.ReplicaLoading(**_env("agent"), **rep))
        if draw(st.integers(0, 9)) == 0:
            out.append(E.ReplicaLoadFailed(**_env("agent"), **rep, error="boom"))
            source = Level.COLD
            continue
        out.append(E.ReplicaLoaded(**_env("agent"), **rep, load_seconds=1.0))
        if draw(st.booleans()):
            out.append(E.ReplicaFailed(**_env("agent"), **rep, error="died"))
            out.append(E.ReplicaRestartRequested(**_env("controller"), **rep))
            out.append(E.ReplicaRestarted(**_env("agent"), **rep))
        target = draw(st.sampled_from([Level.WARM, Level.COLD]))
        drain = draw(st.booleans())
        out.append(E.ReplicaEvictionRequested(**_env("controller"), **rep, reason=EvictionReason.ADMIN,
                                              target=target, drain=drain))
        if drain:
            out.append(E.ReplicaDrained(**_env("dispatcher"), **rep))
        if target is Level.WARM:
            out.append(E.ReplicaCached(**_env("agent"), **rep, cpu_bytes=size * len(gpus)))
            source = Level.WARM
        else:
            out.append(E.ReplicaUnloaded(**_env("agent"), **rep))
            source = Level.COLD
    return out


@st.composite
def histories(draw: st.DrawFn, *, chaos: bool = True) -> list[E.Event]:
    """Nodes join, models register, then interleaved lifecycles; with `chaos`, shuffled windows,
    duplicates and arbitrary events mixed in."""
    out: list[E.Event] = [node_joined(n) for n in NODES]
    for m in MODELS:
        out.append(E.ModelRegistered(**_env("controller"), model_key=m, checkpoint="/ckpt", size_bytes=2**30))
    lanes = [draw(lifecycle(m, r)) for m in MODELS for r in range(draw(st.integers(1, 3)))]
    # Interleave lanes preserving each lane's own order.
    while any(lanes):
        lane = draw(st.sampled_from([ln for ln in lanes if ln]))
        out.append(lane.pop(0))
    if chaos:
        for _ in range(draw(st.integers(0, 6))):
            i = draw(st.integers(0, len(out)))
            op = draw(st.sampled_from(["dup", "swap", "noise", "drop"]))
            if op == "dup" and out:
                out.insert(i, out[min(i, len(out) - 1)])
            elif op == "swap" and i + 1 < len(out):
                out[i], out[i + 1] = out[i + 1], out[i]
            elif op == "noise":
                out.insert(i, draw(any_event()))
            elif op == "drop" and i < len(out):
                del out[i]
    return out


def envelope(actor: str, n: list[int] = [0]) -> dict[str, object]:  # noqa: B006 - a counter for unique ids
    """An event's envelope fields by `actor`, each with an id of its own (`**envelope(actor)`)."""
    n[0] += 1
    return {"event_id": f"e{n[0]}", "ts": datetime(2026, 11, 1, tzinfo=UTC), "actor": actor}


def numbered(events: list[E.Event]) -> list[tuple[int, E.Event]]:
    return [(i + 1, e) for i, e in enumerate(events)]


def scripted_history(replicas: int = 20) -> list[E.Event]:
    """A fixed, healthy history: both nodes join, replicas load, some go WARM, some COLD."""
    out: list[E.Event] = [node_joined(n) for n in NODES]
    out.append(E.ModelRegistered(**_env("controller"), model_key=MODELS[0], checkpoint="/ckpt", size_bytes=2**30))
    for rid in range(replicas):
        rep = {"model_key": MODELS[0], "replica_id": rid, "node_id": NODES[rid % 2]}
        out.append(E.ReplicaScheduled(**_env("controller"), **rep, gpu_indices=(rid % 2,), bytes_per_gpu=2**30))
        out.append(E.ReplicaLoading(**_env("agent"), **rep))
        out.append(E.ReplicaLoaded(**_env("agent"), **rep, load_seconds=0.5))
        if rid % 3 == 1:
            out.append(E.ReplicaEvictionRequested(**_env("controller"), **rep, reason=EvictionReason.ADMIN,
                                                  target=Level.WARM))
            out.append(E.ReplicaCached(**_env("agent"), **rep, cpu_bytes=2**30))
        elif rid % 3 == 2:
            out.append(E.ReplicaEvictionRequested(**_env("controller"), **rep, reason=EvictionReason.ADMIN))
            out.append(E.ReplicaUnloaded(**_env("agent"), **rep))
    return out


# ---- hostile bytes: what a decoder of untrusted input must survive ------------------------------

BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82", b"\xf0\x28\x8c\xbc")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=24)


@st.composite
def deep_json(draw: st.DrawFn, *, at_least: int = 100, at_most: int = 20_000) -> bytes:
    """Nesting deep enough to break a recursive decoder (the 6 KB of nested arrays: 3,000 levels),
    alone or under a field of a real-looking body, closed or not."""
    n = draw(st.integers(at_least, at_most))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"a":', b"}]")]))
    core = opener * n + b"1" + closer * n if draw(st.booleans()) else opener * n
    wrap = draw(st.sampled_from([b"%s", b'{"type":"NodeJoined","x":%s}', b'{"verb":"deploy","command_id":%s}',
                                 b'{"request_id":"r1","payload":%s}', b'{"request_id":"r1","status":"COMPLETED",'
                                 b'"ts":"2026-01-01T00:00:00Z","result":%s}', b'{"model_key":%s}']))
    return wrap.replace(b"%s", core)


@st.composite
def bad_utf8_json(draw: st.DrawFn) -> bytes:
    """A real-looking body with invalid UTF-8 inside one of its strings (the 36-byte poison event)."""
    body = draw(st.sampled_from([
        b'{"type":"NodeJoined","event_id":"\x00"}', b'{"type":"\x00"}', b'{"verb":"deploy","command_id":"\x00"}',
        b'{"request_id":"\x00","model_key":"m","payload":{},"submitted_at":"2026-01-01T00:00:00Z"}',
        b'{"request_id":"r1","status":"COMPLETED","ts":"2026-01-01T00:00:00Z","message":"\x00"}',
        b'{"nodes":{"\x00":{"cards":[]}}}', b'"\x00"']))
    return body.replace(b"\x00", draw(st.sampled_from(BAD_UTF8)) + draw(st.text(max_size=4)).encode())


@st.composite
def mutated_event(draw: st.DrawFn) -> bytes:
    """A real stored event body with bytes flipped, cut or inserted."""
    # the same draw makes the same body (any_event's ids and times come from a counter)
    body = bytearray(E.encode_event(msgspec.structs.replace(draw(any_event()), event_id="ev-m", ts=T0)))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(body)))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and i < len(body):
            body[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del body[i:]
        else:
            body[i:i] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from(BAD_UTF8 + (b"[" * 200,)))
    return bytes(body)


@st.composite
def deep_key_event(draw: st.DrawFn) -> bytes:
    """A well-formed event whose model key (a string) holds deeply nested JSON: the body passes every
    check, and whatever reads the key (its subject token, its display name) must not recurse."""
    n = draw(st.integers(50, 5_000))
    key = 'nnsight.modeling.language.LanguageModel:{"repo_id": ' + "[" * n + "]" * n + "}"
    ev = draw(any_event())
    if ev.model_key is None:
        return E.encode_event(ev)
    return E.encode_event(msgspec.structs.replace(ev, model_key=key))


hostile_bytes = st.one_of(
    deep_key_event(),
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    deep_json(),
    bad_utf8_json(),
    mutated_event(),
)
