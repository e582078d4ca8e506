"""Placement (docs/architecture.md §6): where new HOT replicas go, what must be evicted, what cannot be placed.

Pure: reads a `ClusterState`, returns a `Plan`; no clock, ids or randomness of its own (the time
and the tie-break seed come in and are recorded in the events). NDIF's rules:

- candidate levels per node, best first: DEPLOYED (the model is already HOT there and it fits),
  CACHED_AND_FREE (a WARM copy there and it fits), FREE, CACHED_AND_FULL, FULL (fits after
  evictions), CANT_ACCOMMODATE. WARM copies are reused first, keeping their replica ids;
- several models in one call: largest first;
- a model is charged only its share of each card: up to one card's size it takes part of one card
  (the rest stays usable for others); larger, it spans `ceil(size / card)` cards evenly;
- pressure evictions only of non-dedicated, HOT replicas of other models, fewest and then smallest,
  and only of replicas loaded at least `min_deploy_s` ago unless the requester is dedicated;
- an evicted HOT replica goes WARM if its node's CPU cache can hold it (smallest WARM copies are
  dropped to COLD first to make room), else COLD;
- what cannot be placed is reported (needed vs free), the rest still goes ahead.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

import msgspec

from controlplane.projections.cluster import ClusterState, NodeView, RKey
from controlplane.projections.replica import ReplicaView
from schemas.status import Level, ReplicaState

PADDING = 0.15  # models are charged 15% over their measured size (activations, CUDA context)
MIN_DEPLOY_S = 300.0  # NDIF's minimum deployment time before a non-dedicated requester may evict


class Candidate(enum.IntEnum):
    DEPLOYED = 0
    CACHED_AND_FREE = 1
    FREE = 2
    CACHED_AND_FULL = 3
    FULL = 4
    CANT_ACCOMMODATE = 5


class Request(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    size_bytes: int  # measured size; padding is added here
    replicas: int
    dedicated: bool = False


class Placed(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replica_id: int
    node_id: str
    gpu_indices: tuple[int, ...]
    bytes_per_gpu: int
    source: Level  # WARM when a cached copy is reused (same id), else COLD
    candidate: Candidate
    dedicated: bool = False


class Eviction(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replica_id: int
    node_id: str
    target: Level  # WARM or COLD
    by_model_key: str | None = None
    by_replica_id: int | None = None


class Shortfall(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replicas: int
    needed_bytes: int
    free_bytes: int  # the most free memory any node offered (summed over the cards it would use)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    placed: tuple[Placed, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    shortfalls: tuple[Shortfall, ...] = ()


def padded(size_bytes: int) -> int:
    return int(math.ceil(size_bytes * (1 + PADDING)))


def _node_order(state: ClusterState, seed: int) -> list[NodeView]:
    """Live nodes with GPUs in the order ties are broken: sorted by id, rotated by the seed.

    Each command's seed (recorded in its events) starts the scan at a different node, spreading
    replicas across equally good nodes; the same seed gives the same order on replay.
    """
    live = [n for _, n in sorted(state.nodes.items()) if n.alive and n.gpus]
    if not live:
        return live
    k = seed % len(live)
    return live[k:] + live[:k]


class _Work:
    """A decision's scratch view on top of the folded state: what this plan already took or freed."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.extra: dict[tuple[str, int], int] = {}  # card -> bytes taken by this plan
        self.gone: set[RKey] = set()  # replicas this plan evicts (their memory counts as free)
        self.cpu_extra: dict[str, int] = {}  # node -> CPU cache bytes taken (evicted to WARM) or freed
        self.reused: set[RKey] = set()  # WARM replicas this plan brings back
        self.touched: set[str] = set()  # nodes whose cards this plan changed (the state's index is stale)

    def free(self, node_id: str, g: int, total: int) -> int:
        used = self.state.card_committed(node_id, g) + self.extra.get((node_id, g), 0)
        if self.gone:
            for k, b in self.state.card_replicas(node_id, g).items():
                if k in self.gone and self.state.replicas[k].desired is Level.HOT:
                    used -= b
        return total - used

    def take(self, node_id: str, gpus: Iterable[int], bpg: int) -> None:
        self.touched.add(node_id)
        for g in gpus:
            self.extra[(node_id, g)] = self.extra.get((node_id, g), 0) + bpg


