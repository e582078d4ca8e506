"""The dashboard's read model: the whole log in memory, folded with the controller's `ClusterState`.

No I/O here. `DashboardModel.add(seq, item)` folds one stored item into the live state and keeps
what the pages ask for fast: the items themselves (events tail, paging), per-replica history rows
(each step with the state it left, recorded as it is folded), a prefix maximum of event times (an
ISO time maps to a sequence by bisection) and checkpoints of the fold every `checkpoint_every`
events (any past position = a checkpoint copy + at most that many events folded).

Checkpoints drop the projection's `event_ids` set (the memory of a long log): an event re-appended
after the dedup window is recognised while folding live and its sequence remembered in `dup_seqs`,
and folds from a checkpoint skip exactly those, so they reach the same state as a fold from the
start (tests/unit/test_dashboard_model.py checks this against `replay`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.core.projections.replica import ReplicaView
from controlplane.dashboard.detail import event_detail
from controlplane.dashboard.series import PHASES, LogSeries, phase
from controlplane.store.admin import resolve_name
from schemas import errors as errs
from schemas import events as E
from schemas.events import EVENT_TYPES, Event, NodeJoined, NodeLost, ReplicaEvent, Skipped, event_tag
from schemas.keys import display_name
from schemas.status import Level

Item = Event | Skipped
MAX_EVENTS_PAGE = 1000
CHECKPOINT_EVERY = 2000
MAX_CHECKPOINT_CACHE = 8  # recently asked past states kept whole (scrubbing back and forth)
MAX_DETAIL = 4000  # characters of an event's detail (an error's text) sent with its row
MAX_LIFELINES = 400  # replicas drawn in one lifeline answer (the cluster's: the most recently moved)


class BadQuery(ValueError):
    """A request the dashboard cannot answer as asked (HTTP 400), with the reason for the user."""


class UnknownEntity(LookupError):
    """A model or replica that is not in the log (HTTP 404)."""


class DashboardModel:
    """Folds the log once, answers live and past views. Single-threaded: call from one event loop."""

    def __init__(self, *, checkpoint_every: int = CHECKPOINT_EVERY) -> None:
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self.live = ClusterState()
        self.every = checkpoint_every
        self.seqs: list[int] = []
        self.items: list[Item] = []
        self.max_ts: list[float] = []  # prefix maximum of event times (epoch seconds)
        self.dup_seqs: set[int] = set()
        self.checkpoints: list[ClusterState] = [ClusterState()]  # [i] = state after the first i*every items
        # (model_key, replica_id) -> [(item index, state, level, desired, anomaly)], model_key -> item indexes
        self.replica_rows: dict[tuple[str, int], list[tuple[int, str, str, str, str | None]]] = {}
        self.model_rows: dict[str, list[int]] = {}
        self._past: dict[int, ClusterState] = {}
        self.series = LogSeries()  # replicas by phase per model, memory per card, over the log's time
        self.type_counts: dict[str, int] = {}  # events folded, by type (`/metrics`)

    # ---- folding ---------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        return self.live.seq

    def add(self, seq: int, item: Item) -> bool:
        """Fold one stored item (a redelivery is ignored). Returns whether it was new."""
        live = self.live
        if seq <= live.seq:
            return False
        if isinstance(item, Event) and item.event_id in live.event_ids:
            self.dup_seqs.add(seq)
        before = live.anomaly_count
        cls = item.__class__
        if cls in _REPLICA_EVENTS:  # the hot path: one replica, read before and after the fold
            key: tuple[str, int] = (item.model_key, item.replica_id)  # type: ignore[union-attr,assignment]
            moved = [(key, live.replicas.get(key))]
        else:
            moved = _views_before(live, item)
        live.apply(seq, item)
        idx = len(self.items)
        self.seqs.append(seq)
        self.items.append(item)
        prev = self.max_ts[-1] if self.max_ts else float("-inf")
        t = max(prev, item.ts.timestamp()) if isinstance(item, Event) else prev
        self.max_ts.append(t)
        tag = event_type(item)
        self.type_counts[tag] = self.type_counts.get(tag, 0) + 1
        if moved:
            changes = [(old, new) for key, old in moved if (new := live.replicas.get(key)) is not old]
            if changes:
                self.series.moved(seq, t, changes, live)
        if isinstance(item, Event) and item.model_key is not None:
            mk = item.model_key
            self.model_rows.setdefault(mk, []).append(idx)
            if isinstance(item, ReplicaEvent):
                r = live.replicas.get((mk, item.replica_id))
                anomaly = live.anomalies[-1].message if live.anomaly_count > before and live.anomalies else None
                row = (idx, str(r.state), str(r.level), str(r.desired)) if r else (idx, "", "", "")
                self.replica_rows.setdefault((mk, item.replica_id), []).append((*row, anomaly))
        if len(self.items) % self.every == 0:
            ck = live.copy()
            ck.event_ids = set()
            self.checkpoints.append(ck)
        return True

    def add_all(self, stored: Iterable[tuple[int, Item]]) -> None:
        for seq, item in stored:
            self.add(seq, item)

    # ---- positions --------------------------------------------------------------------------

    def parse_until(self, until: str) -> int:
        """`SEQ` or an ISO time with a timezone -> the last sequence at or before it."""
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
        # `replay --until TIME` stops at the first event later than TIME: the prefix maximum finds it.
        i = bisect.bisect_right(self.max_ts, t.timestamp())
        return self.seqs[i - 1] if i else 0

    def state_at(self, seq: int) -> ClusterState:
        """The cluster exactly as it was after `seq` (the live state itself when `seq` is the last)."""
        if seq >= self.seq:
            return self.live
        if seq < 0:
            raise BadQuery("seq must be >= 0")
        cached = self._past.get(seq)
        if cached is not None:
            return cached
        n = bisect.bisect_right(self.seqs, seq)  # items folded
        k = min(n // self.every, len(self.checkpoints) - 1)
        st = self.checkpoints[k].copy()
        dups = self.dup_seqs
        for i in range(k * self.every, n):
            s = self.seqs[i]
            if s in dups:
                st.seq = s
                continue
            st.apply(s, self.items[i])
        st.seq = max(st.seq, seq)
        if len(self._past) >= MAX_CHECKPOINT_CACHE:
            self._past.pop(next(iter(self._past)))
        self._past[seq] = st
        return st

    # ---- queries ----------------------------------------------------------------------------

    def resolve_model(self, model: str) -> str:
        """A model key as stored, its display name, or any name `ndif` accepts for it (a repo id, a
        checkpoint path, the short name: `resolve_name`); 404 when none names it, 400 if several do."""
        if model in self.model_rows or model in self.live.models:
            return model
        for mk in self.model_rows:
            if display_name(mk) == model:
                return mk
        try:
            return resolve_name(self.live, model[:500])
        except errs.UnknownModel:
            raise UnknownEntity(f"unknown model {model[:200]!r}: no event in the log names it") from None
        except errs.InvalidCommand as exc:
            raise BadQuery(str(exc)) from None

    def time_of(self, seq: int) -> float | None:
        """The log's time at `seq` (the latest event time up to it), epoch seconds; None before any event."""
        i = bisect.bisect_right(self.seqs, seq)
        t = self.max_ts[i - 1] if i else None
        return t if t is not None and t != float("-inf") else None

    def lifeline(self, model: str | None, seq: int, t0: float, t1: float) -> dict[str, Any]:
        """One line per replica over [t0, t1] as the log stood at `seq`: segments of one phase and
        state, each with the event that began it (its type, actor, command and the command's verb)
        and the decision behind it (the replica's latest step a command caused, up to that event)."""
        end = bisect.bisect_right(self.seqs, seq)
        mk = self.resolve_model(model) if model else None
        keys = [k for k in self.replica_rows if mk is None or k[0] == mk]
        lines = []
        for key in keys:
            rows = self.replica_rows[key]
            n = bisect.bisect_left(rows, (end,))  # rows folded by `seq`
            if n == 0:
                continue
            segs: list[list[Any]] = []
            decision = None  # the latest step of this replica that a command caused
            for j in range(n):
                idx, st, lvl, desired, anomaly = rows[j]
                item = self.items[idx]
                if isinstance(item, Event) and item.command_id:
                    decision = self.seqs[idx]
                start = self.max_ts[idx]
                stop = self.max_ts[rows[j + 1][0]] if j + 1 < n else t1
                ph = phase(st, lvl) if st else "COLD"
                if segs and segs[-1][2] == ph and segs[-1][3] == st and not anomaly:
                    segs[-1][1] = min(stop, t1)
                    continue
                if stop < t0 or start > t1:
                    continue
                segs.append([max(start, t0), min(stop, t1), ph, st, lvl, desired, self.seqs[idx], anomaly, decision])
            if segs:
                lines.append((rows[n - 1][0], key, segs))
        truncated = max(0, len(lines) - MAX_LIFELINES)
        if truncated:  # the cluster's: the replicas that moved last
            lines = sorted(lines, key=lambda x: x[0])[-MAX_LIFELINES:]
        lines.sort(key=lambda x: x[1])
        if lines:  # nothing before the first line's start: the window starts there
            t0 = max(t0, min(segs[0][0] for _, _, segs in lines))
        seen_seqs = {sg[6] for _, _, segs in lines for sg in segs}
        causes = {q: self._cause(q) for q in seen_seqs}
        decided = {sg[8] for _, _, segs in lines for sg in segs if sg[8] is not None}
        decisions = {q: {"seq": q, **self._cause(q)} for q in decided}
        return {"model_key": mk, "t0": t0, "t1": t1, "seq": min(seq, self.seq), "truncated": truncated,
                "phases": list(PHASES),
                "replicas": [{"model_key": k[0], "name": display_name(k[0]), "replica_id": k[1],
                              "segments": [{"t0": a, "t1": b, "phase": ph, "state": st, "level": lvl,
                                            "desired": des, "seq": q, "anomaly": an, **causes[q],
                                            "decision": decisions.get(dq) if dq is not None else None}
                                           for a, b, ph, st, lvl, des, q, an, dq in segs]}
                             for _, k, segs in lines]}

    def _cause(self, seq: int) -> dict[str, Any]:
        i = bisect.bisect_left(self.seqs, seq)
        item = self.items[i]
        row = event_row(seq, item)
        out = {k: row.get(k) for k in ("type", "ts", "actor", "command_id", "detail")}
        cid = row.get("command_id")
        rec = self.live.commands.get(cid) if cid else None
        out["verb"] = rec.verb if rec is not None and rec.verb else None
        return out

    def anomalies(self, seq: int) -> dict[str, Any]:
        """Every anomaly the fold kept (the last 1,000) up to `seq`, newest first, and the count."""
        st = self.state_at(seq)
        return {"seq": st.seq, "anomaly_count": st.anomaly_count, "skipped": st.skipped,
                "anomalies": [anomaly_json(a) for a in reversed(st.anomalies)]}

    def events(self, *, model: str | None = None, replica_id: int | None = None, type_: str | None = None,
               actor: str | None = None, before: int | None = None, limit: int = 100) -> tuple[list[dict[str, Any]], int | None]:
        """Newest first, filtered; returns (rows, the `before` for the next page or None)."""
        if not 1 <= limit <= MAX_EVENTS_PAGE:
            raise BadQuery(f"limit must be 1..{MAX_EVENTS_PAGE}")
        if type_ is not None and type_ not in EVENT_TYPES and type_ != "Skipped":
            raise BadQuery(f"unknown event type {type_[:64]!r}; one of {', '.join(sorted(EVENT_TYPES))}")
        mk = self.resolve_model(model) if model else None
        if mk is not None:
            indexes: Iterator[int] | range = reversed(self.model_rows.get(mk, []))
        else:
            indexes = range(len(self.items) - 1, -1, -1)
        end = bisect.bisect_left(self.seqs, before) if before is not None else len(self.items)
        rows: list[dict[str, Any]] = []
        for i in indexes:
            if i >= end:
                continue
            item = self.items[i]
            if replica_id is not None and not (isinstance(item, ReplicaEvent) and item.replica_id == replica_id):
                continue
            if type_ is not None and (event_type(item) != type_):
                continue
            if actor is not None and not (isinstance(item, Event) and actor in item.actor):
                continue
            if len(rows) == limit:  # one more matches: the next page starts below the last row
                return rows, rows[-1]["seq"]
            rows.append(event_row(self.seqs[i], item))
        return rows, None

    def history(self, model: str, replica_id: int | None) -> dict[str, Any]:
        """`ndif history`'s data: every step of a model (or one replica) with its cause and the state left."""
        mk = self.resolve_model(model)
        if replica_id is None:
            rows = []
            by_idx = {}
            for (m, _rid), rr in self.replica_rows.items():
                if m == mk:
                    by_idx.update({r[0]: r for r in rr})
            for i in self.model_rows.get(mk, []):
                rows.append(_history_row(self.seqs[i], self.items[i], by_idx.get(i)))
        else:
            found = self.replica_rows.get((mk, replica_id))
            if found is None:
                raise UnknownEntity(f"model {display_name(mk)!r} has no replica {replica_id}")
            rows = [_history_row(self.seqs[r[0]], self.items[r[0]], r) for r in found]
        # The cards each step left the replica placed on (set by its latest ReplicaScheduled).
        gpus: dict[int, list[int]] = {}
        for row in rows:
            rid = row.get("replica_id")
            if rid is not None:
                if row["type"] == "ReplicaScheduled":
                    item = self.items[bisect.bisect_left(self.seqs, row["seq"])]
                    if isinstance(item, E.ReplicaScheduled):
                        gpus[rid] = list(item.gpu_indices)
                row["gpus"] = gpus.get(rid, [])
        return {"model_key": mk, "name": display_name(mk), "replica_id": replica_id, "steps": rows}


