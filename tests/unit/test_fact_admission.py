"""Schema on write for observed facts (controlplane/core/facts.py): what the fact gate lets into the log."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.facts import admit
from controlplane.core.projections import ClusterState, fold
from schemas import events as E
from schemas.events import FACT_MAX_BYTES, encode_event, event_subject
from schemas.status import Level
from schemas.subjects import fact_inbox, fact_log_subject, node_facts_from, node_token
from tests.strategies import MODELS, envelope, node_joined, numbered

M = MODELS[0]
A, B = "node-a.cluster", "node-b.cluster"
GB = 2**30


def placed() -> ClusterState:
    """Node A and B joined; replica 0 of M scheduled on A."""
    sched = E.ReplicaScheduled(**envelope("controller:c"), model_key=M, replica_id=0, node_id=A, gpu_indices=(0,),
                               bytes_per_gpu=10 * GB, source=Level.COLD)
    return fold(numbered([node_joined(A), node_joined(B), sched]), ClusterState())


def joined(node: str) -> E.NodeJoined:
    return E.NodeJoined(**envelope(f"agent:{node}"), node_id=node, gpus=(E.GpuInfo(index=0, memory_bytes=80 * GB),),
                        cpu_cache_bytes=GB)


def sent(ev: E.Event) -> tuple[str, bytes]:
    """What a source sends for `ev`: its inbox subject and body."""
    return fact_inbox(event_subject(ev)), encode_event(ev)


def loaded(node: str = A, replica_id: int = 0, actor: str | None = None) -> E.ReplicaLoaded:
    return E.ReplicaLoaded(**envelope(f"agent:{node}" if actor is None else actor), model_key=M, replica_id=replica_id, node_id=node)


def test_a_fact_of_its_own_node_about_its_own_replica_is_admitted() -> None:
    v = admit(*sent(loaded()), placed())
    assert v.event is not None and not v.problem
    own = joined(A)
    assert admit(*sent(own), ClusterState()).event == own


def test_the_inbox_and_the_log_subject_are_one_mapping() -> None:
    ev = loaded()
    assert fact_log_subject(fact_inbox(event_subject(ev))) == event_subject(ev)
    assert fact_log_subject("ndif.evt.node.x.x") is None and fact_log_subject("ndif.fact.model.x") is None


@pytest.mark.parametrize("body", [b"", b"[]", b'"x"', b"{}", b"\xff\xfe", b'{"type":"Nope","event_id":"x"}',
                                  b"[" * 3000 + b"]" * 3000, b"{\"x\":" + b"[" * 3000 + b"]" * 3000 + b"}", b'{"type":"NodeJoined","event_id":"\xff"}',
                                  b'{"type":"NodeJoined","event_id":"x","ts":"2026-11-01T00:00:00Z","actor":"a",'
                                  b'"node_id":"n","gpus":"lots","cpu_cache_bytes":1}'])
def test_junk_on_an_agents_own_subject_is_refused(body: bytes) -> None:
    v = admit(fact_inbox(node_facts_from(node_token(A))), body, placed())
    assert v.event is None and v.problem


def test_a_fact_about_another_node_on_its_own_subject_is_refused() -> None:
    other = joined(B)
    v = admit(fact_inbox(node_facts_from(node_token(A))), encode_event(other), placed())
    assert v.event is None and "belongs on" in v.problem


def test_a_fact_about_a_replica_of_another_node_is_refused() -> None:
    v = admit(*sent(loaded(node=B)), placed())  # B's agent, B's subject, A's replica
    assert v.event is None and "is on" in v.problem and not v.unknown


def test_a_fact_about_a_replica_never_placed_is_refused_once_the_fold_is_at_the_end() -> None:
    v = admit(*sent(loaded(replica_id=7)), placed())
    assert v.event is None and v.unknown and "never placed" in v.problem


@pytest.mark.parametrize("actor", ["", "nobody", "controller:c", f"agent:{B}", "cli:mallory"])
def test_a_fact_whose_author_may_not_state_it_is_refused(actor: str) -> None:
    ev = loaded(actor=actor)
    subject = fact_inbox(f"{event_subject(loaded())}")  # A's own subject, whatever the body says
    assert admit(subject, encode_event(ev), placed()).event is None


def test_a_decision_is_no_fact() -> None:
    sched = E.ReplicaScheduled(**envelope(f"agent:{A}"), model_key=M, replica_id=1, node_id=A, gpu_indices=(0,),
                               bytes_per_gpu=GB, source=Level.COLD)
    subject = fact_inbox(event_subject(loaded()))
    v = admit(subject, encode_event(sched), placed())
    assert v.event is None and "not an observed fact" in v.problem


def test_a_fact_over_its_bytes_is_refused() -> None:
    big = E.ReplicaLoadFailed(**envelope(f"agent:{A}"), model_key=M, replica_id=0, node_id=A, error="x" * FACT_MAX_BYTES)
    v = admit(*sent(big), placed())
    assert v.event is None and "bytes" in v.problem


def test_unknown_fields_are_not_kept() -> None:
    """The gate stores the canonical form: a field the schema does not know never reaches the log."""
    body = msgspec.json.decode(encode_event(loaded()))
    body["padding"] = "p" * 1000
    v = admit(fact_inbox(event_subject(loaded())), msgspec.json.encode(body), placed())
    assert v.event is not None and b"padding" not in encode_event(v.event)


@given(st.binary(max_size=2000))
def test_no_bytes_raise_and_none_but_a_fact_get_in(body: bytes) -> None:
    v = admit(fact_inbox(node_facts_from(node_token(A))), body, placed())
    assert (v.event is None) == bool(v.problem)
    if v.event is not None:
        assert v.event.__class__ in E.AGENT_FACTS | E.DISPATCHER_FACTS


def test_a_fact_whose_stored_form_would_not_fit_the_log_is_refused() -> None:
    """A body within the facts stream's bound whose canonical form (defaults filled in) is over it: were
    it admitted, the log would refuse the append, and the gate would hold every later fact behind it."""
    base = joined(A)
    pad = FACT_MAX_BYTES - len(encode_event(base)) + 20
    big = E.NodeJoined(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "hostname": "h" * pad})
    assert len(encode_event(big)) > FACT_MAX_BYTES
    body = msgspec.json.decode(encode_event(big))
    for default in ("model_key", "command_id", "correlation_id", "ray_node_id"):
        body.pop(default)
    raw = msgspec.json.encode(body)
    assert len(raw) <= FACT_MAX_BYTES  # the facts stream takes it
    v = admit(fact_inbox(event_subject(big)), raw, placed())
    assert v.event is None and "as stored" in v.problem


def test_a_fact_dated_past_the_gates_clock_is_refused() -> None:
    """A fact's time is its author's word: one from the future would move the log's times (timelines,
    the outage rule) ahead of what happened."""
    from datetime import timedelta

    own = joined(A)
    assert admit(*sent(own), ClusterState(), own.ts - timedelta(seconds=59)).event == own  # 59 s ahead: skew allowed
    ahead = msgspec.structs.replace(own, ts=own.ts + timedelta(days=365 * 70))
    v = admit(*sent(ahead), ClusterState(), own.ts)
    assert v.event is None and "after the gate's time" in v.problem
