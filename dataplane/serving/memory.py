"""The serving ports (dataplane/serving/ports.py) in memory: a dispatcher over the in-memory log
(controlplane/store/memlog.py) takes its requests, keeps its statuses and stores its results here.

For unit tests and simulations. What differs from JetStream, on purpose: a delivered request is
never redelivered (there is no ack wait; `ack` and `term` take it out of the stream), and nothing
expires. Acks published on a delivery's reply subject count, as on NATS.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from dataplane.serving.ports import Deploy, OnDelivery, RevisionMoved, ServingPorts, StorageFull, StoredRequest
from schemas.requests import Request, StatusUpdate, encode_request, status_decoder
from schemas.subjects import (
    request_consumer_partition,
    request_consumers,
    request_subject,
    status_key,
    stored_request_subject,
    subject_matches,
)

_ACK_PREFIX = "$MEM.ACK."
_POLL_S = 0.05  # a consumer that holds (`hold(k)` True) looks again this often


class MemoryDelivery:
    """A request handed to a consumer (the `Delivery` port)."""

    __slots__ = ("_stream", "data", "headers", "in_progress_count", "reply", "seq", "subject")

    def __init__(self, stream: MemoryRequests, stored: StoredRequest) -> None:
        self._stream = stream
        self.seq = stored.seq
        self.subject = stored.subject
        self.data = stored.data
        self.headers = stored.headers
        self.reply = f"{_ACK_PREFIX}{stored.seq}"
        self.in_progress_count = 0

    async def ack(self) -> None:
        self._stream.settle(self.seq)

    async def in_progress(self) -> None:
        self.in_progress_count += 1

    async def term(self) -> None:
        self._stream.settle(self.seq)


class MemoryRequests:
    """`RequestStream` in memory: a work queue, one consumer per model token."""

    def __init__(self) -> None:
        self.stored: dict[int, StoredRequest] = {}  # seq -> request, in order
        self.settled: list[int] = []  # seqs acked or terminated, in that order
        self._seq = 0
        self._watchers: list[Callable[[str], Awaitable[None]]] = []
        self._consumers: dict[str, set[int]] = {}  # model token -> seqs it delivered
        self._changed = asyncio.Event()

    async def put(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        """Store a request as a client's publish would; its sequence."""
        self._seq += 1
        self.stored[self._seq] = StoredRequest(seq=self._seq, subject=stored_request_subject(subject), data=data,
                                               headers=headers)
        self._changed.set()
        for on_subject in list(self._watchers):
            await on_subject(subject)
        return self._seq

    def settle(self, seq: int) -> None:
        if self.stored.pop(seq, None) is not None:
            self.settled.append(seq)

    async def watch(self, on_subject: Callable[[str], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        self._watchers.append(on_subject)

        async def stop() -> None:
            if on_subject in self._watchers:
                self._watchers.remove(on_subject)

        return stop

    async def stored_subjects(self) -> list[str]:
        return sorted({r.subject for r in self.stored.values()})

    async def next_stored(self, subject: str, after_seq: int) -> StoredRequest | None:
        for seq in sorted(self.stored):
            if seq > after_seq and subject_matches(self.stored[seq].subject, subject):
                return self.stored[seq]
        return None

    async def delete(self, seq: int) -> None:
        self.stored.pop(seq, None)

    async def consume(self, token: str, on_delivery: OnDelivery, hold: Callable[[int | None], bool]) -> None:
        delivered = self._consumers.setdefault(token, set())
        filters = request_consumers(token)
        while True:
            self._changed.clear()
            # Each consumer (a user partition, or the userless one) in stream order; the
            # consumers' requests interleaved, as their pulls run side by side on NATS.
            lanes: dict[str, list[int]] = {}
            for seq in sorted(self.stored):
                subject = self.stored[seq].subject
                if seq in delivered:
                    continue
                name = next((n for n, fs in filters.items() if any(subject_matches(subject, f) for f in fs)), None)
                if name is not None:
                    lanes.setdefault(name, []).append(seq)
            part = {name: request_consumer_partition(name) for name in lanes}
            rows = [[(seq, name) for seq in seqs] for name, seqs in lanes.items()]
            order = [x for row in itertools.zip_longest(*rows) for x in row if x is not None]
            for seq, name in order:
                if hold(part[name]):
                    continue  # this consumer holds; the others go on
                stored = self.stored.get(seq)
                if stored is None or seq in delivered:
                    continue
                delivered.add(seq)
                await on_delivery(MemoryDelivery(self, stored), 1)
            if token not in self._consumers:
                raise LookupError(f"the consumer of {token} was deleted")
            try:
                await asyncio.wait_for(self._changed.wait(), _POLL_S)
            except TimeoutError:
                pass

    async def consumer_tokens(self) -> list[str]:
        return list(self._consumers)

    async def delete_consumer(self, token: str) -> bool:
        return self._consumers.pop(token, None) is not None

    def is_ack(self, subject: str) -> int | None:
        """The sequence a publish on `subject` acks, or None for any other subject."""
        if subject.startswith(_ACK_PREFIX):
            tail = subject[len(_ACK_PREFIX):]
            return int(tail) if tail.isdigit() else None
        return None


class MemoryStatusKV:
    """`StatusKV` in memory: one revision counter for the bucket, as JetStream's stream sequence."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self._rev = 0
        self.full = False  # as a server whose store is full: every write refused (StorageFull)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        return self.entries.get(key)

    async def create(self, key: str, data: bytes) -> int:
        if key in self.entries:
            raise RevisionMoved(f"{key} exists")
        return self._put(key, data)

    async def update(self, key: str, data: bytes, last: int) -> int:
        have = self.entries.get(key)
        if have is None or have[1] != last:
            raise RevisionMoved(f"{key} is past revision {last}")
        return self._put(key, data)

    def _put(self, key: str, data: bytes) -> int:
        if self.full:
            raise StorageFull("the server's status store is full (insufficient resources)")
        self._rev += 1
        self.entries[key] = (bytes(data), self._rev)
        return self._rev


class MemoryResults:
    """`ResultStores` in memory: (user, name) -> body."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], bytes] = {}

    async def put(self, user: str, name: str, body: bytes) -> None:
        self.kept[(user, name)] = bytes(body)


class MemoryServing:
    """Every serving port in memory, and what a test reads back: statuses kept and published."""

    def __init__(self, deploy: Deploy) -> None:
        self.requests = MemoryRequests()
        self.statuses = MemoryStatusKV()
        self.results = MemoryResults()
        self.deploy = deploy
        self.published: list[tuple[str, bytes]] = []  # (subject, body) of every publish but acks

    def ports(self) -> ServingPorts:
        return ServingPorts(requests=self.requests, statuses=self.statuses, results=self.results,
                            publish=self.publish, deploy=self.deploy)

    async def publish(self, subject: str, data: bytes, reply: str, headers: dict[str, str] | None = None) -> None:
        seq = self.requests.is_ack(subject)
        if seq is not None:
            self.requests.settle(seq)
            return
        self.published.append((subject, bytes(data)))

    async def submit(self, req: Request) -> int:
        """Store a request on its subject (`ndif.req.<mtok>[.<user>]`), as the SDK publishes it."""
        return await self.requests.put(request_subject(req.model_key, req.user), encode_request(req),
                                       # the SDK's shape `<user>.<mac>.<request id>` (`request_msg_id`); the mac
                                       # is the owner's password's, which the dispatcher cannot check anyway
                                       {"Nats-Msg-Id": f"{req.user}.memory.{req.request_id}" if req.user else req.request_id})

    def status(self, request_id: str, user: str = "") -> StatusUpdate | None:
        """The status kept for a request, or None."""
        got = self.statuses.entries.get(status_key(request_id, user))
        return status_decoder.decode(got[0]) if got is not None and got[0] else None
