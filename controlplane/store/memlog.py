"""An in-memory `EventLog` and `SnapshotStore` with JetStream's append semantics.

For fast unit tests and simulations. Bodies go through the same JSON encoding as on the wire, so
what folds here folds the same from NATS; the contract suite holds both to the same cases. One
difference, on purpose: an observed fact whose subject carries its source is stored here like any
event (a fixture may write it in a batch, with an expectation, and is told its sequence), where
the JetStream log takes it alone and unguarded through its facts stream and names no log sequence
(`EventLog.append`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

from controlplane.core.ports import AppendResult, Stored
from schemas.errors import ConflictError
from schemas.events import Event, check_batch, decode_event, encode_event, event_subject, stored_item
from schemas.subjects import subject_matches


class MemoryEventLog:
    def __init__(self) -> None:
        self._bodies: list[bytes] = []  # seq = index + 1
        self._ids: list[str] = []
        self._subjects: list[str] = []
        self._times: list[datetime] = []
        self._changed = asyncio.Condition()
        self._snapshots: dict[str, bytes] = {}

    async def last_seq(self) -> int:
        return len(self._bodies)

    async def append(self, events: Sequence[Event], expected_last_seq: int | None) -> AppendResult:
        check_batch(events)
        n = len(events)
        last = len(self._ids)
        if expected_last_seq is None:
            if events[0].event_id in self._ids:  # JetStream's dedup by Nats-Msg-Id
                i = self._ids.index(events[0].event_id)
                return AppendResult(first_seq=i + 1, last_seq=i + n, already_appended=True)
        elif last != expected_last_seq:
            if last >= expected_last_seq + n and self._ids[expected_last_seq] == events[0].event_id \
                    and self._ids[expected_last_seq + n - 1] == events[-1].event_id:
                return AppendResult(first_seq=expected_last_seq + 1, last_seq=expected_last_seq + n,
                                    already_appended=True)
            raise ConflictError(
                f"log moved: expected last seq {expected_last_seq}, it is {last}; fold the tail and decide again",
                expected_last_seq=expected_last_seq, actual_last_seq=last,
            )
        bodies = [encode_event(e) for e in events]  # encode all first: all or nothing
        subjects = [event_subject(e) for e in events]
        for e, b, s in zip(events, bodies, subjects, strict=True):
            self._bodies.append(b)
            self._ids.append(e.event_id)
            self._subjects.append(s)
            self._times.append(datetime.now(UTC))  # storage time, as JetStream records it
        async with self._changed:
            self._changed.notify_all()
        return AppendResult(first_seq=last + 1, last_seq=last + n)

    def store_raw(self, subject: str, body: bytes, msg_id: str, ts: datetime) -> int:
        """Store an arbitrary body (malformed or from a newer version), as a foreign writer could,
        waking nobody: a log filled before anyone follows it. Its seq."""
        self._bodies.append(body)
        self._ids.append(msg_id)
        self._subjects.append(subject)
        self._times.append(ts)
        return len(self._bodies)

    async def append_raw(self, subject: str, body: bytes, msg_id: str, ts: datetime) -> int:
        """`store_raw`, then wake the followers as `append` does."""
        seq = self.store_raw(subject, body, msg_id, ts)
        async with self._changed:
            self._changed.notify_all()
        return seq

    async def read(self, start_seq: int = 1, *, start_time: datetime | None = None,
                   stop_seq: int | None = None) -> AsyncIterator[Stored]:
        stop = len(self._bodies) if stop_seq is None else min(stop_seq, len(self._bodies))
        seq = max(start_seq, 1)
        if start_time is not None:
            while seq <= stop and self._times[seq - 1] < start_time:
                seq += 1
        while seq <= stop:
            yield seq, stored_item(self._subjects[seq - 1], self._bodies[seq - 1])
            seq += 1

    async def read_subject(self, subject: str, start_seq: int = 1, *,
                           stop_seq: int | None = None) -> AsyncIterator[Stored]:
        stop = len(self._bodies) if stop_seq is None else min(stop_seq, len(self._bodies))
        for seq in range(max(start_seq, 1), stop + 1):
            if subject_matches(self._subjects[seq - 1], subject):
                yield seq, stored_item(self._subjects[seq - 1], self._bodies[seq - 1])

    async def read_batches(self, start_seq: int = 1, *, start_time: datetime | None = None,
                           stop_seq: int | None = None) -> AsyncIterator[list[Stored]]:
        batch: list[Stored] = []
        async for pair in self.read(start_seq, start_time=start_time, stop_seq=stop_seq):
            batch.append(pair)
            if len(batch) == 1000:
                yield batch
                batch = []
        if batch:
            yield batch

    async def follow_batches(self, start_seq: int = 1) -> AsyncIterator[list[Stored]]:
        async for pair in self.follow(start_seq):
            yield [pair]

    async def follow(self, start_seq: int = 1) -> AsyncIterator[Stored]:
        seq = max(start_seq, 1)
        while True:
            while seq <= len(self._bodies):
                yield seq, stored_item(self._subjects[seq - 1], self._bodies[seq - 1])
                seq += 1
            async with self._changed:
                await self._changed.wait_for(lambda: seq <= len(self._bodies))  # noqa: B023 - current seq wanted

    def events(self) -> list[Event]:
        """Every decodable stored event, in order (test helper)."""
        out: list[Event] = []
        for b in self._bodies:
            try:
                out.append(decode_event(b))
            except Exception:  # noqa: BLE001 - foreign bodies are simply not events
                continue
        return out

    async def save_snapshot(self, name: str, data: bytes) -> None:
        self._snapshots[name] = bytes(data)

    async def load_snapshot(self, name: str) -> bytes | None:
        return self._snapshots.get(name)

    async def snapshot_names(self) -> list[str]:
        return list(self._snapshots)

    async def delete_snapshot(self, name: str) -> None:
        self._snapshots.pop(name, None)
