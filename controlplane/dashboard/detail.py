"""What an event says beyond its type and who it is about, in one line: the events table's detail
column, the lifeline's hover and the replica history. The words are `ndif history`'s
(controlplane/core/reasons.py); a failure's error is given whole, and a few events `ndif history`
leaves bare say what they carry."""

from __future__ import annotations

from controlplane.core.reasons import event_reason
from schemas import events as E
from schemas.units import gib


def event_detail(ev: E.Event) -> str | None:
    """What an event says beyond its type and who it is about, in a line (an error in full)."""
    match ev:
        case E.ReplicaLoadFailed() | E.ReplicaFailed():
            return ev.error
        case E.ReplicaRestartRequested():
            return f"attempt {ev.attempt}"
        case E.NodeJoined():
            return f"{len(ev.gpus)} GPUs, CPU cache {gib(ev.cpu_cache_bytes)}"
        case E.ModelUndeployed():
            return f"{ev.replicas} replica(s) asked to leave"
        case E.ModelRegistered():
            return f"{gib(ev.size_bytes)} {ev.dtype}"
    return event_reason(ev) or None
