"""Ports: what the control plane needs from the outside world, as Protocols.

Only adapter modules (`eventstore/` for JetStream, `memlog.py` in memory) implement them; the
contract suite in tests/contract/ runs the same cases against every implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Protocol, runtime_checkable

import msgspec

from schemas.events import AnyEvent, Event, Skipped

Stored = tuple[int, AnyEvent | Skipped]  # (stream sequence, decoded event or why it was skipped)


class AppendResult(msgspec.Struct, frozen=True, kw_only=True):
    """Where an append landed. `already_appended`: these event ids were stored before (a resend)."""

    first_seq: int
    last_seq: int
    already_appended: bool = False


class EventLog(Protocol):
    async def last_seq(self) -> int:
        """Sequence of the last stored event (0 when empty)."""
        ...

    async def append(self, events: Sequence[Event], expected_last_seq: int | None) -> AppendResult:
        """Append all of `events` or none, only if the log's last sequence is `expected_last_seq`.

        `None`: no expectation, for observed facts (what an agent saw does not depend on state).
        Raises ConflictError (with the actual last sequence) when the log moved, InvalidCommand for
        an empty or over-long batch, InfrastructureError when the outcome cannot be established.
        A resend of already stored event ids returns their positions with `already_appended`.

        An observed fact whose subject carries its source (an agent's or a dispatcher's,
        schemas/subjects.py `is_fact_subject`) is appended alone and unguarded (else InvalidCommand).
        The JetStream log stores it in the facts stream, which the log sources from: its ack names
        no log sequence, so the result is 0..0 (`already_appended` on a resend); the append returns
        once the log holds the fact. Whoever needs its position finds it by its event id, never by
        comparing a sequence of the facts stream with the log's.
        """
        ...

    def read(self, start_seq: int = 1, *, start_time: datetime | None = None,
             stop_seq: int | None = None) -> AsyncIterator[Stored]:
        """Stored events from `start_seq` (or the first stored at/after `start_time`) up to `stop_seq`
        (default: the last sequence when the read starts), then stop."""
        ...

    def read_batches(self, start_seq: int = 1, *, start_time: datetime | None = None,
                     stop_seq: int | None = None) -> AsyncIterator[list[Stored]]:
        """`read` in lists of consecutive events (what arrived together): folds loop without awaiting."""
        ...

    def follow(self, start_seq: int = 1) -> AsyncIterator[Stored]:
        """Every stored event from `start_seq` on, live, forever; contiguous sequences, no gaps."""
        ...

    def follow_batches(self, start_seq: int = 1) -> AsyncIterator[list[Stored]]:
        """`follow` in lists of consecutive events."""
        ...


@runtime_checkable
class SubjectReads(Protocol):
    """Reads of the events stored on one subject filter only, selected by the store: a reader of one
    model's events is sent those, not the whole log to drop the rest of (both logs here do this)."""

    def read_subject(self, subject: str, start_seq: int = 1, *, stop_seq: int | None = None) -> AsyncIterator[Stored]:
        """Stored events on subjects that match `subject` (NATS wildcards) from `start_seq` up to
        `stop_seq` (default: the last sequence when the read starts), in order."""
        ...


@runtime_checkable
class SnapshotStore(Protocol):
    """Stored snapshots by name (controlplane/core/projections/snapshot.py says what a name and the
    bytes hold). Every snapshot written stays until deleted: the writer's retention deletes."""

    async def save_snapshot(self, name: str, data: bytes) -> None:
        """Store `data` under `name` (replacing what was there)."""
        ...

    async def load_snapshot(self, name: str) -> bytes | None:
        """The bytes stored under `name`; None when there are none."""
        ...

    async def snapshot_names(self) -> list[str]:
        """The name of every stored snapshot, in no particular order."""
        ...

    async def delete_snapshot(self, name: str) -> None:
        """Remove `name` (nothing when it is not there)."""
        ...


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """A node's last heartbeat as the store keeps it."""

    at: datetime  # the store's time of the beat
    seq: int  # its position in the store: a later beat has a higher one
    stopped: bool = False  # the agent's goodbye: it stopped cleanly
    pool: tuple[int, int] | None = None  # its replica process pool, (ready, size), when it keeps one

    def age_s(self, now: datetime) -> float:
        return max(0.0, (now - self.at).total_seconds())


class Heartbeats(Protocol):
    """Where node agents say they are alive (JetStream: the KV bucket `ndif_heartbeats`, which
    forgets a node's key some time after its last beat)."""

    async def beat(self, node_id: str, pool: tuple[int, int] | None = None) -> None:
        """This node is alive, now (with its process pool's (ready, size), when it keeps one)."""
        ...

    async def goodbye(self, node_id: str) -> None:
        """This node's agent stops cleanly (another may take its node id at once)."""
        ...

    async def last(self, node_id: str) -> Heartbeat | None:
        """The node's last heartbeat still kept, or None (never beat, or forgotten)."""
        ...