_REPLICA_EVENTS = frozenset(c for c in EVENT_TYPES.values() if issubclass(c, ReplicaEvent))


def _views_before(live: ClusterState, item: Item) -> list[tuple[tuple[str, int], ReplicaView | None]]:
    """The replica views an item may change, as they are before it is folded (for `LogSeries`)."""
    if isinstance(item, ReplicaEvent):
        key = (item.model_key, item.replica_id)
        return [(key, live.replicas.get(key))]
    if isinstance(item, NodeLost):
        return [(k, r) for k, r in live.replicas.items() if r.node_id == item.node_id]
    if isinstance(item, E.ModelUndeployed):
        return [(r.key, r) for r in live.model_replicas(item.model_key)]
    return []


def event_type(item: Item) -> str:
    return "Skipped" if isinstance(item, Skipped) else event_tag(item)


def event_row(seq: int, item: Item) -> dict[str, Any]:
    """One event as the page shows it: sequence, time, type, actor, command id, who it is about."""
    if isinstance(item, Skipped):
        return {"seq": seq, "type": "Skipped", "reason": item.reason, "skipped_type": item.type}
    row: dict[str, Any] = {"seq": seq, "ts": item.ts.isoformat(), "type": event_tag(item), "actor": item.actor,
                           "command_id": item.command_id, "model_key": item.model_key}
    if isinstance(item, ReplicaEvent):
        row["replica_id"] = item.replica_id
        row["node_id"] = item.node_id
    elif isinstance(item, (NodeJoined, NodeLost)):
        row["node_id"] = item.node_id
    detail = event_detail(item)
    if detail:
        row["detail"] = detail if len(detail) <= MAX_DETAIL else detail[:MAX_DETAIL] + " [...]"
    return row


