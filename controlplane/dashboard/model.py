"""The dashboard's read model: the live fold (`ClusterState`, as the controller folds it) and the newest
events in memory. No I/O here (past positions and older events come from the log and its snapshots:
controlplane/dashboard/past.py).

`DashboardModel(start)` begins at a state (the newest snapshot that matches the log, or the empty
one) and `add(seq, item)` folds each stored item after it, keeping what the pages ask for fast:
the items themselves (events tail, paging), per-replica history rows (each step with the state it
left, recorded as it is folded) and a prefix maximum of event times (an ISO time maps to a sequence
by bisection). At most `window` items are kept (the newest): its memory follows the window, not
the history.

The fold also feeds `LogSeries` (series.py: replicas by phase per model, committed memory per card,
over the log's time), seeded from the start state so a snapshot start counts what it holds, and counts
events by type (`/metrics`). Lifelines (`lifeline`) read the kept per-replica rows.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.core.projections.replica import ReplicaView
from controlplane.dashboard.detail import event_detail
from controlplane.dashboard.series import MAX_KEPT, PHASES, LogSeries, phase
from controlplane.dashboard.views import Block, Card, Held, Node, ReplicaRow
from controlplane.store.admin import resolve_name
from controlplane.store.history import Row, left_row
from schemas import errors as errs
from schemas.errors import InvalidCommand
from schemas.events import (
    EVENT_TYPES,
    AnyEvent,
    Event,
    ModelUndeployed,
    NodeDeclared,
    NodeJoined,
    NodeLost,
    ReplicaDrained,
    ReplicaEvent,
    ReplicaScheduled,
    Skipped,
    event_tag,
)
from schemas.keys import canonical_model_key, display_name
from schemas.status import Level

Item = AnyEvent | Skipped  # a stored item as the log gives it
MAX_EVENTS_PAGE = 1000
WINDOW = 100_000  # newest items kept in memory; older ones are read from the log when a page asks
MAX_DETAIL = 4000  # characters of an event's detail (an error's text) sent with its row
MAX_LIFELINES = 400  # replicas drawn in one lifeline answer (the cluster's: the most recently moved)


class BadQuery(ValueError):
    """A request the dashboard cannot answer as asked (HTTP 400), with the reason for the user."""


class UnknownEntity(LookupError):
    """A model or replica that is not in the log (HTTP 404)."""


def int_param(q: Any, name: str, *, lo: int = 0, hi: int | None = None) -> int | None:
    """An integer query parameter checked to lie in lo..hi (no `hi`: unbounded); None when absent."""
    raw = q.get(name)
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise BadQuery(f"{name} must be an integer, got {raw[:40]!r}") from None
    if v < lo or (hi is not None and v > hi):
        raise BadQuery(f"{name} must be in {lo}..{hi if hi is not None else 'inf'}, got {v}")
    return v


class Filter:
    """What an events page asks for, checked once (bad input is a BadQuery)."""

    __slots__ = ("actor", "model_key", "replica_id", "type_")

    def __init__(self, model_key: str | None, replica_id: int | None, type_: str | None, actor: str | None) -> None:
        if type_ is not None and type_ not in EVENT_TYPES and type_ != "Skipped":
            raise BadQuery(f"unknown event type {type_[:64]!r}; one of {', '.join(sorted(EVENT_TYPES))}")
        self.model_key, self.replica_id, self.type_, self.actor = model_key, replica_id, type_, actor

    def __call__(self, item: Item) -> bool:
        if self.model_key is not None and not (isinstance(item, Event) and item.model_key == self.model_key):
            return False
        if self.replica_id is not None and not (isinstance(item, ReplicaEvent) and item.replica_id == self.replica_id):
            return False
        if self.type_ is not None and event_type(item) != self.type_:
            return False
        return self.actor is None or (isinstance(item, Event) and self.actor in item.actor)


DOWN = "down"  # a lifeline's phase while the cluster was off (`ClusterDown`)
DOWN_STATE = "cluster down"


def outage_spans(state: ClusterState, t0: float, t1: float) -> list[list[float]]:
    """The spans the cluster was off (`ClusterDown`, as the log stood at `state`) within [t0, t1]."""
    spans = ([o.down_from.timestamp(), o.up_at.timestamp()] for o in state.outages)
    return [[max(a, t0), min(b, t1)] for a, b in spans if a < t1 and b > t0]


def _cut_outages(segs: list[list[Any]], outages: list[list[float]]) -> list[list[Any]]:
    """Each segment with the parts inside an outage made `down` segments of their own."""
    if not outages:
        return segs
    out: list[list[Any]] = []
    for seg in segs:
        a, b = seg[0], seg[1]
        cut = False
        for oa, ob in outages:
            if ob <= a or oa >= b:
                continue
            if oa > a:
                out.append([a, oa, *seg[2:]])
            out.append([max(a, oa), min(b, ob), DOWN, DOWN_STATE, *seg[4:]])
            a, cut = min(b, ob), True
        if b > a or not cut:  # what is left after the outages (a segment without any kept whole)
            out.append([a, b, *seg[2:]])
    return out


class DashboardModel:
    """The live fold and the newest events. Single-threaded: call from one event loop."""

    def __init__(self, start: ClusterState | None = None, *, window: int = WINDOW,
                 series_keep: int = MAX_KEPT) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.live = start if start is not None else ClusterState()
        self.start_seq = self.live.seq  # where the fold began (a snapshot's seq, or 0)
        self.window = window
        self.seqs: list[int] = []
        self.items: list[Item] = []
        self.max_ts: list[float] = []  # prefix maximum of event times (epoch seconds), from the log's start
        # The prefix maximum before the first item kept: times older than that are the log's to map.
        mt = self.live.max_ts
        self.floor_ts = mt.timestamp() if mt is not None else float("-inf")
        self.replica_rows: dict[tuple[str, int], list[Row]] = {}
        self.model_rows: dict[str, list[int]] = {}  # model -> seqs of its events kept
        self.series = LogSeries(series_keep)  # replicas by phase per model, memory per card, over the log's time
        self.series.seed(self.live.seq, self.floor_ts, self.live)
        self.type_counts: dict[str, int] = {}  # events folded since the start, by type (`/metrics`)

    # ---- folding ---------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self.live.seq

    @property
    def first_kept(self) -> int:
        """The first sequence whose item is in memory (the next one to come when none is)."""
        return self.seqs[0] if self.seqs else self.live.seq + 1

    def add(self, seq: int, item: Item) -> bool:
        """Fold one stored item (a redelivery is ignored). Returns whether it was new."""
        live = self.live
        if seq <= live.seq:
            return False
        before = live.anomaly_count
        cls = item.__class__
        if cls in _REPLICA_EVENTS:  # the hot path: one replica, read before and after the fold
            key: tuple[str, int] = (item.model_key, item.replica_id)  # type: ignore[union-attr,assignment]
            moved = [(key, live.replicas.get(key))]
        else:
            moved = _views_before(live, item)
        held = len(live.replicas)
        live.apply(seq, item)
        self.seqs.append(seq)
        self.items.append(item)
        prev = self.max_ts[-1] if self.max_ts else self.floor_ts
        t = max(prev, item.ts.timestamp()) if isinstance(item, Event) else prev
        self.max_ts.append(t)
        tag = event_type(item)
        self.type_counts[tag] = self.type_counts.get(tag, 0) + 1
        if moved:
            changes = [(old, new) for key, old in moved if (new := live.replicas.get(key)) is not old]
            if changes:
                self.series.moved(seq, t, changes, live)
            # A replica becoming gone can make the fold forget its model's oldest gone one (COLD, on no
            # card: MAX_GONE_KEPT in cluster.py): count it out too, as the fold no longer holds it.
            forgotten = held + sum((o is None) - (n is None) for o, n in changes) - len(live.replicas)
            if forgotten > 0 and cls in _REPLICA_EVENTS:
                self.series.forgot(seq, t, moved[0][0][0], forgotten)
        if isinstance(item, Event) and item.model_key is not None:
            mk = item.model_key
            self.model_rows.setdefault(mk, []).append(seq)
            if isinstance(item, ReplicaEvent):
                self.replica_rows.setdefault((mk, item.replica_id), []).append(left_row(live, seq, item, before))
        if len(self.items) > self.window + max(1, self.window // 10):
            self._trim(len(self.items) - self.window)
        return True

    def add_all(self, stored: Iterable[tuple[int, Item]]) -> None:
        for seq, item in stored:
            self.add(seq, item)

    def _trim(self, n: int) -> None:
        """Forget the oldest `n` items (in a batch, so the cost is spread over window/10 adds)."""
        self.floor_ts = self.max_ts[n - 1]
        cut = self.seqs[n]
        del self.seqs[:n], self.items[:n], self.max_ts[:n]
        for mk in list(self.model_rows):
            rows = self.model_rows[mk]
            del rows[:bisect.bisect_left(rows, cut)]
            if not rows:
                del self.model_rows[mk]
        for key in list(self.replica_rows):
            rr = self.replica_rows[key]
            i = 0
            while i < len(rr) and rr[i][0] < cut:
                i += 1
            del rr[:i]
            if not rr:
                del self.replica_rows[key]

    def kept(self, lo: int, hi: int) -> list[tuple[int, Item]]:
        """The items kept in memory with lo <= seq <= hi."""
        i, j = bisect.bisect_left(self.seqs, lo), bisect.bisect_right(self.seqs, hi)
        return list(zip(self.seqs[i:j], self.items[i:j], strict=True))

    # ---- positions --------------------------------------------------------------------------

    def parse_until(self, until: str) -> int | datetime:
        """`SEQ` (0..last seq) or an ISO time with a timezone."""
        text = until.strip()
        if text.isdigit():
            seq = int(text)
            if seq > self.seq:
                raise BadQuery(f"seq {seq} is past the end of the log (last seq {self.seq})")
            return seq
        try:
            t = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise BadQuery(f"until takes a sequence number or an ISO time with a timezone, got {until[:64]!r}") from None
        if t.tzinfo is None:
            raise BadQuery("until time needs a timezone, e.g. 2026-11-22T14:00:00Z")
        return t

    def seq_at_time(self, t: datetime) -> int | None:
        """The last sequence at or before `t` as `replay --until TIME` folds (it stops at the first
        event later than `t`), when memory can tell; None when the answer is older than what is kept."""
        x = t.timestamp()
        if x < self.floor_ts:
            return None
        i = bisect.bisect_right(self.max_ts, x)
        return self.seqs[i - 1] if i else self.first_kept - 1

    # ---- queries over what is kept ----------------------------------------------------------

    def resolve_model(self, model: str) -> str:
        """A model key the fold or the kept events know, or one whose display name is `model`; a full
        key is taken as given (its events may be older than what is kept); 404 otherwise."""
        known = self.model_rows.keys() | self.live.models.keys() | self.live.undeployed
        if model in known:
            return model
        for mk in sorted(known):
            if display_name(mk) == model:
                return mk
        try:  # any name `ndif` accepts for it: a repo id, a checkpoint path, the short name
            return resolve_name(self.live, model[:500])
        except errs.UnknownModel:
            pass
        except InvalidCommand as exc:  # several models answer to it
            raise BadQuery(str(exc)) from None
        if ":" in model:
            try:
                return canonical_model_key(model)
            except InvalidCommand:
                pass
        raise UnknownEntity(f"unknown model {model[:200]!r}: no event in the log names it")

    def time_of(self, seq: int) -> float | None:
        """The log's time at `seq` (the latest event time up to it), epoch seconds, when memory can
        tell (seq at or after the item before the first kept); None otherwise or before any event."""
        if seq < self.first_kept - 1:
            return None
        i = bisect.bisect_right(self.seqs, seq)
        t = self.max_ts[i - 1] if i else self.floor_ts
        return t if t != float("-inf") else None

    @property
    def start_ts(self) -> float | None:
        """The log's time where what memory keeps begins (the first kept event's, or the start state's)."""
        if self.floor_ts != float("-inf"):
            return self.floor_ts
        return self.max_ts[0] if self.max_ts and self.max_ts[0] != float("-inf") else None

    def lifeline(self, model: str | None, seq: int, t0: float, t1: float,
                 outages: list[list[float]] | None = None) -> dict[str, Any]:
        """One line per replica over [t0, t1] as the log stood at `seq`, from the rows memory keeps:
        segments of one phase and state, each with the event that began it (its type, actor, command
        and the command's verb) and the decision behind it (the replica's latest step a command
        caused, up to that event). Within `outages` (`outage_spans`) a segment is cut and that part
        is phase `down`: the log's last state before an outage is not what ran through it."""
        mk = self.resolve_model(model) if model else None
        lines = []
        for key, rows in self.replica_rows.items():
            if mk is not None and key[0] != mk:
                continue
            n = bisect.bisect_left(rows, (seq + 1,))  # rows folded by `seq`
            if n == 0:
                continue
            segs: list[list[Any]] = []
            decision = None  # the latest step of this replica that a command caused
            for j in range(n):
                q, st, lvl, desired, anomaly = rows[j]
                idx = self._index(q)
                item = self.items[idx]
                if isinstance(item, Event) and item.command_id:
                    decision = q
                start = self.max_ts[idx]
                stop = self.max_ts[self._index(rows[j + 1][0])] if j + 1 < n else t1
                ph = phase(st, lvl) if st else "COLD"
                if segs and segs[-1][2] == ph and segs[-1][3] == st and not anomaly:
                    segs[-1][1] = min(stop, t1)
                    continue
                if stop < t0 or start > t1:
                    continue
                segs.append([max(start, t0), min(stop, t1), ph, st, lvl, desired, q, anomaly, decision])
            if segs:
                lines.append((rows[n - 1][0], key, _cut_outages(segs, outages or [])))
        truncated = max(0, len(lines) - MAX_LIFELINES)
        if truncated:  # the cluster's: the replicas that moved last
            lines = sorted(lines, key=lambda x: x[0])[-MAX_LIFELINES:]
        lines.sort(key=lambda x: x[1])
        if lines:  # nothing before the first line's start: the window starts there
            t0 = max(t0, min(segs[0][0] for _, _, segs in lines))
        causes = {sg[6]: self._cause(sg[6]) for _, _, segs in lines for sg in segs}
        decided = {sg[8] for _, _, segs in lines for sg in segs if sg[8] is not None}
        decisions = {q: {"seq": q, **self._cause(q)} for q in decided}
        return {"model_key": mk, "t0": t0, "t1": t1, "seq": min(seq, self.seq), "truncated": truncated,
                "phases": [*PHASES, DOWN], "kept_from": self.first_kept, "outages": outages or [],
                "replicas": [{"model_key": k[0], "name": display_name(k[0]), "replica_id": k[1],
                              "segments": [{"t0": a, "t1": b, "phase": ph, "state": st, "level": lvl,
                                            "desired": des, "seq": q, "anomaly": an, **causes[q],
                                            "decision": decisions.get(dq) if dq is not None else None}
                                           for a, b, ph, st, lvl, des, q, an, dq in segs]}
                             for _, k, segs in lines]}

    def _cause(self, seq: int) -> dict[str, Any]:
        row = event_row(seq, self.items[self._index(seq)])
        out = {k: row.get(k) for k in ("type", "ts", "actor", "command_id", "detail")}
        cid = row.get("command_id")
        rec = self.live.commands.get(cid) if cid else None
        out["verb"] = rec.verb if rec is not None and rec.verb else None
        return out

    def events_kept(self, match: Filter, *, below: int, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` matching kept events with seq < `below`, newest first."""
        at: Callable[[int], int]
        if match.model_key is not None:
            seqs = self.model_rows.get(match.model_key, [])
            candidates: Iterator[int] | range = reversed(seqs[:bisect.bisect_left(seqs, below)])
            at = self._index
        else:
            candidates = range(bisect.bisect_left(self.seqs, below) - 1, -1, -1)
            at = _same
        rows: list[dict[str, Any]] = []
        for c in candidates:
            i = at(c)
            item = self.items[i]
            if match(item):
                rows.append(event_row(self.seqs[i], item))
                if len(rows) == limit:
                    break
        return rows

    def _index(self, seq: int) -> int:
        return bisect.bisect_left(self.seqs, seq)

    def history_kept(self, mk: str, replica_id: int | None, lo: int, hi: int) -> list[dict[str, Any]]:
        """The history steps of a model (or replica) kept in memory with lo <= seq <= hi."""
        if replica_id is not None:
            rows = [r for r in self.replica_rows.get((mk, replica_id), []) if lo <= r[0] <= hi]
            return [history_row(r[0], self.items[self._index(r[0])], r) for r in rows]
        by_seq = {r[0]: r for (m, _rid), rr in self.replica_rows.items() if m == mk for r in rr if lo <= r[0] <= hi}
        seqs = self.model_rows.get(mk, [])
        return [history_row(s, self.items[self._index(s)], by_seq.get(s))
                for s in seqs[bisect.bisect_left(seqs, lo):bisect.bisect_right(seqs, hi)]]


def _same(i: int) -> int:
    return i


_REPLICA_EVENTS = frozenset(c for c in EVENT_TYPES.values() if issubclass(c, ReplicaEvent))


def _views_before(live: ClusterState, item: Item) -> list[tuple[tuple[str, int], ReplicaView | None]]:
    """The replica views an item may change, as they are before it is folded (for `LogSeries`)."""
    if isinstance(item, ReplicaEvent):
        key = (item.model_key, item.replica_id)
        return [(key, live.replicas.get(key))]
    if isinstance(item, NodeLost):
        return [(k, r) for k, r in live.replicas.items() if r.node_id == item.node_id]
    if isinstance(item, ModelUndeployed):
        return [(r.key, r) for r in live.model_replicas(item.model_key)]
    return []


def event_type(item: Item) -> str:
    return "Skipped" if isinstance(item, Skipped) else event_tag(item)


def event_row(seq: int, item: Item) -> dict[str, Any]:
    """One event as the page shows it: sequence, time, type, actor, command id, who it is about (and
    why a drain ended)."""
    if isinstance(item, Skipped):
        return {"seq": seq, "type": "Skipped", "reason": item.reason, "skipped_type": item.type}
    row: dict[str, Any] = {"seq": seq, "ts": item.ts.isoformat(), "type": event_tag(item), "actor": item.actor,
                           "command_id": item.command_id, "model_key": item.model_key}
    if isinstance(item, ReplicaEvent):
        row["replica_id"] = item.replica_id
        row["node_id"] = item.node_id
        if isinstance(item, ReplicaDrained):
            row["drain"] = str(item.reason)  # idle (a dispatcher said so), unserved, or timeout
        elif isinstance(item, ReplicaScheduled):
            row["gpus"] = list(item.gpu_indices)
    elif isinstance(item, (NodeJoined, NodeLost, NodeDeclared)):
        row["node_id"] = item.node_id
    detail = event_detail(item)
    if detail:
        row["detail"] = detail if len(detail) <= MAX_DETAIL else detail[:MAX_DETAIL] + " [...]"
    return row


def with_cards(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History steps with the cards each left its replica placed on (set by its latest
    ReplicaScheduled in these steps)."""
    gpus: dict[int, list[int]] = {}
    for row in steps:
        rid = row.get("replica_id")
        if rid is not None:
            if row["type"] == "ReplicaScheduled":
                gpus[rid] = row["gpus"]
            row["gpus"] = gpus.get(rid, [])
    return steps


def anomaly_json(a: Any) -> dict[str, Any]:
    return {"seq": a.seq, "event_type": a.event_type, "message": a.message, "model_key": a.model_key,
            "name": display_name(a.model_key) if a.model_key else None, "replica_id": a.replica_id}


def anomalies_json(state: ClusterState) -> dict[str, Any]:
    """Every anomaly the fold kept (the last 1,000) up to the state's seq, newest first, and the count."""
    return {"seq": state.seq, "anomaly_count": state.anomaly_count, "skipped": state.skipped,
            "anomalies": [anomaly_json(a) for a in reversed(state.anomalies)]}


def history_row(seq: int, item: Item, after: Row | None) -> dict[str, Any]:
    row = event_row(seq, item)
    if after is not None:
        row.update(state=after[1] or None, level=after[2] or None, desired=after[3] or None, anomaly=after[4])
    return row


def touched(state_before: ClusterState, item: Item) -> tuple[set[str], set[str]]:
    """The nodes and models whose views an item may change (read before it is folded)."""
    nodes: set[str] = set()
    models: set[str] = set()
    if isinstance(item, Skipped):
        return nodes, models
    if item.model_key is not None:
        models.add(item.model_key)
    if isinstance(item, ReplicaEvent):
        old = state_before.replicas.get((item.model_key, item.replica_id))
        if old is not None and old.node_id:
            nodes.add(old.node_id)
        if item.node_id:
            nodes.add(item.node_id)
    elif isinstance(item, (NodeJoined, NodeLost, NodeDeclared)):
        nodes.add(item.node_id)
        if isinstance(item, NodeDeclared) and not state_before.declared:
            nodes.update(state_before.nodes)  # the first declaration puts every node under the inventory
        if isinstance(item, NodeLost):
            models.update(r.model_key for r in state_before.replicas.values() if r.node_id == item.node_id)
    return nodes, models


# ---- views: what the page draws, as JSON-ready dicts and structs (views.py) -----------------------


def replica_json(r: ReplicaView) -> dict[str, Any]:
    return {"model_key": r.model_key, "replica_id": r.replica_id, "level": str(r.level), "desired": str(r.desired),
            "state": str(r.state), "node_id": r.node_id, "gpu_indices": list(r.gpu_indices),
            "bytes_per_gpu": r.bytes_per_gpu, "cpu_bytes": r.cpu_bytes, "dedicated": r.dedicated,
            "restarts": r.restarts, "error": r.error, "since_seq": r.since_seq, "cause": r.cause}


@functools.lru_cache(maxsize=65536)
def _name(model_key: str) -> str:
    return display_name(model_key)


def _block(r: ReplicaView, nbytes: int) -> Block:
    # (str() of a StrEnum: its value, without the property)
    return Block(r.model_key, _name(r.model_key), r.replica_id, nbytes, str(r.level), str(r.state))


def _block_order(b: Block) -> tuple[str, int, int]:
    return (b.model_key, b.replica_id, b.bytes)  # the order of `CardUsage.replicas`


def nodes_json(state: ClusterState) -> list[Node]:
    """Every node's view (`node_json` of each, sorted by node id) in one pass over the replicas.

    The page's first load and every timeline position build this for the whole cluster, so it
    avoids `node_cards` (a pass over each card's replicas per card) and sorts only shared cards.
    """
    on_card: dict[tuple[str, int], list[Block]] = {}
    warm: dict[str, list[tuple[tuple[str, int], int]]] = {}
    for key, r in state.replicas.items():
        if r.on_gpu:
            blk = _block(r, r.bytes_per_gpu)
            for g in r.gpu_indices:
                lst = on_card.get((r.node_id, g))
                if lst is None:
                    on_card[(r.node_id, g)] = [blk]
                else:
                    lst.append(blk)
        if r.cpu_bytes:
            warm.setdefault(r.node_id, []).append((key, r.cpu_bytes))
    out = []
    for node_id in sorted(state.nodes):
        node = state.nodes[node_id]
        cards = []
        for gpu in node.gpus:
            blocks = on_card.get((node_id, gpu.index))
            if blocks is None:
                cards.append(Card(gpu.index, gpu.memory_bytes, 0, 0, []))
                continue
            if len(blocks) > 1:
                blocks.sort(key=_block_order)
            reserved = used = 0
            for x in blocks:
                reserved += x.bytes
                if x.level == Level.HOT:
                    used += x.bytes
            cards.append(Card(gpu.index, gpu.memory_bytes, reserved, used, blocks))
        held = sorted(warm[node_id]) if node_id in warm else []
        w = [Held(mk, _name(mk), rid, nb) for (mk, rid), nb in held]
        out.append(Node(node_id, node.alive, node.hostname, node.since_seq, node.cpu_cache_bytes,
                        sum(nb for _, nb in held), w, cards))
    return out


def node_json(state: ClusterState, node_id: str) -> Node:
    node = state.nodes[node_id]
    reps = state.replicas
    cards = [Card(c.index, c.total_bytes, c.reserved_bytes, c.used_bytes,
                  [_block(reps[(mk, rid)], b) for mk, rid, b in c.replicas]) for c in state.node_cards(node_id)]
    warm = [Held(mk, _name(mk), rid, b) for (mk, rid), b in sorted(state.cpu_replicas(node_id).items())]
    return Node(node_id, node.alive, node.hostname, node.since_seq, node.cpu_cache_bytes,
                sum(w.bytes for w in warm), warm, cards)


def model_json(state: ClusterState, model_key: str) -> dict[str, Any]:
    m = state.models.get(model_key)
    rs = state.model_replicas(model_key)
    by_state: dict[str, int] = {}
    by_level: dict[str, int] = {}
    rows: list[ReplicaRow] = []
    hot = on_gpu = 0
    charge = None  # what placement charged each replica: its bytes on each of its cards, summed (the latest placement)
    for r in rs:  # one pass, each view's level read once: the page's first load and every past position build this
        st, lv = str(r.state), str(r.level)
        by_state[st] = by_state.get(st, 0) + 1
        by_level[lv] = by_level.get(lv, 0) + 1
        if r.desired is Level.HOT:
            hot += 1
        on_gpu += lv == "HOT"
        if r.gpu_indices:
            charge = r.bytes_per_gpu * len(r.gpu_indices)
        cards = list(r.gpu_indices) if r.on_gpu else []
        where = ",".join(map(str, cards)) if cards else ("cpu" if r.cpu_bytes else "-")
        rows.append(ReplicaRow(r.replica_id, st, lv, str(r.desired), r.node_id, cards, r.since_seq,
                               r.restarts, r.error, where))
    return {"model_key": model_key, "name": _name(model_key),
            "status": str(state.model_status(model_key)), "target_hot": m.target_hot if m else 0,
            "replica_count": hot, "hot": on_gpu, "dedicated": bool(m and m.dedicated),
            "size_bytes": m.registration.size_bytes if m and m.registration else None,
            "charge_per_replica_bytes": charge, "by_state": by_state, "by_level": by_level,
            "replicas": rows,
            "last_rejection": ({"seq": m.last_rejection.seq, "reason": m.last_rejection.reason,
                                "replicas": m.last_rejection.replicas}
                               if m and m.last_rejection else None)}


def state_json(state: ClusterState, *, last_seq: int, live: bool) -> dict[str, Any]:
    """The whole page's data at one position of the log (`ts`: the log's time there, epoch seconds)."""
    models = sorted(set(state.models) | {k[0] for k in state.replicas})
    return {
        "seq": state.seq, "last_seq": last_seq, "live": live,
        "ts": state.max_ts.timestamp() if state.max_ts is not None else None,
        "nodes": nodes_json(state),
        "models": [model_json(state, mk) for mk in models],
        "anomaly_count": state.anomaly_count, "skipped": state.skipped,
        "anomalies": [anomaly_json(a) for a in state.anomalies[-20:]],
    }
