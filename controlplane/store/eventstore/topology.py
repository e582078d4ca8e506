"""Streams and buckets of docs/architecture.md §2: create or update them (`ensure`), check they exist,
read the event stream's last sequence (`last_seq`).

The log is one stream, NDIF_EVENTS: the controller's decisions are appended to it, and its fact
gate appends the observed facts it admits from NDIF_FACTS, where agents and the dispatcher send
them (no atomic batches there: an agent's open batches never count against the log's).

Functions of a JetStream context; the log (log.py) passes its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext, api

from controlplane.store.eventstore.connection import EVENT_MAX_MSG_BYTES, REQUEST_MAX_MSG_BYTES, STATUS_MAX_VALUE_BYTES
from schemas.errors import InfrastructureError, InfrastructureTimeout
from schemas.events import FACT_MAX_BYTES
from schemas.subjects import (
    EVENTS_STREAM,
    FACT_GATE_CONSUMER,
    FACT_LOG_SUBJECTS,
    FACTS_STREAM,
    FACTS_SUBJECTS,
    HEARTBEATS_BUCKET,
    LOG_SUBJECTS,
    REFUSED_PREFIX,
    REFUSED_STREAM,
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    REQUESTS_TRANSFORM_DEST,
    REQUESTS_TRANSFORM_SRC,
    RESULTS_BUCKET,
    SNAPSHOTS_BUCKET,
    STATUS_PREFIX,
)

logger = structlog.get_logger("ndif.eventstore")

HEARTBEAT_TTL_S = 15.0
REQUEST_STATUS_TTL_S = 24 * 3600.0
DUPLICATE_WINDOW_S = 120.0
# A fact lives on in the log once admitted (within milliseconds while a controller runs); the facts
# stream keeps it a day (and at most this many bytes), so a log without a gate for hours still
# gets every fact.
FACTS_MAX_AGE_S = 24 * 3600.0
FACTS_MAX_BYTES = 1 << 30
FACTS_MAX_MSG_BYTES = FACT_MAX_BYTES
# Refusals: what the operator reads, bounded in count, bytes and age (the oldest go first).
REFUSED_MAX_MSGS = 10_000
REFUSED_MAX_BYTES = 16 << 20
REFUSED_MAX_AGE_S = 7 * 24 * 3600.0
# Longer than the gate's longest decision (a fold's catch-up, an append, the ack): a fact is given
# again only when its gate died, never while it is still being decided.
GATE_ACK_WAIT_S = 30.0
# A node's heartbeat is a few hundred bytes; the bucket refuses one over this.
HEARTBEAT_MAX_VALUE_BYTES = 4 * 1024


async def ensure(js: JetStreamContext, *, replicas: int, may_create: bool, start_new_history: bool = False) -> None:
    """Create or update every stream and bucket of docs/architecture.md §2. Safe to call any number of times.

    A user who may not create streams (any role but admin) only checks that they exist. The
    event stream is never created anew where the rest of a deployment exists (the request
    stream or any bucket): its history was lost (deleted, or a wrong store) and an operator
    must decide; `start_new_history=True` (`ndif up --new-history`) is that decision.
    """
    if not may_create:
        for name in (EVENTS_STREAM, REQUESTS_STREAM):
            await _stream_info_or_fail(js, name)
        # A log made before the fact gate takes agents' facts unchecked (straight in, or sourced
        # from the facts stream): no role but an admin may migrate it, and none works on it unmigrated.
        if not _gated((await js.stream_info(EVENTS_STREAM)).config):
            raise InfrastructureError(f"the log {EVENTS_STREAM} predates the fact gate (it takes agents' facts "
                                      "unchecked): an admin migrates it with `ndif up`, then start this again")
        return
    if not start_new_history:
        await _refuse_lost_history(js)
    # The facts stream first: one made before the gate holds the fact subjects the log takes now.
    # Facts already in it were sourced into the log (or belong to a dropped history): the gate
    # starts after them. Meanwhile an agent's fact may find no stream (no responders, an
    # InfrastructureError): the agent retries it (dataplane/node/agent.py `_append`), the
    # dispatcher too (its follower's `_append`).
    gate_from = await _gate_start(js, start_new_history)
    await ensure_stream(js, facts_config(replicas))
    await ensure_stream(js, events_config(replicas))
    await ensure_stream(js, refused_config(replicas))
    await _ensure_gate_consumer(js, gate_from)
    await ensure_stream(js, api.StreamConfig(
        name=REQUESTS_STREAM, subjects=[REQUESTS_ALL], retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE, num_replicas=replicas, duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=REQUEST_MAX_MSG_BYTES,
        # A user's request is stored under its partition (`ndif.req.<mtok>.<user>.<k>`), which has a
        # consumer of its own: no user's request is read after a burst of another partition's.
        subject_transform=api.SubjectTransform(src=REQUESTS_TRANSFORM_SRC, dest=REQUESTS_TRANSFORM_DEST),
        description="ndif user requests, durable consumers per model and user partition (decision 49)",
    ))
    # Direct gets: a node's agent reads its own key's last heartbeat with one (the key is in the
    # API subject, so its permission is that key only).
    await _ensure_bucket(js, js.create_key_value, js.key_value, HEARTBEATS_BUCKET,
                         api.KeyValueConfig(bucket=HEARTBEATS_BUCKET, ttl=HEARTBEAT_TTL_S,
                                            replicas=replicas, storage=api.StorageType.FILE, direct=True,
                                            max_value_size=HEARTBEAT_MAX_VALUE_BYTES))
    info = await js.stream_info(f"KV_{HEARTBEATS_BUCKET}")
    # No rollups: nats-py makes every bucket with them allowed, and an agent's put on its own key with
    # `Nats-Rollup: all` would erase every other node's heartbeat (the server checks the subject,
    # never the headers). Nothing here purges a heartbeat: a goodbye is an empty beat.
    if (not info.config.allow_direct or info.config.allow_rollup_hdrs  # also a bucket made by an earlier version
            or info.config.max_msg_size != HEARTBEAT_MAX_VALUE_BYTES):
        info.config.allow_direct = True
        info.config.allow_rollup_hdrs = False
        info.config.max_msg_size = HEARTBEAT_MAX_VALUE_BYTES
        await js.update_stream(info.config)
        logger.info("stream_updated", stream=f"KV_{HEARTBEATS_BUCKET}", allow_direct=True, allow_rollup_hdrs=False)
    # A request's status, as it is stored, is republished by the server on its status subject:
    # the terminal one (kept once, by compare-and-set) reaches the client the moment it is kept,
    # and only if it was (a losing write is never seen).
    status_republish = api.RePublish(src=f"$KV.{REQUEST_STATUS_BUCKET}.>", dest=f"{STATUS_PREFIX}.>")
    await _ensure_bucket(js, js.create_key_value, js.key_value, REQUEST_STATUS_BUCKET,
                         api.KeyValueConfig(bucket=REQUEST_STATUS_BUCKET, ttl=REQUEST_STATUS_TTL_S,
                                            replicas=replicas, storage=api.StorageType.FILE,
                                            republish=status_republish, direct=True,
                                            max_value_size=STATUS_MAX_VALUE_BYTES))
    info = await js.stream_info(f"KV_{REQUEST_STATUS_BUCKET}")
    # Direct gets name the key in the API subject, so a client's permission can be its own keys
    # only (controlplane/ops/auth.py); a stored get names it in the body, which permissions cannot see.
    if (info.config.republish is None or info.config.republish.dest != status_republish.dest
            or not info.config.allow_direct):
        info.config.republish = status_republish  # a bucket made by an earlier version
        info.config.allow_direct = True
        await js.update_stream(info.config)
        logger.info("stream_updated", stream=f"KV_{REQUEST_STATUS_BUCKET}", republish=status_republish.dest)
    for bucket in (RESULTS_BUCKET, SNAPSHOTS_BUCKET):
        await _ensure_bucket(js, js.create_object_store, js.object_store, bucket,
                             api.ObjectStoreConfig(bucket=bucket, replicas=replicas,
                                                   storage=api.StorageType.FILE))


async def _gate_start(js: JetStreamContext, start_new_history: bool) -> int | None:
    """Where the gate consumer starts in the facts stream when it is made now: after the facts already
    there when the log existed before the gate (it sourced them) or is made anew (`--new-history`:
    they belong to the history dropped, and a consumer of the old history is made again); None: from
    the first (a new store), or the consumer exists and keeps its place."""
    unknown = (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError)
    try:
        facts_last = int((await js.stream_info(FACTS_STREAM)).state.last_seq)
    except unknown:
        return None
    try:
        log: api.StreamConfig | None = (await js.stream_info(EVENTS_STREAM)).config
    except nats.js.errors.NotFoundError:
        log = None
    except unknown:
        return None
    if log is None and start_new_history:
        with contextlib.suppress(*unknown):
            await js.delete_consumer(FACTS_STREAM, FACT_GATE_CONSUMER)
        return facts_last + 1
    with contextlib.suppress(*unknown):
        await js.consumer_info(FACTS_STREAM, FACT_GATE_CONSUMER)
        return None
    return facts_last + 1 if log is not None and not _gated(log) else None


def _gated(cfg: api.StreamConfig) -> bool:
    """Whether a log takes observed facts from the gate alone: it sources nothing, and the facts
    stream no longer holds the fact subjects (it captures every fact subject itself)."""
    return not cfg.sources and all(s in (cfg.subjects or []) for s in FACT_LOG_SUBJECTS)


async def _ensure_gate_consumer(js: JetStreamContext, start: int | None) -> None:
    """The gate's durable consumer of the facts stream, from `start` (None: the first fact)."""
    cfg = api.ConsumerConfig(
        durable_name=FACT_GATE_CONSUMER, ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=1,
        ack_wait=GATE_ACK_WAIT_S, max_deliver=-1, inactive_threshold=None,
        deliver_policy=api.DeliverPolicy.ALL if start is None else api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start, description=f"the controller's fact gate into {EVENTS_STREAM}")
    try:
        await js.consumer_info(FACTS_STREAM, FACT_GATE_CONSUMER)
    except nats.js.errors.NotFoundError:
        with contextlib.suppress(nats.js.errors.BadRequestError):  # made by a racing peer
            await js.add_consumer(FACTS_STREAM, cfg)
            logger.info("consumer_created", stream=FACTS_STREAM, consumer=FACT_GATE_CONSUMER, start=start)


