"""Ports of the serving side: what a dispatcher needs from the outside world besides its event log.

A dispatcher takes requests from a work queue (`RequestStream`, each one handed over as a
`Delivery`), keeps request statuses (`StatusKV`, compare-and-set on a revision), stores large
results (`ResultStores`), publishes statuses and acks in order (`Publish`), and asks a controller
for replicas (`Deploy`). dataplane/serving/jetstream.py implements them on NATS JetStream;
dataplane/serving/memory.py in memory, so the dispatcher runs over the in-memory log in unit tests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from schemas.commands import CommandResult
from schemas.errors import NdifError

Publish = Callable[[str, bytes, str, dict[str, str] | None], Awaitable[None]]  # (subject, body, reply or "", headers)
# (model key, replicas, the user whose request asks) -> the controller's answer
Deploy = Callable[[str, int, str], Awaitable[CommandResult]]


# Deliveries of one request before it is ended `DeadLetter` (at the last one, without running): a
# redelivery means its dispatcher stopped before ending it, so a request that takes its dispatcher
# down each time cannot come back forever.
REQUEST_MAX_DELIVER = 5


class Delivery(Protocol):
    """A request handed to the dispatcher; it stays the dispatcher's until acked (or terminated).

    Acking by publishing an empty body on `reply` (through the ordered outbox) is the same as `ack()`.
    """

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def reply(self) -> str: ...

    @property
    def headers(self) -> dict[str, str] | None: ...

    async def ack(self) -> None:
        """Done with it: never delivered again."""
        ...

    async def in_progress(self) -> None:
        """Still working on it: do not hand it to another dispatcher yet."""
        ...

    async def term(self) -> None:
        """It will never run: never delivered again."""
        ...


OnDelivery = Callable[[Delivery, int], Awaitable[None]]  # (the request, its delivery attempt, from 1)


class StoredRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request as the stream stores it, read by position (no consumer)."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


class RequestStream(Protocol):
    """The work queue of requests (`ndif.req.<mtok>[.<user>]`, a user's stored under its partition),
    durable consumers per model token and user partition (docs/architecture.md decision 49)."""

    async def watch(self, on_subject: Callable[[str], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Call `on_subject` with the subject of each request as it is published; returns the stop."""
        ...

    async def stored_subjects(self) -> list[str]:
        """Subjects that hold stored requests now ([] when there is no stream)."""
        ...

    async def next_stored(self, subject: str, after_seq: int) -> StoredRequest | None:
        """The first stored request on `subject` (a filter) past `after_seq`, or None."""
        ...

    async def delete(self, seq: int) -> None:
        """Drop a stored request (nothing when it is gone already)."""
        ...

    async def consume(self, token: str, on_delivery: OnDelivery, hold: Callable[[int | None], bool]) -> None:
        """Hand the model's requests to `on_delivery` as they are stored, through its durable
        consumers (made here if missing; one per user partition, each user's requests in order);
        none of a consumer's while `hold(k)` is True for its partition k (None: the userless one).
        Runs until cancelled, or raises when a consumer or the connection is lost (the caller
        makes them again)."""
        ...

    async def consumer_tokens(self) -> list[str]:
        """The model tokens that have a durable consumer."""
        ...

    async def delete_consumer(self, token: str) -> bool:
        """Delete a model's durable consumer; whether there was one."""
        ...


class RevisionMoved(NdifError):
    """A compare-and-set on a status lost: the key is not at the revision the write expected."""

    default_retryable = True


class ResultsUnavailable(NdifError):
    """No results store for this user, and none may be made (a permission the server lacks)."""


class StorageFull(NdifError):
    """A store is at its byte limit: the write was not kept (`limit_bytes`: the limit)."""

    def __init__(self, message: str, *, limit_bytes: int | None = None) -> None:
        super().__init__(message)
        self._set(limit_bytes=limit_bytes)

    @property
    def limit_bytes(self) -> int | None:
        return self._limit_bytes  # type: ignore[attr-defined,no-any-return]


class StatusKV(Protocol):
    """The kept status of each request, by key (`status_key`): the latest write wins, compare-and-set."""

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, revision) of the key; None when it holds nothing (never written, or deleted)."""
        ...

    async def create(self, key: str, data: bytes) -> int:
        """Write a key that holds nothing; its revision. RevisionMoved when it holds something."""
        ...

    async def update(self, key: str, data: bytes, last: int) -> int:
        """Write a key still at revision `last`; its new revision. RevisionMoved when it moved."""
        ...


class ResultStores(Protocol):
    """Where results too large to go inline are kept, per user (each reads only their own)."""

    async def put(self, user: str, name: str, body: bytes) -> None:
        """Keep `body` as `name` in `user`'s store (the shared one for ""). ResultsUnavailable
        when there is no store for `user` and none may be made."""
        ...


@dataclass(frozen=True, kw_only=True)
class ServingPorts:
    """Everything a dispatcher is given besides its event log (and, optionally, a NATS connection)."""

    requests: RequestStream
    statuses: StatusKV
    results: ResultStores
    publish: Publish
    deploy: Deploy
