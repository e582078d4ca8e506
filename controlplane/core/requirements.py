"""Which nodes may hold a model's replicas: its `Requirements` (`ndif deploy --require`) met against
what the operator's inventory says of each node (its cards' kind and memory, its labels), as
Seldon's scheduler filters servers by capability. Pure.

A node meets a card requirement only when every one of its cards does (placement may take any card
of a node it chose), and a label requirement when it carries the label with that value. A refusal
says, for the live node closest to meeting them, what was needed and what it has.
"""

from __future__ import annotations

from controlplane.core.projections.cluster import ClusterState, NodeView
from schemas.inventory import Requirements
from schemas.units import gib


def unmet(node: NodeView, req: Requirements | None) -> list[str]:
    """What `node` lacks of `req`, each as "needed X, has Y" ([] when it meets them all)."""
    if req is None:
        return []
    out = []
    if req.gpu:
        kinds = sorted({g.kind or "(none declared)" for g in node.gpus})
        if not node.gpus or kinds != [req.gpu]:
            out.append(f"gpu={req.gpu} needed, has {'cards of kind ' + '/'.join(kinds) if kinds else 'no card'}")
    if req.min_card_bytes:
        least = min((g.memory_bytes for g in node.gpus), default=0)
        if least < req.min_card_bytes:
            out.append(f"{gib(req.min_card_bytes)} per card needed, has {gib(least) if node.gpus else 'no card'}")
    for key, want in sorted(req.labels.items()):
        have = node.labels.get(key)
        if have != want:
            out.append(f"{key}={want} needed, has {key + '=' + have if have is not None else 'no ' + key + ' label'}")
    return out


def meets(node: NodeView, req: Requirements | None) -> bool:
    return not unmet(node, req)


def requirements_refusal(state: ClusterState, req: Requirements | None) -> str | None:
    """Why no live node with cards can ever hold a model that requires `req`, or None if one can:
    what the closest node (fewest requirements unmet, then the largest smallest card, then its id) lacks."""
    if req is None:
        return None
    best: tuple[tuple[int, int, str], list[str]] | None = None
    for node_id, node in sorted(state.nodes.items()):
        if not node.alive or not node.gpus:
            continue
        miss = unmet(node, req)
        if not miss:
            return None
        rank = (len(miss), -min(g.memory_bytes for g in node.gpus), node_id)
        if best is None or rank < best[0]:
            best = (rank, miss)
    wanted = " ".join(f"--require {t}" for t in req.terms())
    if best is None:
        return f"{wanted}: no live node with GPU cards"
    return f"{wanted}: no live node meets these requirements; the closest, {best[0][2]}: {'; '.join(best[1])}"
