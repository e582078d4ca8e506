"""Streams and buckets of docs/architecture.md §2: create or update them (`ensure`), check they exist,
read the event stream's last sequence (`last_seq`).

The log is one stream, NDIF_EVENTS: the controller's decisions are appended to it, and it sources
every observed fact from NDIF_FACTS, where agents and the dispatcher append them (no atomic
batches there: an agent's open batches never count against the log's).

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
from schemas.subjects import (
    EVENTS_STREAM,
    FACTS_STREAM,
    FACTS_SUBJECTS,
    HEARTBEATS_BUCKET,
    LOG_SUBJECTS,
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
# A fact lives on in the log once sourced (within milliseconds); the facts stream keeps it a day
# (and at most this many bytes), so a log without a leader for hours still gets every fact.
FACTS_MAX_AGE_S = 24 * 3600.0
FACTS_MAX_BYTES = 1 << 30
# The source adds a `Nats-Stream-Source` header (the stream, the sequence, the subject: a subject is
# under the server's 4 KiB control line) to every fact it copies into the log, and the log refuses a
# message over its `max_msg_size`. A fact the facts stream took but the log cannot would stop the
# source at it for good, and every later fact of every node with it: so the facts stream takes
# nothing that the header would push over the log's limit.
SOURCE_HEADER_ROOM = 8 * 1024
FACTS_MAX_MSG_BYTES = EVENT_MAX_MSG_BYTES - SOURCE_HEADER_ROOM


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
        # A log made before the facts stream takes agents' facts straight in, atomic batches and
        # all (60 open batches held the controller's appends back): no role but an admin may
        # migrate it, and none works on it unmigrated (decision 48).
        if FACTS_STREAM not in _sources((await js.stream_info(EVENTS_STREAM)).config):
            raise InfrastructureError(f"the log {EVENTS_STREAM} predates {FACTS_STREAM} (it takes agents' facts "
                                      "straight in): an admin migrates it with `ndif up`, then start this again")
        return
    if not start_new_history:
        await _refuse_lost_history(js)
    # The log first: a log made before the facts stream captured every event subject, and the
    # facts stream's subjects may not overlap it. Between the two calls an agent's fact finds no
    # stream (no responders, an InfrastructureError): the agent retries it
    # (dataplane/node/agent.py `_append`), the dispatcher too (its follower's `_append`).
    await ensure_stream(js, events_config(replicas, await _new_log_start(js)))
    await ensure_stream(js, facts_config(replicas))
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
                                            replicas=replicas, storage=api.StorageType.FILE, direct=True))
    info = await js.stream_info(f"KV_{HEARTBEATS_BUCKET}")
    # No rollups: nats-py makes every bucket with them allowed, and an agent's put on its own key with
    # `Nats-Rollup: all` would erase every other node's heartbeat (the server checks the subject,
    # never the headers). Nothing here purges a heartbeat: a goodbye is an empty beat.
    if not info.config.allow_direct or info.config.allow_rollup_hdrs:  # also a bucket made by an earlier version
        info.config.allow_direct = True
        info.config.allow_rollup_hdrs = False
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


async def _new_log_start(js: JetStreamContext) -> int | None:
    """Where a log made anew (`--new-history`) starts sourcing facts: after the facts already in the
    facts stream, which belong to the history that was dropped (None: the log exists, or no facts)."""
    unknown = (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError)
    try:
        await js.stream_info(EVENTS_STREAM)
        return None
    except nats.js.errors.NotFoundError:
        pass
    except unknown:
        return None  # reported by ensure_stream
    try:
        return int((await js.stream_info(FACTS_STREAM)).state.last_seq) + 1
    except unknown:
        return None


def events_config(replicas: int, facts_from: int | None = None) -> api.StreamConfig:
    """The log: the controller's subjects, and every fact sourced from the facts stream (from
    its sequence `facts_from` on, when given)."""
    return api.StreamConfig(
        name=EVENTS_STREAM, subjects=list(LOG_SUBJECTS), retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, num_replicas=replicas, deny_delete=True, deny_purge=True,
        allow_atomic=True, allow_direct=True, duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=EVENT_MAX_MSG_BYTES, sources=[api.StreamSource(name=FACTS_STREAM, opt_start_seq=facts_from)],
        description="ndif control-plane events: the only source of truth (docs/architecture.md §2-3)",
    )


def facts_config(replicas: int) -> api.StreamConfig:
    """Agents' and dispatchers' observed facts on their way into the log: no atomic batches."""
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
