"""What every projection shares: the position in the log, redelivery and unknown-event handling.

Its memory is bounded by the cluster, not by the history: a redelivery is recognised by its
sequence, an event re-appended under the same id by a window of the last EVENT_ID_WINDOW event ids
(JetStream's duplicate window is the only place an id can repeat; a resend lands close behind the
original), and anomalies are a bounded list with a count.

A projection is an accumulator owned by one fold. `apply(seq, item)` is the fold step: the
per-entity reducers it calls are pure; the container is mutated in place so a fold over 10^5
events costs O(events), not O(events x state). `evolve()` is the pure form (copy, then apply).

The fold is silent: what it cannot use (an anomaly, an unreadable stored message) it keeps as
data with its seq, and never logs. A live service logs what is new after each batch it folds
(`new_anomalies(since_seq)`), so a restart, which folds the whole history again, re-logs nothing.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import AsyncIterator, Iterable
from datetime import datetime
from typing import Any, Self, TypeVar

import msgspec

from controlplane.core.ports import Stored
from schemas.events import Event, Skipped, event_tag

MAX_ANOMALIES_KEPT = 1000
# Event ids remembered to refuse a re-append: an id stored again more than this many events after
# it (and after JetStream's 2-minute duplicate window) is applied again. Part of the fold's state
# (and of its snapshots), so a snapshot plus the tail folds exactly as the whole history does.
EVENT_ID_WINDOW = 10_000


class Anomaly(msgspec.Struct, frozen=True, kw_only=True):
    """An event the state machine has no rule for, kept in the state (shown by `ndif status`)."""

    seq: int
    event_type: str
    message: str
    model_key: str | None = None
    replica_id: int | None = None
    event_id: str = ""


class Projection(abc.ABC):
    """Base fold: tracks `seq`, drops redeliveries, counts what it could not read."""

    __slots__ = ("anomalies", "anomaly_count", "event_ids", "id_order", "last_event_id", "max_ts", "seq",
                 "skipped", "unreadable")

    def __init__(self) -> None:
        self.seq = 0  # last stored sequence applied (or skipped)
        self.skipped = 0  # stored messages no reader of this version can use
        # The last EVENT_ID_WINDOW applied event ids (a set to look up, a queue to forget the oldest):
        # an event re-appended within it changes nothing.
        self.event_ids: set[str] = set()
        self.id_order: deque[str] = deque()
        self.last_event_id = ""  # id of the stored event at `seq` ("" when unreadable): what a snapshot names
        self.max_ts: datetime | None = None  # the latest event time folded so far (`replay --until TIME`)
        self.anomalies: list[Anomaly] = []  # the last MAX_ANOMALIES_KEPT, in seq order
        self.anomaly_count = 0
        # The last MAX_ANOMALIES_KEPT unreadable messages, as anomalies (event_type: the stored type
        # tag, or ""). Not in snapshots (their count, `skipped`, is): they are kept for the live
        # service to log once, and `skipped` says how many there were.
        self.unreadable: list[Anomaly] = []

    def apply(self, seq: int, item: Event | Skipped) -> Self:
        """Fold one stored item at `seq`. Never raises: a reducer that fails on an event leaves an
        anomaly (`not folded: ...`) and the fold goes on past it."""
        if seq <= self.seq:
            return self  # redelivery by the consumer
        self.seq = seq
        if item.__class__ is Skipped:
            self.skipped += 1
            self.last_event_id = ""
            _keep(self.unreadable, Anomaly(seq=seq, event_type=item.type or "", message=item.reason))
            return self
        eid = item.event_id  # type: ignore[union-attr]
        self.last_event_id = eid
        ts = item.ts  # type: ignore[union-attr]
        if self.max_ts is None or ts > self.max_ts:
            self.max_ts = ts
        ids = self.event_ids
        if eid in ids:
            return self  # the same event appended again after the dedup window
        ids.add(eid)
        order = self.id_order
        order.append(eid)
        if len(order) > EVENT_ID_WINDOW:
            ids.discard(order.popleft())
        try:
            self._evolve(seq, item)
        except Exception as exc:  # noqa: BLE001 - one event no rule can fold is recorded; the next is read
            self._anomaly(seq, item, f"not folded: {type(exc).__name__}: {str(exc)[:300]}")  # type: ignore[arg-type]
        return self

    def become(self, other: Self) -> Self:
        """Take `other`'s whole fold in place (every holder of this object sees it): a log folded
        again from the start after it went back (LogRewound)."""
        for cls in type(self).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(other, slot):
                    setattr(self, slot, getattr(other, slot))
        return self

    @abc.abstractmethod
    def _evolve(self, seq: int, event: Any) -> None:
        """The projection's reducer for one decoded, first-seen event."""

    def _anomaly(self, seq: int, event: Event, message: str, replica_id: int | None = None) -> None:
        self.anomaly_count += 1
        _keep(self.anomalies, Anomaly(seq=seq, event_type=event_tag(event), message=message,
                                      model_key=event.model_key, replica_id=replica_id, event_id=event.event_id))

    def new_anomalies(self, since_seq: int) -> list[Anomaly]:
        """What the fold found after `since_seq` (anomalies and unreadable messages), in seq order.

        For the live adapters: note `seq` before folding a batch, then log each of these once. At
        most the last MAX_ANOMALIES_KEPT of each kind are kept; `anomaly_count` and `skipped` count
        them all. Pure: reading does not consume them.
        """
        return sorted([*_since(self.anomalies, since_seq), *_since(self.unreadable, since_seq)],
                      key=lambda a: a.seq)

    @abc.abstractmethod
    def copy(self) -> Self:
        """An independent copy (entity views are frozen, so containers are copied shallowly)."""

    def _copy_base(self, other: Projection) -> None:
        other.seq = self.seq
        other.skipped = self.skipped
        other.event_ids = set(self.event_ids)
        other.id_order = deque(self.id_order)
        other.last_event_id = self.last_event_id
        other.max_ts = self.max_ts
        other.anomalies = list(self.anomalies)
        other.anomaly_count = self.anomaly_count
        other.unreadable = list(self.unreadable)


def _keep(kept: list[Anomaly], a: Anomaly) -> None:
    kept.append(a)
    if len(kept) > MAX_ANOMALIES_KEPT:
        del kept[0]


def _since(kept: list[Anomaly], since_seq: int) -> list[Anomaly]:
    """The tail of `kept` (seq order) after `since_seq`: O(new ones), not O(kept)."""
    i = len(kept)
    while i and kept[i - 1].seq > since_seq:
        i -= 1
    return kept[i:]


P = TypeVar("P", bound=Projection)


def fold(items: Iterable[tuple[int, Event | Skipped]], state: P) -> P:
    """Fold `(seq, event)` pairs into `state` (mutated and returned)."""
    apply = state.apply
    for seq, item in items:
        apply(seq, item)
    return state


def evolve(state: P, seq: int, event: Event | Skipped) -> P:
    """Pure fold step: a new state; `state` is left untouched."""
    return state.copy().apply(seq, event)


async def afold(items: AsyncIterator[Stored], state: P) -> P:
    """Fold an async stream of stored events into `state`."""
    apply = state.apply
    async for seq, item in items:
        apply(seq, item)
    return state


async def afold_batches(batches: AsyncIterator[list[Stored]], state: P) -> P:
    """Fold batches of stored events (`EventLog.read_batches`): the fast path for rebuilds."""
    apply = state.apply
    async for batch in batches:
        for seq, item in batch:
            apply(seq, item)
    return state
