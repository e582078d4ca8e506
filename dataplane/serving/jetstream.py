"""The serving ports (dataplane/serving/ports.py) on NATS JetStream: the work-queue stream
`NDIF_REQUESTS` with one durable pull consumer per model, the KV bucket of request statuses, the
Object Store buckets of large results, and commands to the controller over the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.serving.ports import (
    REQUEST_MAX_DELIVER,
    OnDelivery,
    ResultsUnavailable,
    RevisionMoved,
    ServingPorts,
    StorageFull,
    StoredRequest,
)
from dataplane.serving.pull import PullConsumer
from schemas import errors as errs
from schemas.commands import CommandResult
from schemas.subjects import (
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    request_consumer_partition,
    request_consumer_token,
    request_consumers,
    results_bucket,
)

CONSUMER_PAGE = 256  # consumers the server lists per request
MAX_CONSUMERS_LISTED = 100_000  # a bound on one sweep's listing (about 5,800 models' consumers)
NO_MESSAGE_FOUND = 10057  # the server's error code for a stream message that is not (any more) there


logger = structlog.get_logger("ndif.dispatcher")

class JetStreamRequests:
    """`RequestStream` on the work-queue stream `NDIF_REQUESTS`: each of a model's durable consumers
    (`proc-<mtok>`, `part<k>-<mtok>`) acks explicitly, redelivers after `ack_wait_s` and is pulled
    `fetch_batch` at a time."""

    def __init__(self, nc: NatsClient, js: JetStreamContext, *, ack_wait_s: float, fetch_batch: int) -> None:
        self.nc = nc
        self.js = js
        self.ack_wait_s = ack_wait_s
        self.fetch_batch = fetch_batch

    async def watch(self, on_subject: Callable[[str], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            await on_subject(msg.subject)

        sub = await self.nc.subscribe(REQUESTS_ALL, cb=cb)
        return sub.unsubscribe

    async def stored_subjects(self) -> list[str]:
        try:
            info = await self.js.stream_info(REQUESTS_STREAM, subjects_filter=REQUESTS_ALL)
        except nats.js.errors.NotFoundError:
            return []
        return list(info.state.subjects or {})

    async def next_stored(self, subject: str, after_seq: int) -> StoredRequest | None:
        try:
            raw = await self.js.get_msg(REQUESTS_STREAM, seq=after_seq + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        return StoredRequest(seq=int(raw.seq or after_seq + 1), subject=raw.subject or subject, data=raw.data or b"",
                             headers=raw.headers)

    async def delete(self, seq: int) -> None:
        try:
            await self.js.delete_msg(REQUESTS_STREAM, seq)
        except nats.js.errors.NotFoundError:
            pass
        except nats.js.errors.APIError as exc:
            if exc.err_code != NO_MESSAGE_FOUND:  # deleted already (by another dispatcher's triage)
                raise

    async def consume(self, token: str, on_delivery: OnDelivery, hold: Callable[[int | None], bool]) -> None:
        """The model's durable consumers (`proc-<mtok>` and one per user partition), made or
        corrected here, pulled at once: one partition's burst is not read ahead of another's
        requests. Ends (raises) when any of them is lost; the caller makes them again."""

        async def on_msg(m: Msg) -> None:
            await on_delivery(m, int(m.metadata.num_delivered) if m.metadata else 1)

        consumers = request_consumers(token)
        for durable, filters in consumers.items():
            await self._ensure_consumer(durable, filters)
        try:
            async with asyncio.TaskGroup() as tg:
                for durable in consumers:
                    # `hold` is looked at again every heartbeat of the pull, for the consumer's partition.
                    part = request_consumer_partition(durable)
                    pull = PullConsumer(self.nc, REQUESTS_STREAM, durable, on_msg, batch=self.fetch_batch,
                                        hold=functools.partial(hold, part))
                    tg.create_task(pull.run(), name=f"pull-{durable}")
        except ExceptionGroup as eg:
            # One consumer lost (deleted, the connection gone): the caller decides whether to make
            # them again (never for a model the log no longer knows), and logs why.
            raise eg.exceptions[0] from None

    async def _ensure_consumer(self, durable: str, filters: list[str]) -> None:
        cfg = api.ConsumerConfig(durable_name=durable, filter_subjects=filters,
                                 ack_policy=api.AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s,
                                 max_deliver=REQUEST_MAX_DELIVER, max_ack_pending=100_000,
                                 deliver_policy=api.DeliverPolicy.ALL)
        try:
            have = await self.js.consumer_info(REQUESTS_STREAM, durable)
            if (sorted(have.config.filter_subjects or [have.config.filter_subject or ""]) != sorted(filters)
                    or (have.config.ack_wait is not None and abs(have.config.ack_wait - self.ack_wait_s) > 0.01)
                    or have.config.max_deliver != REQUEST_MAX_DELIVER):  # an older version's (unbounded)
                await self.js.add_consumer(REQUESTS_STREAM, cfg)  # made by an older version or another ack wait
        except nats.js.errors.NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):  # made by a peer meanwhile
                await self.js.add_consumer(REQUESTS_STREAM, cfg)

    async def consumer_tokens(self) -> list[str]:
        """Every model token with a consumer, read a page (the server's 256) at a time: a model has
        17, so one page names about 15 models."""
        tokens: dict[str, None] = {}
        listed = 0
        while listed < MAX_CONSUMERS_LISTED:
            page = await self.js.consumers_info(REQUESTS_STREAM, offset=listed or None)
            listed += len(page)
            for info in page:
                token = request_consumer_token(info.name or "")
                if token is not None:
                    tokens[token] = None
            if len(page) < CONSUMER_PAGE:
                break
        return list(tokens)

    async def delete_consumer(self, token: str) -> bool:
        """Delete every durable consumer of the model; whether there was any."""
        deleted = False
        for durable in request_consumers(token):
            try:
                deleted = bool(await self.js.delete_consumer(REQUESTS_STREAM, durable)) or deleted
            except nats.js.errors.NotFoundError:
                pass
        return deleted


class JetStreamStatusKV:
    """`StatusKV` on the KV bucket `ndif_request_status` (the server republishes each write on
    `ndif.status.>`)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, key: str) -> tuple[bytes, int] | None:
        try:
            e = await self.kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return e.value or b"", int(e.revision or 0)

    async def create(self, key: str, data: bytes) -> int:
        try:
            return await self.kv.create(key, data)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise RevisionMoved(f"{key} exists") from exc
        except nats.js.errors.APIError as exc:
            if (full := _store_full(exc)) is not None:
                raise full from exc
            raise

    async def update(self, key: str, data: bytes, last: int) -> int:
        try:
            return await self.kv.update(key, data, last=last)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise RevisionMoved(f"{key} is past revision {last}") from exc
        except nats.js.errors.APIError as exc:
            if (full := _store_full(exc)) is not None:
                raise full from exc
            raise