def anomaly_json(a: Any) -> dict[str, Any]:
    return {"seq": a.seq, "event_type": a.event_type, "message": a.message, "model_key": a.model_key,
            "name": display_name(a.model_key) if a.model_key else None, "replica_id": a.replica_id}


def _history_row(seq: int, item: Item, after: tuple[int, str, str, str, str | None] | None) -> dict[str, Any]:
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
    elif isinstance(item, (NodeJoined, NodeLost)):
        nodes.add(item.node_id)
        if isinstance(item, NodeLost):
            models.update(r.model_key for r in state_before.replicas.values() if r.node_id == item.node_id)
    return nodes, models


# ---- views: what the page draws, as plain JSON-ready dicts ---------------------------------------


def replica_json(r: ReplicaView) -> dict[str, Any]:
    return {"model_key": r.model_key, "replica_id": r.replica_id, "level": str(r.level), "desired": str(r.desired),
            "state": str(r.state), "node_id": r.node_id, "gpu_indices": list(r.gpu_indices),
            "bytes_per_gpu": r.bytes_per_gpu, "cpu_bytes": r.cpu_bytes, "dedicated": r.dedicated,
            "restarts": r.restarts, "error": r.error, "since_seq": r.since_seq, "cause": r.cause}


@functools.lru_cache(maxsize=65536)
def _name(model_key: str) -> str:
    return display_name(model_key)


