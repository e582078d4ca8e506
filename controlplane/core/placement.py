"""Placement (docs/architecture.md §6): where new HOT replicas go, what must be evicted, what cannot be placed.

Pure: reads a `ClusterState`, returns a `Plan`; no clock, ids or randomness of its own (the time
and the tie-break seed come in and are recorded in the events). NDIF's rules:

- candidate levels per node, best first: DEPLOYED (the model is already HOT there and it fits),
  CACHED_AND_FREE (a WARM copy there and it fits), FREE, CACHED_AND_FULL, FULL (fits after
  evictions), CANT_ACCOMMODATE. WARM copies are reused first, keeping their replica ids;
- replicas of one model spread (what fits without evictions is ranked by): first a node holding
  the fewest replicas of it (nodes are the failure domain), then a card that holds the fewest
  replicas of the model (none, while one is left), then a WARM copy there, then the seeded node
  order. Within a node, cards are taken by
  (fewest replicas of the model, not being vacated by a leaving replica, best fit: least free
  first): 4 replicas on 2 free cards land 2+2, a new replica never waits for a card another is
  leaving while a free one fits, other models still pack and big models keep finding whole cards;
- several models in one call: largest first;
- a model is charged its measured size plus its headroom (a setting: the controller's default or
  the model's own, recorded in its events), and only its share of each card: up to one card's size
  it takes part of one card (the rest stays usable for others); larger, it spans
  `ceil(charge / card)` cards evenly; with a GPU count N it spans exactly N cards of one node, each
  charged `ceil(charge / N)`;
- pressure evictions only of non-dedicated, HOT replicas of other models, fewest and then smallest
  over the whole node (a victim spanning several cards frees all of them at once), and only of
  replicas loaded at least `min_deploy_s` ago unless the requester is dedicated; nodes are
  searched best bound first; exact on clusters of up to EXACT_NODES live nodes (and whenever the
  search ends within its budget), else the best found within DECISION_EVICTION_SETS victim sets;
- an evicted HOT replica goes WARM if its node's CPU cache can hold it (smallest WARM copies are
  dropped to COLD first to make room), else COLD. The cache counts what it holds and what was
  already ordered to WARM but is not yet `Cached`; a WARM copy this plan reuses frees its bytes once;
- what cannot be placed is reported (needed vs free), the rest still goes ahead.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections.abc import Iterable

import msgspec

from controlplane.core.projections.cluster import ClusterState, NodeView, RKey
from controlplane.core.projections.replica import ReplicaView
from controlplane.core.requirements import meets
from schemas.inventory import Requirements
from schemas.status import Level, ReplicaState
from schemas.units import gib

PADDING = 0.15  # models are charged 15% over their measured size (activations, CUDA context)
MIN_DEPLOY_S = 300.0  # NDIF's minimum deployment time before a non-dedicated requester may evict
# The exact eviction search tries at most this many victim sets per node before it settles for
# the per-card choice (a node holds a few dozen replicas at most; 1-3 evictions are the norm).
MAX_EVICTION_SETS = 4096
# On clusters of more than EXACT_NODES live nodes one replica's eviction search tries at most
# DECISION_EVICTION_SETS victim sets over all nodes together (nodes best bound first), then keeps
# the best found so far; smaller clusters have no such cap (each node keeps its own).
EXACT_NODES = 16
DECISION_EVICTION_SETS = 256


class Candidate(enum.IntEnum):
    DEPLOYED = 0
    CACHED_AND_FREE = 1
    FREE = 2
    CACHED_AND_FULL = 3
    FULL = 4
    CANT_ACCOMMODATE = 5


class PlacementRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Place `replicas` more replicas of a model (what decide() asks of placement; not a user request,
    schemas.requests.Request)."""

    model_key: str
    size_bytes: int  # measured size; the headroom is added here
    replicas: int
    dedicated: bool = False
    headroom: float = PADDING  # charged size = ceil(size_bytes * (1 + headroom))
    gpus: int | None = None  # exactly this many cards of one node per replica; None: as few as fit
    requires: Requirements | None = None  # only nodes meeting these are considered (None: any)
    evicts: bool = True  # False (a deploy a user's request asked for): free room only, no replica evicted