# JetStream's codes for a write refused for want of room, and what would make room: the server's
# store has no more (insufficient resources; storage resources exceeded), the account's JetStream
# limit is reached, or the bucket is at its own limit (store failed: "maximum bytes exceeded").
STORE_FULL_REMEDIES = {
    10023: "the operator frees room on the server's disk or raises its max_file_store",
    10047: "the operator frees room on the server's disk or raises its max_file_store",
    10002: "the operator raises the system account's JetStream limits",
}
STORE_FAILED_CODE = 10077


def _store_full(exc: nats.js.errors.APIError) -> StorageFull | None:
    remedy = STORE_FULL_REMEDIES.get(exc.err_code or 0)
    if remedy is None and exc.err_code == STORE_FAILED_CODE and "exceeded" in (exc.description or ""):
        remedy = "the bucket is at its own limit: older statuses must expire first, or the operator raises it"
    if remedy is None:
        return None
    return StorageFull(f"the status store is full ({exc.description}, JetStream error {exc.err_code}); {remedy}")


RESULTS_MAX_BYTES = 1 << 30  # one user's kept large results (NDIF_RESULTS_MAX_BYTES)
RESULTS_MAX_AGE_S = 24 * 3600.0  # how long a large result is kept (NDIF_RESULTS_MAX_AGE_S)


class ResultLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Each user's results bucket: at most `max_bytes` kept, each result for `max_age_s`."""

    max_bytes: int = RESULTS_MAX_BYTES
    max_age_s: float = RESULTS_MAX_AGE_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ResultLimits:
        try:
            out = cls(max_bytes=int(env.get("NDIF_RESULTS_MAX_BYTES") or RESULTS_MAX_BYTES),
                      max_age_s=float(env.get("NDIF_RESULTS_MAX_AGE_S") or RESULTS_MAX_AGE_S))
        except ValueError as exc:
            raise errs.InvalidCommand(f"NDIF_RESULTS_MAX_BYTES / NDIF_RESULTS_MAX_AGE_S: {exc}") from None
        if out.max_bytes < 1 or not out.max_age_s > 0:
            raise errs.InvalidCommand("NDIF_RESULTS_MAX_BYTES and NDIF_RESULTS_MAX_AGE_S must be positive")
        return out


