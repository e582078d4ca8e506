"""Build synthetic cluster states for placement and decide tests, through real events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.core.context import DecisionContext
from controlplane.core.projections import ClusterState
from schemas import events as E
from schemas.inventory import CardGroup, NodeInventory
from schemas.status import DeploymentOp, EvictionReason, Level

GB = 10**9
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Builder:
    def __init__(self) -> None:
        self.state = ClusterState()
        self.n = 0

    def _env(self, actor: str = "test", ts: datetime | None = None) -> dict:
        self.n += 1
        return {"event_id": f"b-{self.n}", "ts": ts or T0, "actor": actor}

    def add(self, ev: E.Event) -> Builder:
        self.state.apply(self.state.seq + 1, ev)
        return self

    def node(self, node_id: str, gpus: int = 8, gpu_gb: int = 80, cpu_gb: int = 0) -> Builder:
        return self.add(E.NodeJoined(**self._env("agent"), node_id=node_id, cpu_cache_bytes=cpu_gb * GB,
                                     gpus=tuple(E.GpuInfo(index=i, memory_bytes=gpu_gb * GB) for i in range(gpus))))

    def declared(self, node_id: str, gpus: int = 8, gpu_gb: int = 80, *, kind: str = "",
                 labels: dict[str, str] | None = None, cpu_gb: int = 0) -> Builder:
        """A node the operator's inventory declares (cards of `kind`, `labels`), then its agent's report."""
        inv = NodeInventory(cards=(CardGroup(count=gpus, memory_bytes=gpu_gb * GB, kind=kind),), labels=labels or {})
        self.add(E.NodeDeclared(**self._env("controller"), command_id=f"inventory-{node_id}", node_id=node_id,
                                node=inv))
        return self.node(node_id, gpus, gpu_gb, cpu_gb)

    def model(self, model: str, gb: float) -> Builder:
        return self.add(E.ModelRegistered(**self._env(), model_key=model, checkpoint="/ckpt",
                                          size_bytes=int(gb * GB)))

    def hot(self, model: str, rid: int, node: str, gpus: tuple[int, ...], gb_per_gpu: float, *,
            dedicated: bool = False, loaded_at: datetime = T0) -> Builder:
        if model not in self.state.models:
            self.model(model, gb_per_gpu * len(gpus))
        rep = {"model_key": model, "replica_id": rid, "node_id": node}
        self.add(E.ReplicaScheduled(**self._env("controller"), **rep, gpu_indices=gpus,
                                    bytes_per_gpu=int(gb_per_gpu * GB), dedicated=dedicated))
        return self.add(E.ReplicaLoaded(**self._env("agent", loaded_at), **rep, load_seconds=1.0))

    def warm(self, model: str, rid: int, node: str, gpus: tuple[int, ...], gb_per_gpu: float) -> Builder:
        self.hot(model, rid, node, gpus, gb_per_gpu)
        rep = {"model_key": model, "replica_id": rid, "node_id": node}
        self.add(E.ReplicaEvictionRequested(**self._env("controller"), **rep, reason=EvictionReason.ADMIN,
                                            target=Level.WARM))
        return self.add(E.ReplicaCached(**self._env("agent"), **rep, cpu_bytes=int(gb_per_gpu * len(gpus) * GB)))

    def target(self, model: str, n: int) -> Builder:
        return self.add(E.DeploymentRequested(**self._env(), model_key=model, op=DeploymentOp.SCALE, replicas=n,
                                              target_hot=n))


def ctx(cmd: str = "cmd", now: datetime | None = None, seed: int = 0) -> DecisionContext:
    return DecisionContext(now=now or T0 + timedelta(hours=1), actor="test", command_id=cmd, seed=seed)