def events_config(replicas: int) -> api.StreamConfig:
    """The log: the controller's subjects and the fact subjects (only the fact gate publishes there)."""
    return api.StreamConfig(
        name=EVENTS_STREAM, subjects=list(LOG_SUBJECTS), retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, num_replicas=replicas, deny_delete=True, deny_purge=True,
        allow_atomic=True, allow_direct=True, duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=EVENT_MAX_MSG_BYTES,
        description="ndif control-plane events: the only source of truth (docs/architecture.md §2-3)",
    )


def refused_config(replicas: int) -> api.StreamConfig:
    """The gate's refusals: bounded, the oldest dropped first, never part of the log."""
    return api.StreamConfig(
        name=REFUSED_STREAM, subjects=[f"{REFUSED_PREFIX}.*.*"], retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, num_replicas=replicas, allow_direct=True, discard=api.DiscardPolicy.OLD,
        max_msgs=REFUSED_MAX_MSGS, max_bytes=REFUSED_MAX_BYTES, max_age=REFUSED_MAX_AGE_S, max_msg_size=4096,
        description=f"observed facts the fact gate kept out of {EVENTS_STREAM}, and why",
    )


def facts_config(replicas: int) -> api.StreamConfig:
    """Agents' and dispatchers' observed facts as they send them, for the gate: no atomic batches."""
    return api.StreamConfig(
        name=FACTS_STREAM, subjects=list(FACTS_SUBJECTS), retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, num_replicas=replicas, deny_delete=True, deny_purge=True,
        allow_atomic=False, allow_direct=True, duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=FACTS_MAX_MSG_BYTES, max_age=FACTS_MAX_AGE_S, max_bytes=FACTS_MAX_BYTES,
        description=f"ndif observed facts of agents and dispatchers, on their way into {EVENTS_STREAM}",
    )


