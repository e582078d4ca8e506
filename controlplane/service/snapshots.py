"""The snapshot writer: the controller stores a snapshot of its fold every N events or T seconds.

The controller is the one writer (several controllers write the same bytes under the same name:
the fold is deterministic). Every reader starts from the newest snapshot that matches the log
(controlplane/store/rebuild.py). Every snapshot written stays readable, so any past position is one
snapshot plus a short tail, unless a retention (`keep`) is set: then only the newest `keep` stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from controlplane.core.ports import SnapshotStore
from controlplane.core.projections import ClusterState
from controlplane.core.projections.snapshot import KIND, encode_stored, parse_name, snapshot_name
from controlplane.store.rebuild import candidates

logger = structlog.get_logger("ndif.snapshots")

# Events between snapshots. A fold to any point (a start, `ndif replay --until`, the dashboard's
# timeline) reads one snapshot (~400 KB stored, ~10 ms to decode) and the events after it, on
# average half this interval: the tail is most of the cost (~17 us an event read, decoded and folded
# on a quiet core), so 5,000 keeps a random past point near 100 ms there. The price: one encode
# (~12 ms) per interval on the controller, and ~80 MB of snapshots per million events kept.
SNAPSHOT_EVERY = 5_000
SNAPSHOT_EVERY_S = 3600.0  # seconds between snapshots (when the log moved meanwhile)


class SnapshotWriter:
    """Encodes the fold when a snapshot is due and stores it in the background, one write at a time.

    `every`: events since the last snapshot (0: never by count); `every_s`: seconds since the last
    one, if any event came meanwhile (0: never by time); `keep`: the newest snapshots kept (None:
    all). A write that fails is logged; the next is encoded when it is due."""

    def __init__(self, store: SnapshotStore, *, every: int = SNAPSHOT_EVERY, every_s: float = SNAPSHOT_EVERY_S,
                 keep: int | None = None) -> None:
        if every < 0 or every_s < 0:
            raise ValueError("snapshot intervals must be >= 0 (0: off)")
        if keep is not None and keep < 1:
            raise ValueError("snapshot retention keeps at least 1")
        self.store = store
        self.every = every
        self.every_s = every_s
        self.keep = keep
        self.written_seq = 0  # seq of the newest snapshot stored or encoded to be (found at start, or since)
        self._written_at = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._pending: tuple[str, bytes, int] | None = None  # encoded, waiting for the write in flight
        self._stopped = False
        self.dropped = 0  # encoded but never stored: a newer one came while it waited
        self.written = 0  # snapshots this writer stored
        self.last_bytes = 0  # size of the last one

    @property
    def enabled(self) -> bool:
        return bool(self.every or self.every_s)

    async def start(self, last_seq: int) -> SnapshotWriter:
        """Find where the stored snapshots end; remove those past the log's end (a log started anew
        left them: they can never match it)."""
        try:
            names = await self.store.snapshot_names()
        except Exception as exc:  # noqa: BLE001 - the first write will say whether the bucket works
            logger.warning("snapshots_unreadable", error=str(exc) or type(exc).__name__)
            return self
        for n in map(parse_name, names):
            if n is not None and n.kind == KIND and n.seq > last_seq:
                with contextlib.suppress(Exception):
                    await self.store.delete_snapshot(n.name)
                    logger.warning("snapshot_removed", name=n.name, reason=f"past the log's end (seq {last_seq})")
        ours = candidates(names, until_seq=last_seq)
        self.written_seq = ours[0].seq if ours else 0
        return self

    def due(self, state: ClusterState) -> bool:
        moved = state.seq - self.written_seq
        if moved <= 0:
            return False
        return bool((self.every and moved >= self.every)
                    or (self.every_s and time.monotonic() - self._written_at >= self.every_s))

    def after_batch(self, state: ClusterState) -> None:
        """Called after each folded batch (and now and then): if one is due, encode the fold now and
        store it in the background. While one is being stored the next due one waits (the newest
        only: an older one still waiting is dropped, counted in `dropped`)."""
        if not self.enabled or self._stopped or not self.due(state):
            return
        header, data = encode_stored(state)  # now, before the fold moves on
        self.written_seq, self._written_at = state.seq, time.monotonic()
        job = (snapshot_name(header), data, header.seq)
        if self._task is not None and not self._task.done():
            if self._pending is not None:
                self.dropped += 1
            self._pending = job
            return
        self._store(job)

    def _store(self, job: tuple[str, bytes, int]) -> None:
        self._task = asyncio.create_task(self._save(*job), name="snapshot-write")
        self._task.add_done_callback(self._next)

    def _next(self, _: asyncio.Task[None]) -> None:
        if self._pending is not None and not self._stopped:
            job, self._pending = self._pending, None
            self._store(job)

    async def write_now(self, state: ClusterState) -> str:
        """Store a snapshot of `state` at once (tests, tools); returns its name."""
        header, data = encode_stored(state)
        self.written_seq, self._written_at = state.seq, time.monotonic()
        name = snapshot_name(header)
        await self._save(name, data, header.seq)
        return name

    async def _save(self, name: str, data: bytes, seq: int) -> None:
        t0 = time.perf_counter()
        try:
            await self.store.save_snapshot(name, data)
        except Exception as exc:  # noqa: BLE001 - a bucket away or full: the fold goes on, tried again later
            logger.warning("snapshot_write_failed", name=name, error=str(exc) or type(exc).__name__)
            return
        self.written += 1
        self.last_bytes = len(data)
        logger.info("snapshot_written", name=name, seq=seq, bytes=len(data), seconds=round(time.perf_counter() - t0, 3))
        if self.keep is not None:
            await self._retain(self.keep)

    async def _retain(self, keep: int) -> None:
        try:
            names = await self.store.snapshot_names()
            ours = sorted((n for n in map(parse_name, names) if n is not None and n.kind == KIND),
                          key=lambda n: n.seq, reverse=True)
            for n in ours[keep:]:
                await self.store.delete_snapshot(n.name)
                logger.info("snapshot_removed", name=n.name, reason=f"retention keeps the newest {keep}")
        except Exception as exc:  # noqa: BLE001 - the next write retries the retention
            logger.warning("snapshot_retention_failed", error=str(exc) or type(exc).__name__)

    async def stop(self) -> None:
        """Let the write in flight and the one waiting finish (10 s at most), then stop."""
        self._stopped = True
        deadline = time.monotonic() + 10
        while self._task is not None and not self._task.done() and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), max(0.01, deadline - time.monotonic()))
        if self._pending is not None and time.monotonic() < deadline:
            job, self._pending = self._pending, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._save(*job), max(0.01, deadline - time.monotonic()))
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
