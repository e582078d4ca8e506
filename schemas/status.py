"""Status vocabularies: replica levels and states, model, processor and request statuses.

String enums, so they encode as their value in JSON and read well in `nats stream view`.
"""

from __future__ import annotations

import enum


class Level(enum.StrEnum):
    """Where a replica's weights are (NDIF's deployment levels)."""

    HOT = "HOT"  # on GPU, serving
    WARM = "WARM"  # weights in CPU memory
    COLD = "COLD"  # on disk only


class ReplicaState(enum.StrEnum):
    """Observed state of one replica (docs/architecture.md §4; Seldon Core v2's replica states)."""

    LOAD_REQUESTED = "LoadRequested"
    LOADING = "Loading"
    AVAILABLE = "Available"
    LOAD_FAILED = "LoadFailed"
    DRAINING = "Draining"
    UNLOAD_REQUESTED = "UnloadRequested"
    CACHED = "Cached"
    UNLOADED = "Unloaded"
    RESTARTING = "Restarting"
    FAILED = "Failed"
    LOST = "Lost"  # its node was lost; nothing of it survives


class ModelStatus(enum.StrEnum):
    """A model's status, derived from its replicas (`ClusterState.model_status`)."""

    PROGRESSING = "Progressing"
    AVAILABLE = "Available"
    FAILED = "Failed"
    SCALED_DOWN = "ScaledDown"
    UNDEPLOYING = "Undeploying"  # `ndif undeploy`: its replicas are draining/unloading; then it is forgotten


class ProcessorStatus(enum.StrEnum):
    """Queue-side status of one model's processor (NDIF's processor statuses)."""

    UNINITIALIZED = "UNINITIALIZED"
    PROVISIONING = "PROVISIONING"
    DEPLOYING = "DEPLOYING"
    READY = "READY"
    BUSY = "BUSY"
    CANCELLED = "CANCELLED"


class RequestStatus(enum.StrEnum):
    """Status of one user request; COMPLETED and ERROR are terminal and written once."""

    RECEIVED = "RECEIVED"
    QUEUED = "QUEUED"
    PROVISIONING = "PROVISIONING"
    DEPLOYING = "DEPLOYING"
    DISPATCHED = "DISPATCHED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"

    @property
    def terminal(self) -> bool:
        return self in (RequestStatus.COMPLETED, RequestStatus.ERROR)


class EvictionReason(enum.StrEnum):
    """Why a replica was asked off its GPUs. Stored events keep the reason they were written with
    (failure replacements written before `FAILURE` existed say `admin`). A new value is unreadable
    to older readers (msgspec refuses an unknown enum value): they skip such an event."""

    ADMIN = "admin"  # `ndif evict`
    PRESSURE = "pressure"  # room for another model's placement
    SCALE_DOWN = "scale-down"
    NODE_LOST = "node-lost"
    UNDEPLOY = "undeploy"
    FAILURE = "failure"  # failed past `max_restarts`: ended here, replaced elsewhere (decide_failure)


class DrainReason(enum.StrEnum):
    """Why a draining replica was let go (`ReplicaDrained.reason`). A new value is unreadable to
    older readers (msgspec refuses an unknown enum value): they skip such an event."""

    IDLE = "idle"  # a dispatcher that serves the replica has nothing in flight on it
    UNSERVED = "unserved"  # its agent: no dispatcher serves it (or every one that does said idle)
    TIMEOUT = "timeout"  # its agent: not every dispatcher that serves it said idle within the drain timeout


class DeploymentOp(enum.StrEnum):
    DEPLOY = "deploy"
    SCALE = "scale"
    SCALE_UP = "scale-up"
    SCALE_DOWN = "scale-down"