class Placed(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replica_id: int
    node_id: str
    gpu_indices: tuple[int, ...]
    bytes_per_gpu: int
    source: Level  # WARM when a cached copy is reused (same id), else COLD
    candidate: Candidate
    dedicated: bool = False
    headroom: float = PADDING


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
    headroom: float = PADDING


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    placed: tuple[Placed, ...] = ()
    evictions: tuple[Eviction, ...] = ()
    shortfalls: tuple[Shortfall, ...] = ()
    min_deploy_s: float = MIN_DEPLOY_S  # the setting the plan was made with (recorded in its events)


def padded(size_bytes: int, headroom: float = PADDING) -> int:
    """The charge of a model: its measured size plus `headroom` (activations, CUDA context)."""
    return int(math.ceil(size_bytes * (1 + headroom)))


def card_share(charge: int, gpus: int) -> int:
    """What each of `gpus` cards is charged for one replica of a model charged `charge` bytes."""
    return math.ceil(charge / gpus)


def gpus_refusal(state: ClusterState, charge: int, gpus: int, requires: Requirements | None = None) -> str | None:
    """Why `gpus` cards per replica can never hold a `charge`-byte model here, or None if some can.

    A live node (meeting `requires`) must have `gpus` cards each at least `ceil(charge / gpus)` big
    (free or not: busy cards are a matter for evictions and retries, too small ones are not).
    """
    share = card_share(charge, gpus)
    best = 0
    for node in state.nodes.values():
        if not node.alive or not meets(node, requires):
            continue
        sizes = sorted((g.memory_bytes for g in node.gpus), reverse=True)
        if len(sizes) >= gpus:
            if sizes[gpus - 1] >= share:
                return None
            best = max(best, sizes[gpus - 1])
    if not best:
        return f"--gpus {gpus}: no live node has {gpus} GPU cards"
    return (f"--gpus {gpus}: each card would be charged {gib(share)} ({gib(charge)} / {gpus}), but no live "
            f"node has {gpus} cards that big (at most {gib(best)} on the {gpus}th largest card of a node)")


def _node_order(state: ClusterState, seed: int, requires: Requirements | None = None) -> list[NodeView]:
    """Live nodes with GPUs (meeting `requires`) in the order ties are broken: sorted by id, rotated
    by the seed.

    Each command's seed (recorded in its events) starts the scan at a different node, spreading
    replicas across equally good nodes; the same seed gives the same order on replay.
    """
    live = [n for n in state.live_nodes() if meets(n, requires)] if requires else state.live_nodes()
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
        self.cpu_extra: dict[str, int] = {}  # node -> CPU cache bytes this plan sends there (evicted to WARM)
        self.reused: set[RKey] = set()  # WARM replicas this plan brings back
        self.touched: set[str] = set()  # nodes whose cards this plan changed (the state's index is stale)
        self.sets_left: int | None = None  # victim sets the current eviction search may still try (None: no cap)
        self.sets_tried = 0  # victim sets tried by this plan (all its searches)

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


def _shape(size: int, card_bytes: int, gpus: int | None = None) -> tuple[int, int]:
    """(cards, bytes per card) for a charged size on cards of `card_bytes` (or exactly `gpus` cards)."""
    n = gpus if gpus else max(1, math.ceil(size / card_bytes))
    return n, card_share(size, n)


def _evictable(r: ReplicaView, requester: str, dedicated: bool, now_s: float, min_deploy_s: float) -> bool:
    if r.dedicated or r.model_key == requester or r.state is not ReplicaState.AVAILABLE:
        return False
    if dedicated:
        return True
    loaded = r.loaded_at.timestamp() if r.loaded_at else None
    return loaded is not None and now_s - loaded >= min_deploy_s


def _card_evictions(w: _Work, node_id: str, g: int, total: int, bpg: int, req: PlacementRequest, now_s: float,
                    min_deploy_s: float) -> tuple[int, int, tuple[RKey, ...]] | None:
    """Fewest, then smallest, evictions that free `bpg` on one card: (count, bytes, keys) or None."""
    need = bpg - w.free(node_id, g, total)
    if need <= 0:
        return (0, 0, ())
    cands = sorted(
        ((b, k) for k, b in w.state.card_replicas(node_id, g).items()
         if k not in w.gone and req.evicts and _evictable(w.state.replicas[k], req.model_key, req.dedicated, now_s, min_deploy_s)),
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


class _Spread:
    """Where one model's replicas meant to stay HOT are (the fold's and this plan's): the spread rule's input."""

    def __init__(self, w: _Work, model_key: str) -> None:
        self.count: dict[str, int] = {}  # node -> replicas of the model there
        self.cards: dict[str, dict[int, int]] = {}  # node -> card -> replicas of the model on it
        for r in w.state.model_replicas(model_key):
            if r.on_gpu and r.desired is Level.HOT and r.key not in w.gone:
                self.add(r.node_id, r.gpu_indices)

    def add(self, node_id: str, gpus: Iterable[int]) -> None:
        self.count[node_id] = self.count.get(node_id, 0) + 1
        on = self.cards.setdefault(node_id, {})
        for g in gpus:
            on[g] = on.get(g, 0) + 1


def _node_evictions(w: _Work, node_id: str, req: PlacementRequest, n: int, bpg: int, now_s: float, min_deploy_s: float,
                    bound: tuple[int, int] | None = None) -> tuple[tuple[int, ...], tuple[RKey, ...]] | None:
    """Fewest, then smallest (total bytes), evictions that free `bpg` on `n` cards of one node.

    Exact: victim sets are tried by size, so one replica spanning every card needed beats one
    victim per card. `bound` (count, bytes) is the best another node offers: only strictly better
    sets are looked for. A size whose largest victims cannot free what the `n` least needy cards
    lack is skipped untried, and so is one below what each card's own fewest victims allow.
    Past MAX_EVICTION_SETS tries, or once the decision's budget (`_Work.sets_left`) is spent, it
    settles for the per-card choice.
    Returns (cards, victims) or None when no evictable set frees enough (or none beats `bound`).
    """
    node = w.state.nodes[node_id]
    frees = {g.index: w.free(node_id, g.index, g.memory_bytes) for g in node.gpus if g.memory_bytes >= bpg}
    if len(frees) < n:
        return None
    vic: dict[RKey, list[tuple[int, int]]] = {}  # victim -> (card, bytes freed there) on the usable cards
    for g in frees:
        for k, b in w.state.card_replicas(node_id, g).items():
            if k in w.gone:
                continue
            r = w.state.replicas[k]
            if r.desired is Level.HOT and req.evicts and _evictable(r, req.model_key, req.dedicated, now_s, min_deploy_s):
                vic.setdefault(k, []).append((g, b))

    def cards_after(victims: Iterable[RKey]) -> tuple[int, ...] | None:
        f = dict(frees)
        for k in victims:
            for g, b in vic[k]:
                f[g] += b
        ok = [(v, g) for g, v in f.items() if v >= bpg]
        if len(ok) < n:
            return None
        ok.sort()  # best fit: least free first
        return tuple(sorted(g for _, g in ok[:n]))

    if not vic:
        return None
    foot = {k: w.state.replicas[k].bytes_per_gpu * len(w.state.replicas[k].gpu_indices) for k in vic}
    keys = sorted(vic, key=lambda k: (foot[k], k))
    if cards_after(keys) is None:
        return None
    lack = sum(sorted(max(0, bpg - f) for f in frees.values())[:n])  # the least any n cards lack
    freed = sorted((sum(b for _, b in vic[k]) for k in keys), reverse=True)  # what each victim frees here
    sizes = [foot[k] for k in keys]  # ascending
    prefix = [0]
    for b in sizes:
        prefix.append(prefix[-1] + b)
    tried = 0

    def rec(best: _Best, start: int, chosen: list[RKey], total: int, left: int) -> bool:
        """Depth-first over victim sets of one size, smallest totals first; False: out of budget."""
        nonlocal tried
        if left == 0:
            tried += 1
            w.sets_tried += 1
            if tried > MAX_EVICTION_SETS:
                return False
            if w.sets_left is not None:
                if w.sets_left <= 0:
                    return False
                w.sets_left -= 1
            cards = cards_after(chosen)
            if cards is not None:
                best.total, best.victims, best.cards = total, tuple(chosen), cards
            return True
        for i in range(start, len(keys) - left + 1):
            # Keys ascend by size: the cheapest completion from i on only grows with i.
            if best.total is not None and total + prefix[i + left] - prefix[i] >= best.total:
                break
            chosen.append(keys[i])
            ok = rec(best, i + 1, chosen, total + sizes[i], left - 1)
            chosen.pop()
            if not ok:
                return False
        return True

    # Each card needs at least as many victims as its own largest victims take to free what it
    # lacks; any set readying `n` cards has at least the `n`th smallest of those counts, and
    per_card: dict[int, list[int]] = {g: [] for g in frees}
    for on in vic.values():
        for g, b in on:
            per_card[g].append(b)
    needs = []
    for g, f in frees.items():
        m, got, bs = 0, f, sorted(per_card[g], reverse=True)
        while got < bpg and m < len(bs):
            got += bs[m]
            m += 1
        if got >= bpg:
            needs.append(m)
    needs.sort()
    # A victim counts on at most `span` of the cards: the `n` cards' counts add up to at most
    # `span` times the set's size. (`cards_after(keys)` found `n` cards: there are enough counts.)
    span = max(len(on) for on in vic.values())
    least = max(needs[n - 1], -(-sum(needs[:n]) // span))
    most = len(keys) if bound is None else min(len(keys), bound[0])
    for size in range(least, most + 1):
        if sum(freed[:size]) < lack:
            continue  # no `size` victims free enough
        best = _Best(bound[1] if bound is not None and size == bound[0] else None)
        if not rec(best, 0, [], 0, size):
            return _per_card_evictions(w, node_id, frees, req, n, bpg, now_s, min_deploy_s)
        if best.victims is not None:
            return best.cards, best.victims
    return None  # nothing beats `bound` here (without a bound: unreachable, all victims free enough)


class _Best:
    """The best victim set of one size found so far (`total` to beat: a bound before any is found)."""

    __slots__ = ("cards", "total", "victims")

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.victims: tuple[RKey, ...] | None = None
        self.cards: tuple[int, ...] = ()


def _per_card_evictions(w: _Work, node_id: str, frees: dict[int, int], req: PlacementRequest, n: int, bpg: int,
                        now_s: float, min_deploy_s: float) -> tuple[tuple[int, ...], tuple[RKey, ...]] | None:
    """The bounded fallback: each card's own fewest-then-smallest victims, the `n` cheapest cards."""
    costs = []
    for i, total in ((g.index, g.memory_bytes) for g in w.state.nodes[node_id].gpus if g.index in frees):
        c = _card_evictions(w, node_id, i, total, bpg, req, now_s, min_deploy_s)
        if c is not None:
            costs.append((c[0], c[1], i, c[2]))
    if len(costs) < n:
        return None
    costs.sort()
    chosen = costs[:n]
    return tuple(sorted(c[2] for c in chosen)), tuple(dict.fromkeys(k for c in chosen for k in c[3]))


def _assess_evict(w: _Work, node_id: str, req: PlacementRequest, size: int, warm: ReplicaView | None, now_s: float,
                  min_deploy_s: float, bound: tuple[int, int] | None = None,
                  ) -> tuple[Candidate, tuple[int, ...], int, tuple[RKey, ...]]:
    """A node's level for one replica after evictions: (candidate, cards, bytes per card, evictions);
    with `bound` (count, bytes), only evictions strictly better than it count."""
    n, bpg = _shape(size, w.state.nodes[node_id].max_card_bytes, req.gpus)
    got = _node_evictions(w, node_id, req, n, bpg, now_s, min_deploy_s, bound)
    if got is None:
        return Candidate.CANT_ACCOMMODATE, (), bpg, ()
    level = Candidate.CACHED_AND_FULL if warm is not None else Candidate.FULL
    return level, got[0], bpg, got[1]


def plan(state: ClusterState, requests: Iterable[PlacementRequest], *, now_s: float, seed: int = 0,
         min_deploy_s: float = MIN_DEPLOY_S) -> Plan:
    """Place every request's replicas (largest models first). Deterministic for (state, args)."""
    w = _Work(state)
    placed: list[Placed] = []
    evictions: list[Eviction] = []
    shortfalls: list[Shortfall] = []
    next_ids: dict[str, int] = {}
    every = _node_order(state, seed)
    for req in sorted(requests, key=lambda r: (-r.size_bytes, r.model_key)):
        nodes = every if req.requires is None else _node_order(state, seed, req.requires)
        pos = _Positions(nodes, seed)
        size = padded(req.size_bytes, req.headroom)
        m = state.models.get(req.model_key)
        next_ids.setdefault(req.model_key, m.next_replica_id if m else 0)
        spread = _Spread(w, req.model_key)
        short = best_offer = 0
        for i in range(req.replicas):
            choice = _choose(w, nodes, pos, req, size, spread, now_s, min_deploy_s)
            if choice is None:
                # Nothing changed since this choice: the request's other replicas cannot be placed either.
                short = req.replicas - i
                best_offer = _best_offer(w, nodes, size, req.gpus)
                break
            level, node_id, gpus, bpg, evict_keys, warm = choice
            if warm is not None:
                # Its CPU bytes are free once: `_evict` leaves reused copies out of the cache's count.
                rid, source = warm.replica_id, Level.WARM
                w.reused.add(warm.key)
            else:
                rid, source = next_ids[req.model_key], Level.COLD
                next_ids[req.model_key] = rid + 1
            for k in evict_keys:
                evictions.extend(_evict(w, k, req.model_key, rid))
            w.take(node_id, gpus, bpg)
            spread.add(node_id, gpus)
            placed.append(Placed(model_key=req.model_key, replica_id=rid, node_id=node_id, gpu_indices=gpus,
                                 bytes_per_gpu=bpg, source=source, candidate=level, dedicated=req.dedicated,
                                 headroom=req.headroom))
        if short:
            shortfalls.append(Shortfall(model_key=req.model_key, replicas=short, needed_bytes=size,
                                        free_bytes=best_offer, headroom=req.headroom))
    return Plan(placed=tuple(placed), evictions=tuple(evictions), shortfalls=tuple(shortfalls),
                min_deploy_s=min_deploy_s)


_Choice = tuple[Candidate, str, tuple[int, ...], int, tuple[RKey, ...], "ReplicaView | None"]


class _Positions:
    """Node id -> place in the plan's seeded order, looked up only for the few nodes ranked one by one
    (a dict of every node per plan cost more than the whole scan it serves)."""

    def __init__(self, nodes: list[NodeView], seed: int) -> None:
        self.nodes = nodes
        self.ids: list[str] | None = None
        self.k = seed % len(nodes) if nodes else 0

    def __contains__(self, node_id: str) -> bool:
        return self.get(node_id) is not None

    def __getitem__(self, node_id: str) -> int:
        got = self.get(node_id)
        assert got is not None
        return got

    def get(self, node_id: str) -> int | None:
        if self.ids is None:  # the order is sorted ids rotated by the seed (`_node_order`): undo it once
            cut = len(self.nodes) - self.k
            self.ids = [n.node_id for n in self.nodes[cut:]] + [n.node_id for n in self.nodes[:cut]]
        i = bisect.bisect_left(self.ids, node_id)
        if i == len(self.ids) or self.ids[i] != node_id:
            return None
        return (i - self.k) % len(self.ids)


def _warm_copies(w: _Work, model_key: str) -> dict[str, ReplicaView]:
    """Node -> the model's first WARM copy there not yet reused by this plan (live nodes only)."""
    warm_by_node: dict[str, ReplicaView] = {}
    for r in w.state.model_replicas(model_key):
        if r.state is ReplicaState.CACHED and r.key not in w.reused and r.node_id not in warm_by_node:
            node = w.state.nodes.get(r.node_id)
            if node is not None and node.alive:
                warm_by_node[r.node_id] = r
    return warm_by_node


def _choose(w: _Work, nodes: list[NodeView], pos: _Positions, req: PlacementRequest, size: int, spread: _Spread,
            now_s: float, min_deploy_s: float) -> _Choice | None:
    """The best node for one more replica: (level, node, cards, bytes per card, evictions, WARM copy).

    What fits without evictions ranks by (replicas of the model on the node, the most replicas of
    the model on a card it would share, no WARM copy there, seeded node order). Nodes holding the model or a WARM copy of it
    are few and ranked exactly; every other node ranks (no, 0, no WARM, order), so the first of
    them that fits is the only one worth finding. Only when nothing fits as is are eviction costs
    computed, over every node.
    """
    warm_by_node = _warm_copies(w, req.model_key)
    best: tuple[tuple[int, int, bool, int], _Choice] | None = None
    special = set(spread.count) | set(warm_by_node)
    for node_id in special:
        if node_id not in pos:
            continue
        fit = _fits(w, w.state.nodes[node_id], size, req.gpus, spread.cards.get(node_id))
        if fit is None:
            continue
        warm = warm_by_node.get(node_id)
        count = spread.count.get(node_id, 0)
        rank = (count, fit[2], warm is None, pos[node_id])
        if best is None or rank < best[0]:
            level = Candidate.CACHED_AND_FREE if warm else Candidate.DEPLOYED if count else Candidate.FREE
            best = (rank, (level, node_id, fit[0], fit[1], (), warm))
    if best is None or best[0][:3] > (0, 0, True):  # a node without the model would rank better
        shapes: dict[int, tuple[int, int]] = {}  # largest card -> (cards, bytes per card)
        state, touched = w.state, w.touched
        for node in nodes:
            node_id = node.node_id
            if node_id in special:
                continue
            nf = state.node_free(node_id)
            shape = shapes.get(nf.card_bytes)
            if shape is None:
                shape = shapes[nf.card_bytes] = _shape(size, nf.card_bytes, req.gpus)
            n, bpg = shape
            if node_id not in touched and (len(nf.free) < n or nf.free[n - 1] < bpg):
                continue  # the per-node index says full (as `_fits` would, without the call)
            fit = _fits(w, node, size, req.gpus, None)
            if fit is not None:
                return Candidate.FREE, node_id, fit[0], fit[1], (), None
    if best is not None:
        return best[1]
    return _choose_evict(w, nodes, req, size, warm_by_node, now_s, min_deploy_s)


def _evict_lower_bound(w: _Work, node: NodeView, req: PlacementRequest, size: int,
                       shapes: dict[int, tuple[int, int]]) -> tuple[int, int] | None:
    """A lower bound (count, bytes) on the evictions a node needs for one replica, read from the
    state's per-node index alone; None when no set of its replicas can free enough.

    The `n` cards a replica needs lack at least what the `n` freest cards lack (`lack`); a victim
    frees at most its footprint, so at least the `k` largest footprints must add up to `lack`, and
    those `k` victims weigh at least `lack` and at least the `k` smallest footprints. Nodes this
    plan changed are not summarised by the index: (0, 0), searched as they are.
    """
    if node.node_id in w.touched:
        return (0, 0)
    card_bytes, free, _, fps, _ = w.state.node_free(node.node_id)
    shape = shapes.get(card_bytes)
    if shape is None:
        shape = shapes[card_bytes] = _shape(size, card_bytes, req.gpus)
    return _index_bound(free, fps, *shape)


_UNSET = object()
_MEMO_SHAPES = 32  # replica shapes memoised per node summary (cleared past this: a bound, not a leak)


def _index_bound(free: tuple[int, ...], fps: tuple[int, ...], n: int, bpg: int) -> tuple[int, int] | None:
    """`_evict_lower_bound` from a node's summary: free bytes per card (descending), footprints (ascending)."""
    if len(free) < n:
        return None
    if n == 1:
        lack = bpg - free[0]
    elif free[0] <= bpg:  # free bytes descend: each of the `n` freest cards lacks something
        lack = n * bpg - sum(free[:n])
    else:
        lack = sum(bpg - f for f in free[:n] if f < bpg)
    if lack <= 0:
        return (0, 0)
    one = bisect.bisect_left(fps, lack)
    if one < len(fps):  # one victim may do: at least the smallest footprint that covers `lack` alone
        return 1, fps[one]
    got = 0
    for k, b in enumerate(reversed(fps), 1):
        got += b
        if got >= lack:
            return k, max(lack, sum(fps[:k]))
    return None


def _choose_evict(w: _Work, nodes: list[NodeView], req: PlacementRequest, size: int, warm_by_node: dict[str, ReplicaView],
                  now_s: float, min_deploy_s: float) -> _Choice | None:
    """The node whose evictions rank best: (level, how many, how many bytes, seeded order).

    Best first: nodes are searched in the order of their lower bound (`_evict_lower_bound`), and
    the search stops at the first node whose bound cannot beat the best found, as every later one
    cannot either; each search only looks for victim sets that beat the best so far (or tie it
    from a node earlier in the seeded order). This is the exhaustive ranking, with less work.
    """
    shapes: dict[int, tuple[int, int]] = {}
    cands = []
    touched, node_free = w.touched, w.state.node_free
    for i, node in enumerate(nodes):
        warm = warm_by_node.get(node.node_id)
        if node.node_id in touched or warm is not None:
            lb = _evict_lower_bound(w, node, req, size, shapes)
            if lb is None:
                continue
            cands.append((0 if warm is not None else 1, lb[0], lb[1], i, node, warm))
            continue
        # `_evict_lower_bound` inlined for the many nodes this plan has not touched (the hot loop),
        # memoised on the state's per-node summary (a pure function of it and the replica's shape).
        nf = node_free(node.node_id)
        shape = shapes.get(nf.card_bytes)
        if shape is None:
            shape = shapes[nf.card_bytes] = _shape(size, nf.card_bytes, req.gpus)
        memo = nf.memo
        got = memo.get(shape, _UNSET) if memo is not None else _UNSET
        if got is _UNSET:
            got = _index_bound(nf.free, nf.footprints, *shape)
            if memo is not None:
                if len(memo) >= _MEMO_SHAPES:
                    memo.clear()
                memo[shape] = got
        if got is not None:
            cands.append((1, *got, i, node, None))  # type: ignore[misc]
    heapq.heapify(cands)  # positions are unique: nodes themselves are never compared
    w.sets_left = _sets_budget(len(nodes))
    brank: tuple[int, int, int, int] | None = None  # (0: CACHED_AND_FULL / 1: FULL, count, bytes, position)
    bchoice: _Choice | None = None
    while cands:
        level, lc, lbytes, i, node, warm = heapq.heappop(cands)
        if brank is not None and (level, lc, lbytes, i) >= brank:
            break  # popped by bound: no node from here on can beat the best
        bound = None
        if brank is not None and brank[0] == level:
            bound = (brank[1], brank[2] + (1 if i < brank[3] else 0))  # an earlier node wins a tie
        got_level, gpus, bpg, keys = _assess_evict(w, node.node_id, req, size, warm, now_s, min_deploy_s, bound)
        if got_level is Candidate.CANT_ACCOMMODATE:
            continue
        evicted = sum(w.state.replicas[k].bytes_per_gpu * len(w.state.replicas[k].gpu_indices) for k in keys)
        rank = (0 if got_level is Candidate.CACHED_AND_FULL else 1, len(keys), evicted, i)
        if brank is None or rank < brank:
            brank, bchoice = rank, (got_level, node.node_id, gpus, bpg, keys, warm)
        if w.sets_left is not None and w.sets_left <= 0:
            break  # the decision's budget is spent: the best found so far stands
    w.sets_left = None
    return bchoice


def _sets_budget(nodes: int) -> int | None:
    """Victim sets one replica's eviction search may try over all nodes: no cap up to EXACT_NODES."""
    return None if nodes <= EXACT_NODES else DECISION_EVICTION_SETS


def _fits(w: _Work, node: NodeView, size: int, gpus: int | None,
          crowd: dict[int, int] | None) -> tuple[tuple[int, ...], int, int] | None:
    """(cards, bytes per card, the most replicas of the model on one chosen card) if the replica
    fits on the node without evictions. Cards are taken by (fewest replicas of the model on them,
    from `crowd`; not being vacated; best fit: least free first): so replicas of one model spread
    evenly over a node's cards (4 on 2 cards land 2+2), a card another replica is leaving is used
    only when no other card fits (its load would wait for that replica to go), and other models
    still pack."""
    card_bytes, free, _, _, _ = w.state.node_free(node.node_id)
    n, bpg = _shape(size, card_bytes, gpus)
    # The state's per-node index rejects most full nodes in O(1); nodes this plan changed are exact below.
    if node.node_id not in w.touched and (len(free) < n or free[n - 1] < bpg):
        return None
    fitting = []
    for g in node.gpus:
        f = w.free(node.node_id, g.index, g.memory_bytes)
        if f >= bpg:
            fitting.append(((crowd or {}).get(g.index, 0), _vacating(w, node.node_id, g.index), f, g.index))
    if len(fitting) < n:
        return None
    fitting.sort()
    chosen = fitting[:n]
    return tuple(sorted(c[3] for c in chosen)), bpg, max(c[0] for c in chosen)


def _vacating(w: _Work, node_id: str, index: int) -> bool:
    """Does a replica that is leaving (no longer desired HOT, or evicted by this plan) still hold the card?"""
    replicas = w.state.replicas
    return any(w.state.replicas[k].desired is not Level.HOT or k in w.gone
               for k in w.state.card_replicas(node_id, index) if k in replicas)


def _best_offer(w: _Work, nodes: list[NodeView], size: int, gpus: int | None = None) -> int:
    best = 0
    for node in nodes:
        n, _ = _shape(size, node.max_card_bytes, gpus)
        frees = sorted((max(w.free(node.node_id, g.index, g.memory_bytes), 0) for g in node.gpus), reverse=True)
        best = max(best, sum(frees[:n]))
    return best


def _evict(w: _Work, key: RKey, by_model: str, by_rid: int) -> list[Eviction]:
    """Evict a HOT replica under pressure: WARM if its node's CPU cache can make room, else COLD.

    The cache holds its WARM copies (less those leaving for COLD and those this plan reuses or
    drops), the replicas already ordered to WARM but not yet `Cached`, and what this plan sent there.
    """
    r = w.state.replicas[key]
    w.gone.add(key)
    w.touched.add(r.node_id)
    node = w.state.nodes[r.node_id]
    size = r.bytes_per_gpu * len(r.gpu_indices)
    out: list[Eviction] = []
    cached = {k: b for k, b in w.state.cpu_replicas(r.node_id).items()
              if k not in w.gone and k not in w.reused and w.state.replicas[k].desired is not Level.COLD}
    pending = w.state.cpu_pending(r.node_id)
    room = node.cpu_cache_bytes - sum(cached.values()) - pending - w.cpu_extra.get(r.node_id, 0)
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
                w.gone.add(k)  # out of `cached` from now on: its bytes are free once
                out.append(Eviction(model_key=k[0], replica_id=k[1], node_id=r.node_id, target=Level.COLD,
                                    by_model_key=by_model, by_replica_id=by_rid))
            w.cpu_extra[r.node_id] = w.cpu_extra.get(r.node_id, 0) + size
    out.append(Eviction(model_key=r.model_key, replica_id=r.replica_id, node_id=r.node_id, target=target,
                        by_model_key=by_model, by_replica_id=by_rid))
    return out


def scale_down_victims(replicas: Iterable[ReplicaView], n: int) -> list[ReplicaView]:
    """The `n` replicas of one model a scale-down removes, so that those kept stay spread over nodes
    (Ray Serve's downscale undoes its spread; ours must not): each next one from the node that still
    holds the most of them, ties to the highest replica id. So the kept replicas cover as many nodes
    as they can (min(kept, nodes)) and the most crowded node holds as few as any choice allows; on
    replicas one per node this is the highest ids, as before."""
    left = sorted(replicas, key=lambda r: r.replica_id)
    out: list[ReplicaView] = []
    for _ in range(max(0, min(n, len(left)))):
        count: dict[str, int] = {}
        for r in left:
            count[r.node_id] = count.get(r.node_id, 0) + 1
        victim = max(left, key=lambda r: (count[r.node_id], r.replica_id))
        left.remove(victim)
        out.append(victim)
    return out


def cache_target(state: ClusterState, r: ReplicaView, pending_cpu: dict[str, int]) -> Level:
    """Where an admin eviction of a HOT replica goes: WARM if its node's cache has room now, else COLD.

    (Admin evictions do not drop other WARM copies; pressure evictions do.) The cache's committed
    bytes count replicas already ordered to WARM but not yet `Cached`; `pending_cpu` carries what
    this decision already put in each node's cache.
    """
    node = state.nodes.get(r.node_id)
    if node is None or not node.alive:
        return Level.COLD
    size = r.bytes_per_gpu * len(r.gpu_indices)
    room = node.cpu_cache_bytes - state.cpu_committed(r.node_id) - pending_cpu.get(r.node_id, 0)
    if size <= room:
        pending_cpu[r.node_id] = pending_cpu.get(r.node_id, 0) + size
        return Level.WARM
    return Level.COLD