def _shape(size: int, card_bytes: int) -> tuple[int, int]:
    """(cards, bytes per card) for a padded size on cards of `card_bytes`."""
    n = max(1, math.ceil(size / card_bytes))
    return n, math.ceil(size / n)


def _evictable(r: ReplicaView, requester: str, dedicated: bool, now_s: float, min_deploy_s: float) -> bool:
    if r.dedicated or r.model_key == requester or r.state is not ReplicaState.AVAILABLE:
        return False
    if dedicated:
        return True
    loaded = r.loaded_at.timestamp() if r.loaded_at else None
    return loaded is not None and now_s - loaded >= min_deploy_s


def _card_evictions(w: _Work, node_id: str, g: int, total: int, bpg: int, req: Request, now_s: float,
                    min_deploy_s: float) -> tuple[int, int, tuple[RKey, ...]] | None:
    """Fewest, then smallest, evictions that free `bpg` on one card: (count, bytes, keys) or None."""
    need = bpg - w.free(node_id, g, total)
    if need <= 0:
        return (0, 0, ())
    cands = sorted(
        ((b, k) for k, b in w.state.card_replicas(node_id, g).items()
         if k not in w.gone and _evictable(w.state.replicas[k], req.model_key, req.dedicated, now_s, min_deploy_s)),
        key=lambda t: (t[0], t[1]),
    )
    if not cands or sum(b for b, _ in cands) < need:
        return None
    for b, k in cands:  # one eviction, the smallest that suffices
        if b >= need:
            return (1, b, (k,))
    taken: list[tuple[int, RKey]] = []  # else largest first: the fewest evictions
    got = 0
    for b, k in reversed(cands):
        taken.append((b, k))
        got += b
        if got >= need:
            break
    # Then, same count, smaller total: swap each pick for the smallest unpicked one that still covers.
    picked = {k for _, k in taken}
    for i, (b, k) in enumerate(taken):
        for b2, k2 in cands:
            if b2 >= b:
                break
            if k2 not in picked and got - b + b2 >= need:
                picked.discard(k)
                picked.add(k2)
                taken[i] = (b2, k2)
                got += b2 - b
                break
    return (len(taken), got, tuple(k for _, k in taken))


def _assess(w: _Work, node_id: str, req: Request, size: int, warm: ReplicaView | None, hot_here: bool,
            now_s: float, min_deploy_s: float,
            allow_evict: bool) -> tuple[Candidate, tuple[int, ...], int, tuple[RKey, ...], int]:
    """Level of one node for one replica: (candidate, cards, bytes per card, evictions, free offered)."""
    node = w.state.nodes[node_id]
    n, bpg = _shape(size, node.max_card_bytes)
    frees = [(w.free(node_id, g.index, g.memory_bytes), g.index, g.memory_bytes) for g in node.gpus]
    fitting = sorted((f, i) for f, i, t in frees if f >= bpg)  # best fit: least free first
    offered = sum(sorted((max(f, 0) for f, _, _ in frees), reverse=True)[:n])
    if len(fitting) >= n:
        gpus = tuple(sorted(i for _, i in fitting[:n]))
        if warm is not None:
            return Candidate.CACHED_AND_FREE, gpus, bpg, (), offered
        return (Candidate.DEPLOYED if hot_here else Candidate.FREE), gpus, bpg, (), offered
    if not allow_evict:
        return Candidate.CANT_ACCOMMODATE, (), bpg, (), offered
    costs = []
    for _, i, t in frees:
        if t < bpg:
            continue
        c = _card_evictions(w, node_id, i, t, bpg, req, now_s, min_deploy_s)
        if c is not None:
            costs.append((c[0], c[1], i, c[2]))
    if len(costs) < n:
        return Candidate.CANT_ACCOMMODATE, (), bpg, (), offered
    costs.sort()
    chosen = costs[:n]
    keys = tuple(dict.fromkeys(k for c in chosen for k in c[3]))
    level = Candidate.CACHED_AND_FULL if warm is not None else Candidate.FULL
    return level, tuple(sorted(c[2] for c in chosen)), bpg, keys, offered


