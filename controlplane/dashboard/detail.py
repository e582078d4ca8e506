"""What an event says beyond its type and who it is about, in one line: the events table's detail
column, the lifeline's hover and the replica history (an error's text in full)."""

from __future__ import annotations

from schemas import events as E
from schemas.keys import display_name


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def event_detail(ev: E.Event) -> str | None:
    """What an event says beyond its type and who it is about, in a line (an error in full)."""
    match ev:
        case E.ReplicaLoadFailed() | E.ReplicaFailed():
            return ev.error
        case E.ReplicaEvictionRequested():
            by = f" for {display_name(ev.by_model_key)} #{ev.by_replica_id}" if ev.by_model_key else ""
            return f"{ev.reason} -> {ev.target}{' (drain)' if ev.drain else ''}{by}"
        case E.ReplicaScheduled():
            return f"gpus {list(ev.gpu_indices)} x {_gib(ev.bytes_per_gpu)} from {ev.source}"
        case E.ReplicaLoaded():
            return f"loaded in {ev.load_seconds:.2f} s"
        case E.ReplicaCached():
            return f"{_gib(ev.cpu_bytes)} in the CPU cache"
        case E.ReplicaRestartRequested():
            return f"attempt {ev.attempt}"
        case E.NodeLost():
            return ev.reason
        case E.NodeJoined():
            return f"{len(ev.gpus)} GPUs, CPU cache {_gib(ev.cpu_cache_bytes)}"
        case E.PlacementRejected():
            return (f"{ev.reason}: {ev.replicas} replica(s) need {_gib(ev.needed_bytes)}, "
                    f"largest free {_gib(ev.free_bytes)}")
        case E.DeploymentRequested():
            return f"{ev.op} {ev.replicas} (target {ev.target_hot} HOT)"
        case E.CommandDecided():
            return f"{ev.verb}: {ev.note}" if ev.note else ev.verb
        case E.RolloutUpdated():
            return ev.note or f"remaining {list(ev.remaining)}"
        case E.ModelUndeployed():
            return f"{ev.replicas} replica(s) asked to leave"
        case E.ModelRegistered():
            return f"{_gib(ev.size_bytes)} {ev.dtype}"
    return None