async def _stream_info_or_fail(js: JetStreamContext, name: str) -> None:
    try:
        await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        raise InfrastructureError(f"stream {name} does not exist and this user may not create it: an admin "
                                  "creates it (`ndif up`)") from None
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        raise InfrastructureError(f"JetStream is not answering ({type(exc).__name__}): is the server "
                                  "running with -js?") from None


async def _refuse_lost_history(js: JetStreamContext) -> None:
    """Raise when the event stream is missing but the rest of a deployment exists."""
    try:
        await js.stream_info(EVENTS_STREAM)
        return
    except nats.js.errors.NotFoundError:
        pass
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return  # reported by ensure_stream
    others = [FACTS_STREAM, REQUESTS_STREAM, f"KV_{HEARTBEATS_BUCKET}", f"KV_{REQUEST_STATUS_BUCKET}",
              f"OBJ_{RESULTS_BUCKET}", f"OBJ_{SNAPSHOTS_BUCKET}"]
    found = []
    for name in others:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.stream_info(name)
            found.append(name)
    if found:
        logger.error("event_stream_missing", existing=found)
        raise InfrastructureError(
            f"stream {EVENTS_STREAM} is missing but {', '.join(found)} exist: the event history was deleted "
            "or this is the wrong store. Not starting an empty history: restore the stream, or, to start "
            "a new one on purpose, run `ndif up --new-history`", retryable=False)


