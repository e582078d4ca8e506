"""What an event says beyond its type and who it is about, in one line: the events table's detail
column, the lifeline's hover and the replica history. The words are `ndif history`'s
(controlplane/core/reasons.py); a failure's error is given whole, and a few events `ndif history`
leaves bare say what they carry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controlplane.core.reasons import event_reason
from schemas import events as E
from schemas.units import gib

# The events whose line here is not `ndif history`'s reason, by type.
_OWN: dict[type, Callable[[Any], str]] = {
    E.ReplicaLoadFailed: lambda ev: ev.error,
    E.ReplicaFailed: lambda ev: ev.error,
    E.ReplicaRestartRequested: lambda ev: f"attempt {ev.attempt}",
    E.NodeJoined: lambda ev: f"{len(ev.gpus)} GPUs, CPU cache {gib(ev.cpu_cache_bytes)}",
    E.ModelUndeployed: lambda ev: f"{ev.replicas} replica(s) asked to leave",
    E.ModelRegistered: lambda ev: f"{gib(ev.size_bytes)} {ev.dtype}",
}


def event_detail(ev: E.Event) -> str | None:
    """What an event says beyond its type and who it is about, in a line (an error in full)."""
    own = _OWN.get(type(ev))
    return own(ev) if own is not None else (event_reason(ev) or None)
