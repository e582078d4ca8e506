"""Schema on write for observed facts: what the fact gate lets into the log.

A fact enters the log only if it decodes as an observed fact, its author may state it, it is on the
subject its body names (so its source token is its own node's, or `dispatcher`), it is within its
bytes, and a replica fact is about a replica of that node. Pure: the gate (controlplane/store/
eventstore/gate.py) gives it the subject, the body and the controller's fold.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from controlplane.core.projections.cluster import ClusterState
from schemas.events import (
    AGENT_FACTS,
    DISPATCHER_FACTS,
    FACT_MAX_BYTES,
    AnyEvent,
    ReplicaEvent,
    Skipped,
    author_problem,
    decode_or_skip,
    encode_event,
    event_subject,
    event_tag,
)
from schemas.keys import display_name
from schemas.refusals import MAX_REASON_CHARS
from schemas.subjects import fact_log_subject

_FACTS = AGENT_FACTS | DISPATCHER_FACTS


class Verdict(msgspec.Struct, frozen=True):
    """`event` when admitted; else `problem`. `unknown`: refused for a replica the fold does not
    know (yet): the gate folds the log to its end and asks again before refusing."""

    event: AnyEvent | None = None
    problem: str = ""
    unknown: bool = False


def _no(problem: str, *, unknown: bool = False) -> Verdict:
    return Verdict(problem=problem[:MAX_REASON_CHARS], unknown=unknown)


MAX_FACT_AHEAD_S = 60.0  # a fact's own time may run this far ahead of the gate's clock (clock skew)


def admit(subject: str, data: bytes, state: ClusterState, now: datetime | None = None) -> Verdict:
    """Whether the fact sent on `subject` (a fact inbox subject) with body `data` enters the log.
    `now`: the gate's time; a fact dated past it (by more than MAX_FACT_AHEAD_S) is refused, as the
    log's times (timelines, the outage rule) would otherwise run ahead of what happened."""
    log_subject = fact_log_subject(subject)
    if log_subject is None:
        return _no(f"{subject} is no fact subject")
    if len(data) > FACT_MAX_BYTES:
        return _no(f"{len(data)} bytes, over the {FACT_MAX_BYTES} a fact may have")
    ev = decode_or_skip(data)  # total: size, UTF-8 and nesting checked before msgspec
    if isinstance(ev, Skipped):
        return _no(f"undecodable: {ev.reason}")
    if ev.__class__ not in _FACTS:
        return _no(f"{event_tag(ev)} is not an observed fact")
    kind, sep, _ = ev.actor.partition(":")
    if not sep or not kind:
        return _no(f"{event_tag(ev)} by {ev.actor!r}: the actor names no role (`agent:<node>`, `dispatcher:<host>`)")
    problem = author_problem(ev)
    if problem is not None:
        return _no(problem)
    if now is not None and (ev.ts - now).total_seconds() > MAX_FACT_AHEAD_S:
        return _no(f"{event_tag(ev)} is dated {ev.ts.isoformat()}, after the gate's time {now.isoformat()}")
    canonical = len(encode_event(ev))  # what the gate appends: defaults filled in, unknown fields gone
    if canonical > FACT_MAX_BYTES:
        return _no(f"{event_tag(ev)} is {canonical} bytes as stored, over the {FACT_MAX_BYTES} a fact may have")
    want = event_subject(ev)
    if want != log_subject:
        return _no(f"{event_tag(ev)} sent for {log_subject}, but its body belongs on {want}")
    if isinstance(ev, ReplicaEvent):
        view = state.replicas.get((ev.model_key, ev.replica_id))
        if view is not None:
            if ev.node_id and view.node_id and view.node_id != ev.node_id:
                return _no(f"{event_tag(ev)} about replica {ev.replica_id} from node {ev.node_id!r}: "
                           f"the replica is on {view.node_id!r}")
        elif ev.model_key not in state.undeployed:  # a late fact of an undeployed model: the fold ignores it
            model = state.models.get(ev.model_key)
            # A replica gone and forgotten by the fold (its id below the next one) is let in: the
            # fold words what it means. One never placed is refused.
            if model is None or ev.replica_id >= model.next_replica_id:
                return _no(f"{event_tag(ev)} about replica {ev.replica_id} of {display_name(ev.model_key)!r}, which "
                           "the log never placed", unknown=True)
    return Verdict(event=ev)