async def ensure_stream(js: JetStreamContext, cfg: api.StreamConfig) -> None:
    assert cfg.name is not None
    try:
        info = await js.stream_info(cfg.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(cfg)
        logger.info("stream_created", stream=cfg.name)
        return
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
        raise InfrastructureError(f"JetStream is not answering ({type(exc).__name__}): is the server "
                                  "running with -js?") from None
    have = info.config
    flags = ("deny_delete", "deny_purge", "allow_atomic", "allow_direct")
    if (sorted(have.subjects or []) != sorted(cfg.subjects or []) or have.retention != cfg.retention
            or any(bool(getattr(have, f)) != bool(getattr(cfg, f)) for f in flags)
            or _sources(have) != _sources(cfg)  # a log made before the facts stream
            or _transform(have) != _transform(cfg)  # a request stream made before its partitions
            or (cfg.max_age or 0) != (have.max_age or 0) or (cfg.max_bytes or -1) != (have.max_bytes or -1)
            or (cfg.max_msg_size or -1) != (have.max_msg_size or -1)):  # a stream made without the limit
        cfg = dataclasses.replace(cfg, num_replicas=have.num_replicas)  # an update never changes the copies
        await js.update_stream(cfg)
        logger.info("stream_updated", stream=cfg.name)


def _sources(cfg: api.StreamConfig) -> list[str]:
    return sorted(src.name for src in cfg.sources or [])


def _transform(cfg: api.StreamConfig) -> tuple[str | None, str | None] | None:
    t = cfg.subject_transform
    return None if t is None else (t.src, t.dest)


async def _ensure_bucket(js: JetStreamContext, create: Any, bind: Any, bucket: str, cfg: Any) -> None:
    try:
        await bind(bucket)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
        with contextlib.suppress(nats.js.errors.BadRequestError):  # created by a racing peer
            await create(config=cfg) if create == js.create_key_value else await create(bucket, config=cfg)
            logger.info("bucket_created", bucket=bucket)


async def last_seq(js: JetStreamContext, timeout: float) -> int:
    """Sequence of the last stored event (0 when empty). `timeout`: the wait `js` was made with, for the error."""
    try:
        info = await js.stream_info(EVENTS_STREAM)
    except nats.errors.TimeoutError:
        raise InfrastructureTimeout(f"stream_info({EVENTS_STREAM}) timed out after {timeout}s") from None
    except nats.js.errors.NotFoundError:
        raise InfrastructureError(f"stream {EVENTS_STREAM} does not exist: run `ndif up` or ensure()") from None
    return int(info.state.last_seq)