class JetStreamResults:
    """`ResultStores` on Object Store buckets: `ndif_results_<user>` (only that client may read it),
    created on its user's first large result with `replicas` copies and `limits` (a bucket an
    earlier version made gets them when first opened here); `shared` without a user."""

    def __init__(self, js: JetStreamContext, shared: ObjectStore, *, replicas: int,
                 limits: ResultLimits | None = None) -> None:
        self.js = js
        self.shared = shared
        self.replicas = replicas
        self.limits = limits or ResultLimits()
        self._stores: dict[str, ObjectStore] = {}  # user -> its bucket, opened or created

    async def store(self, user: str) -> ObjectStore:
        """The bucket of `user`'s large results (opened, or created on first use); the shared one for ""."""
        if not user:
            return self.shared
        store = self._stores.get(user)
        if store is None:
            bucket = results_bucket(user)
            try:
                store = await self.js.object_store(bucket)
                await self._limit(bucket)
            except nats.js.errors.NotFoundError:
                store = await self.js.create_object_store(bucket, config=api.ObjectStoreConfig(
                    bucket=bucket, replicas=self.replicas, storage=api.StorageType.FILE,
                    max_bytes=self.limits.max_bytes, ttl=self.limits.max_age_s))
            self._stores[user] = store
        return store

    async def put(self, user: str, name: str, body: bytes) -> None:
        try:
            store = await self.store(user)
        except nats.errors.Error as exc:
            # No bucket for this user and no right to make one (a client user added to the server
            # without the config's dispatcher grant).
            raise ResultsUnavailable(str(exc) or type(exc).__name__) from exc
        try:
            await store.put(name, body)
        except nats.js.errors.APIError as exc:
            if not _over_limit(exc):
                raise
            # Its chunks stored before the limit was reached age out with the bucket's max age.
            raise StorageFull(f"the results store of user {user!r} is full ({self.limits.max_bytes} bytes kept at "
                              f"most, each for {self.limits.max_age_s:g} s): fetch or wait for older results to "
                              "expire, or ask the operator to raise NDIF_RESULTS_MAX_BYTES",
                              limit_bytes=self.limits.max_bytes) from exc

    async def _limit(self, bucket: str) -> None:
        """Give a bucket without this service's limits (made by an earlier version) its limits."""
        info = await self.js.stream_info(f"OBJ_{bucket}")
        cfg = info.config
        age = self.limits.max_age_s
        if cfg.max_bytes == self.limits.max_bytes and cfg.max_age == age:
            return
        cfg.max_bytes, cfg.max_age = self.limits.max_bytes, age
        try:
            await self.js.update_stream(cfg)
        except nats.js.errors.APIError as exc:
            logger.warning("results_bucket_unlimited", bucket=bucket, error=str(exc))


def _over_limit(exc: nats.js.errors.APIError) -> bool:
    """A publish refused because the stream is at its byte limit (or the server's store is full)."""
    text = (exc.description or "").lower()
    return "maximum bytes" in text or "insufficient resources" in text or exc.err_code in (10047, 10054)


async def open_ports(nc: NatsClient, log: JetStreamEventLog, *, actor: str, ack_wait_s: float,
                     fetch_batch: int, results_limits: ResultLimits | None = None) -> ServingPorts:
    """The serving ports on `nc`: the request stream, status bucket and results buckets of the server
    `log` is on, and commands (`deploy`) to the controllers that append to it."""
    js = nc.jetstream()
    admin = AdminClient(JetStreamEventLog(nc), actor=actor)  # commands only: a request on `nc`

    async def deploy(model_key: str, replicas: int, user: str) -> CommandResult:
        # Only what the operator offers, and only as the operator's on-demand rights allow `user`.
        return await admin.deploy(model_key, replicas, for_request=True, for_user=user)

    return ServingPorts(
        requests=JetStreamRequests(nc, js, ack_wait_s=ack_wait_s, fetch_batch=fetch_batch),
        statuses=JetStreamStatusKV(await js.key_value(REQUEST_STATUS_BUCKET)),
        results=JetStreamResults(js, await js.object_store(RESULTS_BUCKET), replicas=log.replicas,
                                 limits=results_limits or ResultLimits.from_env(os.environ)),
        publish=nc.publish, deploy=deploy)