def plan(state: ClusterState, requests: Iterable[Request], *, now_s: float, seed: int = 0,
         min_deploy_s: float = MIN_DEPLOY_S) -> Plan:
    """Place every request's replicas (largest models first). Deterministic for (state, args)."""
    w = _Work(state)
    placed: list[Placed] = []
    evictions: list[Eviction] = []
    shortfalls: list[Shortfall] = []
    next_ids: dict[str, int] = {}
    nodes = _node_order(state, seed)
    for req in sorted(requests, key=lambda r: (-r.size_bytes, r.model_key)):
        size = padded(req.size_bytes)
        m = state.models.get(req.model_key)
        next_ids.setdefault(req.model_key, m.next_replica_id if m else 0)
        short = 0
        best_offer = 0
        for _ in range(req.replicas):
            choice = _choose(w, nodes, req, size, now_s, min_deploy_s)
            if choice is None:
                short += 1
                best_offer = max(best_offer, _best_offer(w, nodes, size))
                continue
            level, node_id, gpus, bpg, evict_keys, warm = choice
            if warm is not None:
                rid, source = warm.replica_id, Level.WARM
                w.reused.add(warm.key)
                w.cpu_extra[node_id] = w.cpu_extra.get(node_id, 0) - warm.cpu_bytes
            else:
                rid, source = next_ids[req.model_key], Level.COLD
                next_ids[req.model_key] = rid + 1
            for k in evict_keys:
                evictions.extend(_evict(w, k, req.model_key, rid))
            w.take(node_id, gpus, bpg)
            placed.append(Placed(model_key=req.model_key, replica_id=rid, node_id=node_id, gpu_indices=gpus,
                                 bytes_per_gpu=bpg, source=source, candidate=level, dedicated=req.dedicated))
        if short:
            shortfalls.append(Shortfall(model_key=req.model_key, replicas=short, needed_bytes=size,
                                        free_bytes=best_offer))
    return Plan(placed=tuple(placed), evictions=tuple(evictions), shortfalls=tuple(shortfalls))


_Choice = tuple[Candidate, str, tuple[int, ...], int, tuple[RKey, ...], "ReplicaView | None"]


def _choose(w: _Work, nodes: list[NodeView], req: Request, size: int, now_s: float,
            min_deploy_s: float) -> _Choice | None:
    """The best node for one more replica: (level, node, cards, bytes per card, evictions, WARM copy).

    Levels are tried best first and the first node (in the plan's seeded order) at a level wins, so
    the common case stops at the first node that fits: WARM copies that fit (reuse keeps the id and
    loads from RAM, so CACHED_AND_FREE outranks DEPLOYED), then nodes where the model is HOT, then
    any node. Only when nothing fits as is are eviction costs computed, over every node.
    """
    warm_by_node: dict[str, ReplicaView] = {}
    hot_nodes: set[str] = set()
    for r in w.state.model_replicas(req.model_key):
        if r.state is ReplicaState.AVAILABLE:
            hot_nodes.add(r.node_id)
        if r.state is ReplicaState.CACHED and r.key not in w.reused and r.node_id not in warm_by_node:
            node = w.state.nodes.get(r.node_id)
            if node is not None and node.alive:
                warm_by_node[r.node_id] = r
    if warm_by_node or hot_nodes:
        for node in nodes:
            warm = warm_by_node.get(node.node_id)
            if warm is None:
                continue
            fit = _fits(w, node, size)
            if fit is not None:
                return Candidate.CACHED_AND_FREE, node.node_id, fit[0], fit[1], (), warm
        for node in nodes:
            if node.node_id in hot_nodes and node.node_id not in warm_by_node:
                fit = _fits(w, node, size)
                if fit is not None:
                    return Candidate.DEPLOYED, node.node_id, fit[0], fit[1], (), None
    for node in nodes:
        if node.node_id in warm_by_node or node.node_id in hot_nodes:
            continue  # assessed above: it does not fit as is
        fit = _fits(w, node, size)
        if fit is not None:
            return Candidate.FREE, node.node_id, fit[0], fit[1], (), None
    best: tuple[tuple[Candidate, int, int], _Choice] | None = None
    for node in nodes:
        warm = warm_by_node.get(node.node_id)
        if best is not None and best[0][1] == 1 and (warm is None or best[0][0] is Candidate.CACHED_AND_FULL):
            # Prune: here at least one eviction of at least the node's smallest replica; it cannot
            # beat one eviction of fewer bytes at the same or a better level.
            if w.state.node_free(node.node_id).min_footprint >= best[0][2]:
                continue
        level, gpus, bpg, keys, _ = _assess(w, node.node_id, req, size, warm, node.node_id in hot_nodes,
                                            now_s, min_deploy_s, True)
        if level is Candidate.CANT_ACCOMMODATE:
            continue
        evicted = sum(w.state.replicas[k].bytes_per_gpu * len(w.state.replicas[k].gpu_indices) for k in keys)
        rank = (level, len(keys), evicted)
        if best is None or rank < best[0]:
            best = (rank, (level, node.node_id, gpus, bpg, keys, warm))
    return best[1] if best is not None else None


