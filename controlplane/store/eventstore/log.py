"""`JetStreamEventLog`: the `EventLog` and `SnapshotStore` ports on JetStream, one object per connection.

It owns (or borrows) the connection and its settings; the work is done by the package's other
modules: topology (streams and buckets), appends, feed (reads, follow) and snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from types import TracebackType

import structlog
from nats.aio.client import Client as NatsClient
from nats.js.object_store import ObjectStore

from controlplane.core.ports import AppendResult, Stored
from controlplane.core.projections.cluster import ClusterState
from controlplane.store.credentials import JS_API, Creds, js_api, resolve
from controlplane.store.eventstore import appends, feed, snapshots, topology
from controlplane.store.eventstore.connection import connect, stream_replicas_default
from controlplane.store.eventstore.gate import FactGate
from schemas.events import Event

logger = structlog.get_logger("ndif.eventstore")

_PENDING_MSGS = 1_000_000
_PENDING_BYTES = 1 << 30
CLOSE_TIMEOUT_S = 10.0  # drain (5 s, connect()'s drain_timeout) plus its final flush and socket close


# Roles whose users may create no consumer (controlplane/ops/auth.py): they read the log by direct gets.
DIRECT_READ_ROLES = frozenset({"dashboard", "agent"})


class JetStreamEventLog:
    """`EventLog` and `SnapshotStore` on JetStream. One object per connection.

    ``async with await JetStreamEventLog.open(url) as log: ...`` owns its connection;
    ``JetStreamEventLog(nc)`` borrows one.
    """

    def __init__(self, nc: NatsClient, *, timeout: float = 5.0, replicas: int | None = None,
                 api: str = JS_API) -> None:
        self.nc = nc
        # The JetStream API prefix: `$JS.API`, or `$JS.NDIF.API` for a user outside the system's
        # account (controlplane/ops/auth.py), which imports the API under it.
        self.api = api
        self.js = nc.jetstream(timeout=timeout, prefix=api)
        self.timeout = timeout
        # Copies of every stream and bucket it creates: 1 on a single server, 3 on a 3-server cluster
        # (deploy/nats/); NDIF_STREAM_REPLICAS sets it for every component that does not pass it.
        self.replicas = replicas if replicas is not None else stream_replicas_default()
        self._owns_nc = False
        # Client-side buffer of a follower; past it nats-py drops messages (slow consumer) and
        # the follower's gap check resubscribes. Large by default; tests shrink it.
        self.pending_msgs_limit = _PENDING_MSGS
        self.pending_bytes_limit = _PENDING_BYTES
        self.stall_check_s = 1.0  # a follower idle this long checks the stream for a stall
        self.may_create = True
        # Read with batched direct gets instead of an ordered consumer (controlplane/store/direct.py):
        # for roles that may create no consumer (DIRECT_READ_ROLES), since a consumer's deliver
        # subject is beyond what subject permissions can restrict.
        self.direct_reads = False
        self.direct_poll_s = 0.5  # a direct-read follower asks again this often without a wake-up
        self._obs: ObjectStore | None = None  # the snapshot bucket, once written to
        # How `open` connected: snapshot writes then get a connection of their own, so their acks
        # never wait behind a follower's backlog of events on this one.
        self._reopen: tuple[str, str, Creds | None] | None = None
        self._writes_nc: NatsClient | None = None

    @classmethod
    async def open(cls, url: str, *, timeout: float = 5.0, replicas: int | None = None, ensure: bool = True,
                   name: str = "ndif", creds: Creds | None = None, role: str = "admin",
                   node_id: str = "") -> JetStreamEventLog:
        """Connect as `creds`, or as the local user of `role` (auth.resolve: NDIF_CREDS, $NDIF_HOME/auth/)."""
        if creds is None:
            creds = resolve(role, url=url, node_id=node_id)
        self = cls(await connect(url, name=name, timeout=timeout, creds=creds), timeout=timeout, replicas=replicas,
                   api=js_api(creds))
        self._owns_nc = True
        self._reopen = (url, name, creds)
        # Only an admin (or anyone on an open server) may create or reconfigure streams; the
        # others check that they exist.
        self.may_create = creds is None or creds.role == "admin"
        self.direct_reads = creds is not None and creds.role in DIRECT_READ_ROLES
        if ensure:
            await self.ensure()
        return self

    async def close(self) -> None:
        """Drain and close an owned connection, within CLOSE_TIMEOUT_S whatever the server does.

        nats-py's drain raises while reconnecting and its close can wait on a socket that never
        flushes; either way the connection is closed (or abandoned, with a warning) and close returns.
        """
        if self._writes_nc is not None:
            writes, self._writes_nc, self._obs = self._writes_nc, None, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writes.close(), CLOSE_TIMEOUT_S)
        if not self._owns_nc or self.nc.is_closed:
            return
        step = asyncio.ensure_future(self.nc.drain() if not self.nc.is_reconnecting else self.nc.close())
        done, _ = await asyncio.wait([step], timeout=CLOSE_TIMEOUT_S)
        if not done:
            step.cancel()  # not awaited: nats-py's drain swallows cancellation
            logger.warning("nats_close_timed_out", seconds=CLOSE_TIMEOUT_S)
        elif not step.cancelled() and (err := step.exception()) is not None:
            logger.warning("nats_drain_failed", error=str(err) or type(err).__name__)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> JetStreamEventLog:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ---- setup (topology.py) -----------------------------------------------------------------

    async def ensure(self, *, start_new_history: bool = False) -> None:
        """Create or update every stream and bucket of docs/architecture.md §2. Safe to call any number of times.

        A user who may not create streams (any role but admin) only checks that they exist. The
        event stream is never created anew where the rest of a deployment exists (the request
        stream or any bucket): its history was lost (deleted, or a wrong store) and an operator
        must decide; `start_new_history=True` (`ndif up --new-history`) is that decision.
        """
        await topology.ensure(self.js, replicas=self.replicas, may_create=self.may_create,
                              start_new_history=start_new_history)

    async def last_seq(self) -> int:
        return await topology.last_seq(self.js, self.timeout)

    def fact_gate(self, state: Callable[[], ClusterState], caught_up: Callable[[], Awaitable[None]]) -> FactGate:
        """The gate that admits observed facts into this log (gate.py), run by the controller."""
        return FactGate(self.nc, self.js, state, caught_up, timeout=self.timeout)

    # ---- appends (appends.py) ----------------------------------------------------------------

    async def append(self, events: Sequence[Event], expected_last_seq: int | None,
                     *, _resend: bool = False) -> AppendResult:
        return await appends.append(self.nc, self.js, events, expected_last_seq, timeout=self.timeout,
                                    _resend=_resend)

    # ---- reads (feed.py) ---------------------------------------------------------------------

    def read(self, start_seq: int = 1, *, start_time: datetime | None = None,
             stop_seq: int | None = None) -> AsyncIterator[Stored]:
        return feed.read(self, start_seq, start_time=start_time, stop_seq=stop_seq)

    def read_batches(self, start_seq: int = 1, *, start_time: datetime | None = None,
                     stop_seq: int | None = None) -> AsyncIterator[list[Stored]]:
        """Like `read`, in lists of whatever arrived together (a fold then loops without awaiting)."""
        return feed.read_batches(self, start_seq, start_time=start_time, stop_seq=stop_seq)

    def read_subject(self, subject: str, start_seq: int = 1, *, stop_seq: int | None = None) -> AsyncIterator[Stored]:
        return feed.read_subject(self, subject, start_seq, stop_seq=stop_seq)

    def follow(self, start_seq: int = 1) -> AsyncIterator[Stored]:
        return feed.follow(self, start_seq)

    def follow_batches(self, start_seq: int = 1) -> AsyncIterator[list[Stored]]:
        return feed.follow_batches(self, start_seq)

    async def seq_at(self, when: datetime) -> int | None:
        """Sequence of the first event stored at or after `when` (None if there is none)."""
        return await feed.seq_at(self, when)

    # ---- snapshots (snapshots.py) ------------------------------------------------------------

    async def _snapshot_bucket(self) -> ObjectStore:
        if self._obs is None:
            nc = self.nc
            if self._reopen is not None:
                url, name, creds = self._reopen
                nc = self._writes_nc = await connect(url, name=f"{name}-snapshots", timeout=self.timeout, creds=creds)
            self._obs = await snapshots.open_store(nc)
        return self._obs

    async def save_snapshot(self, name: str, data: bytes) -> None:
        await snapshots.save_snapshot(await self._snapshot_bucket(), name, data)

    async def load_snapshot(self, name: str) -> bytes | None:
        return await snapshots.load_snapshot(self.nc, name, timeout=self.timeout, api=self.api)

    async def snapshot_names(self) -> list[str]:
        return await snapshots.snapshot_names(self.nc, timeout=self.timeout, api=self.api)

    async def delete_snapshot(self, name: str) -> None:
        await snapshots.delete_snapshot(await self._snapshot_bucket(), name)
