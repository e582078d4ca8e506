"""What the dispatcher's provisioning needs to know about a rejected deploy, read from the fold.

Pure (the time comes in): `never_fits` tells a model that no live node could hold even when empty
(the request ends at once, with the reason) from one that merely has no room now (it waits);
`capacity_mark` is what placement's answer depends on, so a retry is sent only once it changed
and an unchanged cluster sees no new `DeploymentRequested` / `PlacementRejected` events.
"""

from __future__ import annotations

import math

from controlplane.core.placement import MIN_DEPLOY_S
from controlplane.core.projections import ClusterState
from schemas.status import ReplicaState
from schemas.units import gib


def never_fits(state: ClusterState, needed_bytes: int) -> str | None:
    """Why no live node could ever hold one replica of `needed_bytes` (placement's padded size), or None.

    A replica larger than a card spans `ceil(size / card)` of a node's cards, as placement does.
    With no live node at all it is None: an agent may still join (the request's queue lifetime
    bounds the wait).
    """
    live = [n for n in state.nodes.values() if n.alive]
    if not live:
        return None
    with_gpus = [n for n in live if n.gpus]
    if not with_gpus:
        return (f"no node has a GPU ({len(live)} node(s) up, none with GPUs): declare GPUs with "
                "`ndif up --gpus N` / `ndif agent --gpus N` on a CPU-only machine, or add a GPU node")
    for n in with_gpus:
        cards = max(1, math.ceil(needed_bytes / n.max_card_bytes))
        per_card = math.ceil(needed_bytes / cards)
        if sum(1 for g in n.gpus if g.memory_bytes >= per_card) >= cards:
            return None
    big = max(with_gpus, key=lambda n: (n.max_card_bytes * len(n.gpus), n.node_id))
    largest = max(n.max_card_bytes for n in with_gpus)
    return (f"the model can never be placed: the largest card is {gib(largest)} (node {big.node_id} has "
            f"{len(big.gpus)} card(s), {gib(sum(g.memory_bytes for g in big.gpus))} in all), the model needs "
            f"{gib(needed_bytes)} (its size plus placement's headroom); no eviction can make room: it needs "
            "a node whose cards can hold it")


def capacity_mark(state: ClusterState, now_s: float, min_deploy_s: float = MIN_DEPLOY_S) -> tuple[object, ...]:
    """Everything a placement answer depends on: live nodes, each card's committed bytes, and the
    replicas that pressure may evict by now. Equal marks: the same deploy would be rejected again."""
    cards = tuple(sorted(
        (n.node_id, tuple((g.index, g.memory_bytes, state.card_committed(n.node_id, g.index)) for g in n.gpus))
        for n in state.nodes.values() if n.alive))
    evictable = tuple(sorted(
        (r.model_key, r.replica_id) for r in state.replicas.values()
        if r.state is ReplicaState.AVAILABLE and not r.dedicated and r.loaded_at is not None
        and now_s - r.loaded_at.timestamp() >= min_deploy_s))
    return cards, evictable