def _fits(w: _Work, node: NodeView, size: int) -> tuple[tuple[int, ...], int] | None:
    """(cards, bytes per card) if the replica fits on the node without evictions: best fit by card."""
    gpus = node.gpus
    card_bytes, free, _ = w.state.node_free(node.node_id)
    n, bpg = _shape(size, card_bytes)
    # The state's per-node index rejects most full nodes in O(1); nodes this plan changed are exact below.
    if node.node_id not in w.touched and (len(free) < n or free[n - 1] < bpg):
        return None
    fitting = []
    for g in gpus:
        f = w.free(node.node_id, g.index, g.memory_bytes)
        if f >= bpg:
            fitting.append((f, g.index))
    if len(fitting) < n:
        return None
    fitting.sort()
    return tuple(sorted(i for _, i in fitting[:n])), bpg


def _best_offer(w: _Work, nodes: list[NodeView], size: int) -> int:
    best = 0
    for node in nodes:
        n, _ = _shape(size, node.max_card_bytes)
        frees = sorted((max(w.free(node.node_id, g.index, g.memory_bytes), 0) for g in node.gpus), reverse=True)
        best = max(best, sum(frees[:n]))
    return best


def _evict(w: _Work, key: RKey, by_model: str, by_rid: int) -> list[Eviction]:
    """Evict a HOT replica under pressure: WARM if its node's CPU cache can make room, else COLD."""
    r = w.state.replicas[key]
    w.gone.add(key)
    w.touched.add(r.node_id)
    node = w.state.nodes[r.node_id]
    size = r.bytes_per_gpu * len(r.gpu_indices)
    out: list[Eviction] = []
    cached = {k: b for k, b in w.state.cpu_replicas(r.node_id).items() if k not in w.gone and k not in w.reused}
    room = node.cpu_cache_bytes - sum(cached.values()) - w.cpu_extra.get(r.node_id, 0)
    target = Level.COLD
    if size <= node.cpu_cache_bytes:
        drops = []
        for b, k in sorted((b, k) for k, b in cached.items()):  # smallest WARM copies go first
            if room >= size:
                break
            drops.append(k)
            room += b
        if room >= size:
            target = Level.WARM
            for k in drops:
                w.gone.add(k)
                w.cpu_extra[r.node_id] = w.cpu_extra.get(r.node_id, 0) - cached[k]
                out.append(Eviction(model_key=k[0], replica_id=k[1], node_id=r.node_id, target=Level.COLD,
                                    by_model_key=by_model, by_replica_id=by_rid))
            w.cpu_extra[r.node_id] = w.cpu_extra.get(r.node_id, 0) + size
    out.append(Eviction(model_key=r.model_key, replica_id=r.replica_id, node_id=r.node_id, target=target,
                        by_model_key=by_model, by_replica_id=by_rid))
    return out


def cache_target(state: ClusterState, r: ReplicaView, pending_cpu: dict[str, int]) -> Level:
    """Where an admin eviction of a HOT replica goes: WARM if its node's cache has room now, else COLD.

    (Admin evictions do not drop other WARM copies; pressure evictions do.) `pending_cpu` carries what
    this decision already put in each node's cache.
    """
    node = state.nodes.get(r.node_id)
    if node is None or not node.alive:
        return Level.COLD
    size = r.bytes_per_gpu * len(r.gpu_indices)
    room = node.cpu_cache_bytes - state.cpu_cached(r.node_id) - pending_cpu.get(r.node_id, 0)
    if size <= room:
        pending_cpu[r.node_id] = pending_cpu.get(r.node_id, 0) + size
        return Level.WARM
    return Level.COLD
