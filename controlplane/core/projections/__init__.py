"""Pure projections over NDIF_EVENTS: the cluster view and the queue view read off it."""

from controlplane.core.projections.base import Anomaly, Projection, evolve, fold
from controlplane.core.projections.cluster import (
    CardUsage,
    ClusterSnapshot,
    ClusterState,
    ModelView,
    NodeView,
    decode_snapshot,
    encode_snapshot,
)
from controlplane.core.projections.queue import ModelQueueView, processor_status, queue_view
from controlplane.core.projections.replay import check_strict, replay
from controlplane.core.projections.replica import ReplicaView, step

__all__ = [
    "Anomaly", "CardUsage", "ClusterSnapshot", "ClusterState", "ModelQueueView", "ModelView", "NodeView",
    "Projection", "ReplicaView", "check_strict", "decode_snapshot", "encode_snapshot", "evolve", "fold",
    "processor_status", "queue_view", "replay", "step",
]