def _block(r: ReplicaView, nbytes: int) -> dict[str, Any]:
    return {"model_key": r.model_key, "name": _name(r.model_key), "replica_id": r.replica_id, "bytes": nbytes,
            "level": r.level.value, "state": r.state.value}


def _block_order(b: dict[str, Any]) -> tuple[str, int, int]:
    return (b["model_key"], b["replica_id"], b["bytes"])  # the order of `CardUsage.replicas`


def nodes_json(state: ClusterState) -> list[dict[str, Any]]:
    """Every node's view (`node_json` of each, sorted by node id) in one pass over the replicas.

    The page's first load and every timeline position build this for the whole cluster, so it
    avoids `node_cards` (a pass over each card's replicas per card) and sorts only shared cards.
    """
    on_card: dict[tuple[str, int], list[dict[str, Any]]] = {}
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
                cards.append({"index": gpu.index, "total_bytes": gpu.memory_bytes, "reserved_bytes": 0,
                              "used_bytes": 0, "replicas": []})
                continue
            if len(blocks) > 1:
                blocks.sort(key=_block_order)
            reserved = used = 0
            for x in blocks:
                reserved += x["bytes"]
                if x["level"] == "HOT":
                    used += x["bytes"]
            cards.append({"index": gpu.index, "total_bytes": gpu.memory_bytes, "reserved_bytes": reserved,
                          "used_bytes": used, "replicas": blocks})
        held = sorted(warm[node_id]) if node_id in warm else []
        w = [{"model_key": mk, "name": _name(mk), "replica_id": rid, "bytes": nb} for (mk, rid), nb in held]
        out.append({"node_id": node_id, "alive": node.alive, "hostname": node.hostname, "since_seq": node.since_seq,
                    "cpu_cache_bytes": node.cpu_cache_bytes, "cpu_cached_bytes": sum(nb for _, nb in held),
                    "warm": w, "gpus": cards})
    return out


