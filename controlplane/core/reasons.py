"""What an event says beyond its type, in words for people: `ndif history`'s reason column, `ndif
status`'s recent events and the dashboard's detail (controlplane/dashboard/detail.py). Pure: text
from the event alone."""

from __future__ import annotations

from schemas import events as E
from schemas.autoscale import AutoscalePolicy
from schemas.keys import display_name
from schemas.status import DrainReason, Level
from schemas.units import gib

_DRAINED = {
    DrainReason.IDLE: "idle: nothing of its dispatcher's in flight",
    DrainReason.UNSERVED: "at once: no dispatcher calls it, nothing in flight",
    DrainReason.TIMEOUT: "timed out: a dispatcher that calls it did not say it was idle within the agent's drain timeout",
}


def event_reason(item: E.Event) -> str:
    """What an event says beyond its type, for people: the verb of a command, the error of a failed
    load, needed vs free of a refused placement, why and where to an eviction went, a rollout's step."""
    match item:
        case E.CommandDecided():
            return f"verb={item.verb}" + (f" ({item.note})" if item.note else "")
        case E.DeploymentRequested():
            return f"{item.op} replicas={item.replicas} -> replica count {item.target_hot}"
        case E.PlacementRejected():
            return (f"{item.reason}: {item.replicas} replica(s); needed {gib(item.needed_bytes)}, "
                    f"the most any node had free {gib(item.free_bytes)}")
        case E.ReplicaScheduled():
            return (f"on gpus {list(item.gpu_indices)}, {gib(item.bytes_per_gpu)} each, from {item.source}"
                    + (", dedicated" if item.dedicated else ""))
        case E.ReplicaEvictionRequested():
            by = f" by {display_name(item.by_model_key)}#{item.by_replica_id}" if item.by_model_key else ""
            return f"reason={item.reason} -> {item.target}" + (", drain first" if item.drain else "") + by
        case E.ReplicaLoadFailed() | E.ReplicaFailed():
            return f"error: {item.error}"
        case E.ReplicaLoaded():
            return f"in {item.load_seconds:.2f}s"
        case E.ClusterDown():
            return (f"cluster down {item.down_s:.0f} s: nothing heard from {item.down_from:%Y-%m-%d %H:%M:%S}Z "
                    f"to {item.up_at:%H:%M:%S}Z")
        case E.ReplicaUnloaded() if item.cache_lost:
            return "its CPU copy was gone (no process held it after a restart): retired to COLD"
        case E.ReplicaCached():
            return f"{gib(item.cpu_bytes)} in the CPU cache"
        case E.ReplicaDrained():
            return _DRAINED[item.reason]
        case E.ReplicaServed():
            return f"called by {item.actor}"
        case E.RolloutUpdated():
            step = f"restarting {item.current}" if item.current is not None else "rollout ended"
            rest = f", then {', '.join(map(str, item.remaining))}" if item.remaining else ""
            return step + rest + (f" ({item.note})" if item.note else "")
        case E.NodeLost():
            return f"reason: {item.reason}"
        case E.AutoscalePolicySet():
            return "autoscaling off" if item.policy is None else f"autoscale {policy_text(item.policy)}"
        case E.AutoscaleDecided():
            return autoscale_reason(item)
    return ""


def policy_text(p: AutoscalePolicy) -> str:
    """A policy in one line, as `ndif status` and `ndif history` show it."""
    wait = f", or oldest wait over {p.max_wait_s:g} s" if p.max_wait_s is not None else ""
    return (f"{p.min_replicas}..{p.max_replicas} replicas, {p.target_queue_per_replica:g} queued per replica{wait}; "
            f"up after {p.upscale_delay_s:g} s, down after {p.downscale_delay_s:g} s, idle {p.idle_after_s:g} s "
            f"-> {p.idle_to}")


_CONDITIONS = {"up": "queue above target", "down": "queue below target", "idle": "idle", "": "condition ended"}
_HELD = {"queue-above-target": "above", "oldest-wait": "oldest wait over the limit", "queue-below-target": "below",
         "idle": "idle"}


def autoscale_reason(e: E.AutoscaleDecided) -> str:
    """`scaled 2 -> 4: 37 queued, 2 replicas, target 4 per replica, above for 5.2 s`, or what the
    autoscaler started or stopped watching."""
    f = e.figures
    seen = "no figures" if f is None else f"{f.queued} queued" + (f", {f.running} running" if f.running else "")
    if f is not None and e.rule == "oldest-wait":
        seen += f", oldest waited {f.oldest_wait_s:.1f} s"
    if e.target == e.current:
        since = f" since {e.since:%H:%M:%S}" if e.since is not None and e.condition else ""
        return f"watching: {_CONDITIONS.get(e.condition, e.condition)}{since} ({seen}, {e.current} replicas)"
    held = _HELD.get(e.rule)
    why = {"from-zero": "from zero", "min": "the policy's minimum", "max": "the policy's maximum"}.get(e.rule)
    tail = f"{held} for {e.held_s:.1f} s" if held else (why or e.rule)
    to = f" ({e.rule}, to {e.level})" if e.target < e.current and e.level is not Level.COLD else ""
    return (f"scaled {e.current} -> {e.target}{to}: {seen}, {e.current} replicas, "
            f"target {e.target_queue_per_replica:g} per replica, {tail}")
