"""Figures over time that the log holds exactly: each model's replicas by phase, each card's memory.

No I/O, no clock. `LogSeries.moved` is told, for each folded event, which replica views it changed
(before and after); it keeps a step series per model (replicas in each phase after every event that
changed a count) and per GPU card (committed and reserved bytes after every change). A window of a
series is read at any position of the log: the same figures at any past point of the timeline.

Times are the log's (the prefix maximum of event times, so a series never runs backwards).

Each series keeps its newest MAX_KEPT changes (trimmed to that when it passes it by a quarter), so
the dashboard's memory is bounded by the cluster (models and cards), not by the history: a series
is exact from `kept_from` (the time of the last change it let go) on, and a window that asks for
earlier times is clamped there and says so (`kept_from` in its answer; the page writes it under the
plot). Older changes are not read back from the log: rebuilding a series over an old stretch means
folding that stretch, a cost per request that grows with how far back it reaches, and the figures
at any one past point stay exact through the timeline's past states (a snapshot plus its tail).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from typing import Any

from controlplane.core.projections import ClusterState
from controlplane.core.projections.replica import ReplicaView
from schemas.status import Level, ReplicaState

S = ReplicaState
# A replica's phase: its level and state in one word, what the plots count and the lifeline colours.
PHASES = ("HOT", "WARM", "COLD", "loading", "draining", "failed")
_FAILED = frozenset({S.FAILED, S.LOAD_FAILED, S.LOST})
_LOADING = frozenset({S.LOAD_REQUESTED, S.LOADING, S.RESTARTING})
_DRAINING = frozenset({S.DRAINING, S.UNLOAD_REQUESTED})
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
MAX_POINTS = 2000
MAX_KEPT = 4000  # changes a series keeps (the newest); twice what one window draws


def phase(state: ReplicaState | str, level: Level | str) -> str:
    """`failed`, `loading` or `draining` by state; otherwise the observed level (HOT, WARM, COLD)."""
    return _phase(S(state), Level(level)) if state and level else "COLD"


def _phase(st: ReplicaState, level: Level) -> str:
    return _state_phase(st) or level.value


def _state_phase(st: ReplicaState) -> str | None:
    """`failed`, `loading` or `draining` when the state says so; None when the level decides."""
    if st in _FAILED:
        return "failed"
    if st in _LOADING:
        return "loading"
    if st in _DRAINING:
        return "draining"
    return None


_HOT = frozenset({S.AVAILABLE})  # of the states left after the ones above, those `ReplicaView.level` calls HOT


def replica_phase(r: ReplicaView) -> str:
    """`phase(r.state, r.level)`, without building the level (the fold calls this twice an event)."""
    st = r.state
    by_state = _state_phase(st)
    if by_state is not None:
        return by_state
    if r.on_gpu and st in _HOT:
        return "HOT"
    return "WARM" if r.cpu_bytes else "COLD"


class Steps:
    """A step series: after the event at `seq[i]` (time `t[i]`) the values were `vals[i*k:(i+1)*k]`.

    At most `keep` changes (the newest) are kept; `base` holds the values the last one let go left,
    at `floor_seq` / `floor_t` (None: none let go, the series starts from zeros)."""

    __slots__ = ("_last", "base", "floor_seq", "floor_t", "k", "keep", "seq", "t", "vals")

    def __init__(self, k: int, keep: int = MAX_KEPT) -> None:
        self.k = k
        self.keep = max(1, keep)
        self.t = array("d")
        self.seq = array("q")
        self.vals = array("q")
        self._last: tuple[int, ...] = (0,) * k
        self.base: tuple[int, ...] = (0,) * k
        self.floor_seq: int | None = None
        self.floor_t: float | None = None

    def last(self) -> tuple[int, ...]:
        return self._last

    def put(self, seq: int, t: float, vals: Iterable[int]) -> None:
        v = tuple(vals)
        if v == self._last:
            return
        self._last = v
        if self.seq and self.seq[-1] == seq:  # one event changed it twice: keep what it left
            del self.vals[-self.k:]
            self.vals.extend(v)
            return
        self.t.append(t)
        self.seq.append(seq)
        self.vals.extend(v)
        if len(self.seq) > self.keep + self.keep // 4:  # trimmed in steps: amortised O(1) a change
            self._trim(len(self.seq) - self.keep)

    def _trim(self, n: int) -> None:
        k = self.k
        self.base = tuple(self.vals[(n - 1) * k:n * k])
        self.floor_seq, self.floor_t = self.seq[n - 1], self.t[n - 1]
        del self.t[:n]
        del self.seq[:n]
        del self.vals[:n * k]

    def window(self, t0: float, t1: float, seq_max: int, points: int = MAX_POINTS,
               from_first: bool = False) -> tuple[list[float], list[list[int]], float | None]:
        """The series over [t0, t1] as it was at `seq_max`: the value at t0, every change after it
        (or, past `points` changes, the value at the end of each of `points` equal slices), and t1;
        and `kept_from`: None, or the time the window was clamped to (older changes are not kept;
        a `seq_max` before them gives no points at all). `from_first`: nothing before the series'
        first change (a model's counts begin when it does, not as zeros before it existed)."""
        k = self.k
        kept_from = None
        if self.floor_t is not None and self.floor_seq is not None and t0 < self.floor_t:
            kept_from, t0 = self.floor_t, self.floor_t
        if self.floor_seq is not None and (seq_max < self.floor_seq or t1 < t0):
            return [], [[] for _ in range(k)], self.floor_t
        end = bisect.bisect_right(self.seq, seq_max)
        if from_first and self.floor_seq is None:
            if end == 0 or self.t[0] > t1:
                return [], [[] for _ in range(k)], None
            t0 = max(t0, self.t[0])
        lo = bisect.bisect_right(self.t, t0, 0, end)
        hi = bisect.bisect_right(self.t, t1, lo, end)

        def at(i: int) -> list[int]:  # values after change i-1 (what the kept ones start from before the first)
            return list(self.vals[(i - 1) * k:i * k]) if i > 0 else list(self.base)

        xs = [t0]
        cols: list[list[int]] = [[v] for v in at(lo)]
        if hi - lo <= points:  # every change (of several at one time, what the last one left)
            idx = [i for i in range(lo + 1, hi + 1) if i == hi or self.t[i] > self.t[i - 1]]
            times = [self.t[i - 1] for i in idx]
        else:
            step = (t1 - t0) / points
            times = [t0 + (b + 1) * step for b in range(points - 1)]
            idx = [bisect.bisect_right(self.t, tb, lo, hi) for tb in times]
        for tb, i in zip(times, idx, strict=True):
            xs.append(tb)
            for c, v in zip(cols, at(i), strict=True):
                c.append(v)
        xs.append(t1)
        for c, v in zip(cols, at(hi), strict=True):
            c.append(v)
        return xs, cols, kept_from


GAP_EPS_S = 0.001  # the value held at an outage's start is drawn up to it, then null just after


def gap_outages(xs: list[float], cols: list[list[Any]], outages: list[list[float]]) -> tuple[list[float], list[list[Any]]]:
    """A step series (`Steps.window`) with each outage a gap: the value held up to its start, null
    just after (a stepped line draws a run only between two values), and from its end the value
    held then (what the log knew when the cluster stopped is not what ran while it was off)."""
    if not outages or not xs:
        return xs, cols
    pts: list[tuple[float, tuple[Any, ...]]] = list(zip(xs, zip(*cols, strict=True), strict=True))
    gap = (None,) * len(cols)
    for oa, ob in sorted(outages):
        if ob <= pts[0][0] or oa >= pts[-1][0]:
            continue
        before = [p for p in pts if p[0] < oa]
        inside = [p for p in pts if oa <= p[0] < ob]
        after = [p for p in pts if p[0] >= ob]
        held = (inside or before or [(0.0, gap)])[-1][1]
        resume = [] if (after and after[0][0] == ob) or held == gap else [(ob, held)]
        start = max(oa, pts[0][0])
        upto = [(start, before[-1][1])] if before and before[-1][0] < start and before[-1][1] != gap else []
        pts = [*before, *upto, (min(start + GAP_EPS_S, ob) if upto else start, gap), *resume, *after]
    return [p[0] for p in pts], [list(c) for c in zip(*(p[1] for p in pts), strict=True)]


def _same_footprint(a: ReplicaView, b: ReplicaView) -> bool:
    """Do two views (both on GPU) hold the same bytes on the same cards, with the same intent?"""
    return (a.node_id == b.node_id and a.gpu_indices == b.gpu_indices and a.bytes_per_gpu == b.bytes_per_gpu
            and a.desired is b.desired)


class LogSeries:
    """Per model: replicas in each phase. Per card: committed and reserved bytes. Fed by the fold."""

    def __init__(self, keep: int = MAX_KEPT) -> None:
        self.keep = keep
        self.models: dict[str, Steps] = {}
        self.cards: dict[tuple[str, int], Steps] = {}
        self._counts: dict[str, list[int]] = {}

    def seed(self, seq: int, t: float, state: ClusterState) -> None:
        """Start from what `state` (the fold's start: a snapshot, or the empty state) holds at `seq`."""
        for r in state.replicas.values():
            counts = self._counts.get(r.model_key)
            if counts is None:
                counts = self._counts[r.model_key] = [0] * len(PHASES)
            counts[_PHASE_INDEX[replica_phase(r)]] += 1
        for mk, counts in self._counts.items():
            self.models[mk] = st = Steps(len(PHASES), self.keep)
            st.put(seq, t, counts)
        for node_id, node in state.nodes.items():
            for g in node.gpus:
                c = self.cards[(node_id, g.index)] = Steps(2, self.keep)
                c.put(seq, t, (state.card_committed(node_id, g.index), state.card_reserved(node_id, g.index)))

    def moved(self, seq: int, t: float, changes: list[tuple[ReplicaView | None, ReplicaView | None]],
              state: ClusterState) -> None:
        """Record what one folded event changed: `changes` are (view before, view after) pairs."""
        touched_models: list[str] = []
        cards: list[tuple[str, int]] = []
        for before, after in changes:
            pb = replica_phase(before) if before is not None else None
            pa = replica_phase(after) if after is not None else None
            if pb != pa:
                mk = (after or before).model_key  # type: ignore[union-attr]
                counts = self._counts.get(mk)
                if counts is None:
                    counts = self._counts[mk] = [0] * len(PHASES)
                if pb is not None:
                    counts[_PHASE_INDEX[pb]] -= 1
                if pa is not None:
                    counts[_PHASE_INDEX[pa]] += 1
                touched_models.append(mk)
            gb = before is not None and before.on_gpu
            ga = after is not None and after.on_gpu
            if (gb or ga) and not (gb and ga and _same_footprint(before, after)):  # type: ignore[arg-type]
                # What the replica holds on its cards (or whether it is to stay there) moved.
                for r, on in ((before, gb), (after, ga)):
                    if on:
                        cards.extend((r.node_id, g) for g in r.gpu_indices)  # type: ignore[union-attr]
        for mk in touched_models:
            st = self.models.get(mk)
            if st is None:
                st = self.models[mk] = Steps(len(PHASES), self.keep)
            st.put(seq, t, self._counts[mk])
        for node_id, g in cards:
            c = self.cards.get((node_id, g))
            if c is None:
                c = self.cards[(node_id, g)] = Steps(2, self.keep)
            c.put(seq, t, (state.card_committed(node_id, g), state.card_reserved(node_id, g)))

    def forgot(self, seq: int, t: float, model_key: str, n: int) -> None:
        """The fold forgot `n` of the model's gone replicas (all COLD, none on a card)."""
        counts = self._counts.get(model_key)
        st = self.models.get(model_key)
        if counts is None or st is None:
            return
        counts[_PHASE_INDEX["COLD"]] -= n
        st.put(seq, t, counts)

    def model_window(self, model_key: str, t0: float, t1: float, seq_max: int, points: int,
                     outages: list[list[float]] | None = None) -> dict[str, Any]:
        """The model's replicas in each phase over the window; a gap through each of `outages`."""
        s = self.models.get(model_key) or Steps(len(PHASES), self.keep)
        xs, cols, kept_from = s.window(t0, t1, seq_max, points, from_first=True)
        xs, cols = gap_outages(xs, cols, outages or [])
        return {"t": xs, **dict(zip(PHASES, cols, strict=True)), "kept_from": kept_from}

    def node_window(self, state: ClusterState, node_id: str, t0: float, t1: float, seq_max: int,
                    points: int, outages: list[list[float]] | None = None) -> dict[str, Any]:
        """Committed bytes of each card of the node (as `state` knows it) over the window; a gap
        through each of `outages`."""
        node = state.nodes.get(node_id)
        cards = []
        for g in node.gpus if node else ():
            s = self.cards.get((node_id, g.index)) or Steps(2, self.keep)
            xs, cols, kept_from = s.window(t0, t1, seq_max, points)
            xs, (committed, reserved) = gap_outages(xs, cols, outages or [])
            cards.append({"index": g.index, "total_bytes": g.memory_bytes, "t": xs, "committed": committed,
                          "reserved": reserved, "kept_from": kept_from})
        return {"node_id": node_id, "cards": cards}