def node_json(state: ClusterState, node_id: str) -> dict[str, Any]:
    node = state.nodes[node_id]
    reps = state.replicas
    cards = []
    for c in state.node_cards(node_id):
        blocks = [_block(reps[(mk, rid)], b) for mk, rid, b in c.replicas]
        cards.append({"index": c.index, "total_bytes": c.total_bytes, "reserved_bytes": c.reserved_bytes,
                      "used_bytes": c.used_bytes, "replicas": blocks})
    warm = [{"model_key": mk, "name": _name(mk), "replica_id": rid, "bytes": b}
            for (mk, rid), b in sorted(state.cpu_replicas(node_id).items())]
    return {"node_id": node_id, "alive": node.alive, "hostname": node.hostname, "since_seq": node.since_seq,
            "cpu_cache_bytes": node.cpu_cache_bytes, "cpu_cached_bytes": sum(w["bytes"] for w in warm),
            "warm": warm, "gpus": cards}


def model_json(state: ClusterState, model_key: str) -> dict[str, Any]:
    m = state.models.get(model_key)
    rs = state.model_replicas(model_key)
    by_state: dict[str, int] = {}
    by_level: dict[str, int] = {}
    for r in rs:
        by_state[str(r.state)] = by_state.get(str(r.state), 0) + 1
        by_level[str(r.level)] = by_level.get(str(r.level), 0) + 1
    # What placement charged each replica: its bytes on each of its cards, summed (the latest placement).
    placed = [r for r in rs if r.gpu_indices]
    charge = placed[-1].bytes_per_gpu * len(placed[-1].gpu_indices) if placed else None
    return {"model_key": model_key, "name": _name(model_key),
            "status": str(state.model_status(model_key)), "target_hot": m.target_hot if m else 0,
            "replica_count": sum(1 for r in rs if r.desired is Level.HOT), "dedicated": bool(m and m.dedicated),
            "size_bytes": m.registration.size_bytes if m and m.registration else None,
            "charge_per_replica_bytes": charge, "by_state": by_state, "by_level": by_level,
            "replicas": [{"replica_id": r.replica_id, "state": str(r.state), "level": str(r.level),
                          "desired": str(r.desired), "node_id": r.node_id, "gpu_indices": list(r.gpu_indices),
                          "since_seq": r.since_seq, "restarts": r.restarts, "error": r.error} for r in rs],
            "last_rejection": ({"seq": m.last_rejection.seq, "reason": m.last_rejection.reason,
                                "replicas": m.last_rejection.replicas}
                               if m and m.last_rejection else None)}


def state_json(state: ClusterState, *, last_seq: int, live: bool, ts: float | None = None) -> dict[str, Any]:
    """The whole page's data at one position of the log (`ts`: the log's time at that position)."""
    models = sorted(set(state.models) | {k[0] for k in state.replicas})
    return {
        "seq": state.seq, "last_seq": last_seq, "live": live, "ts": ts,
        "nodes": nodes_json(state),
        "models": [model_json(state, mk) for mk in models],
        "anomaly_count": state.anomaly_count, "skipped": state.skipped,
        "anomalies": [anomaly_json(a) for a in state.anomalies[-20:]],
    }
