"""The JetStream adapter: streams and buckets of docs/architecture.md §2, guarded appends, reads, live follow.

Appends (docs/architecture.md §5, pitfalls §10):
- one event: an awaited request with `Nats-Expected-Last-Sequence` (never `publish_async`, which
  swallows error acks);
- several: one atomic batch (`Nats-Batch-Id/-Sequence/-Commit`), the expectation on message 1;
- an ambiguous answer (timeout, 10071 "wrong last sequence", 10201 "batch holds a duplicate id")
  is resolved by reading the log at expected+1 before anything is called a conflict.
Reads use an ordered push consumer; followers check that sequences are contiguous and resubscribe
from the last applied one on a gap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api

from controlplane.auth import Creds, resolve
from controlplane.direct import MAX_BATCH, direct_batch
from controlplane.ports import AppendResult, Stored
from schemas.errors import ConflictError, InfrastructureError, InfrastructureTimeout, InvalidCommand
from schemas.events import (
    Event,
    Skipped,
    check_batch,
    decode_or_skip,
    encode_event,
    event_headers,
    event_subject,
    event_tag,
    subject_problem,
)
from schemas.subjects import (
    EVENTS_ALL,
    EVENTS_STREAM,
    HDR_MSG_ID,
    HEARTBEATS_BUCKET,
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    SNAPSHOTS_BUCKET,
    STATUS_PREFIX,
)

log = structlog.get_logger("ndif.eventstore")

ERR_WRONG_LAST_SEQ = 10071
ERR_BATCH_TOO_LARGE = 10199
ERR_BATCH_DUPLICATE = 10201
_LAST_SEQ_RE = re.compile(r"wrong last sequence: (\d+)")

HEARTBEAT_TTL_S = 15.0
REQUEST_STATUS_TTL_S = 24 * 3600.0
DUPLICATE_WINDOW_S = 120.0
# Message size limits per stream (the server's own limit, max_payload, is 2 MiB: nats_server.py).
# An event is a few hundred bytes (a failure's error text is cut at 500 characters); a request body is
# at most MAX_REQUEST_BYTES (1 MiB) and gets headers' room; a kept status holds a result of at most
# INLINE_RESULT_BYTES (256 KiB) inline. Anything larger is refused by JetStream at the publish.
EVENT_MAX_MSG_BYTES = 64 * 1024
REQUEST_MAX_MSG_BYTES = (1 << 20) + 64 * 1024
STATUS_MAX_VALUE_BYTES = 512 * 1024
_PENDING_MSGS = 1_000_000
_PENDING_BYTES = 1 << 30
CLOSE_TIMEOUT_S = 10.0  # drain (5 s, connect()'s drain_timeout) plus its final flush and socket close


class _ApiErr(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    count: int = 0
    error: _ApiErr | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


def stream_seq(msg: Msg) -> int:
    """Stream sequence of a delivered JetStream message, from its reply subject (v1 or v2 form)."""
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


class FastHeaderClient(NatsClient):
    """nats-py's client with an equivalent, faster header-line parser.

    Upstream checks header names with `any(c.isspace() for c in key)`, a generator step per
    character of every header of every message: in a rebuild it was the largest single cost
    (about 40% of profiled time). `key.split() != [key]` is the same test done in C (an empty key
    passes both); tests/unit/test_header_parser.py checks equivalence against upstream.
    """

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        if raw.isascii():  # the usual case: one decode, then str operations
            for line in raw.decode("ascii").split("\r\n"):
                name, sep, value = line.partition(":")
                if not sep:
                    continue
                key = name.strip(_BYTES_WS)
                if key and key.split() != [key]:  # any whitespace in the name
                    continue
                out[key] = value.strip(_BYTES_WS)
            return out
        for bline in raw.split(b"\r\n"):
            bname, bsep, bvalue = bline.partition(b":")
            if not bsep:
                continue
            try:
                key = bname.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if key and key.split() != [key]:
                continue
            out[key] = bvalue.strip().decode("utf-8", "replace")
        return out


# What `bytes.strip()` removes; `str.strip()` would also remove \x1c-\x1f.
_BYTES_WS = " \t\n\r\x0b\x0c"


def stream_replicas_default() -> int:
    """NDIF_STREAM_REPLICAS (1-5), else 1."""
    raw = os.environ.get("NDIF_STREAM_REPLICAS", "1")
    try:
        n = int(raw)
    except ValueError:
        raise InvalidCommand(f"NDIF_STREAM_REPLICAS is {raw!r}: give 1, 3 or 5") from None
    if not 1 <= n <= 5:
        raise InvalidCommand(f"NDIF_STREAM_REPLICAS is {n}: JetStream keeps 1 to 5 copies")
    return n


async def connect(url: str, *, name: str = "ndif", timeout: float = 5.0, creds: Creds | None = None) -> NatsClient:
    """A NATS connection with the settings §10 asks for: endless reconnects, loud slow consumers.

    `creds`: the user of a role (controlplane/auth.py); its own inbox prefix keeps its replies
    private. None connects without a user (an open server).
    """

    connecting = True
    refused: list[str] = []

    async def error_cb(err: Exception) -> None:
        if "authorization violation" in str(err).lower():
            refused.append(str(err))
        if connecting:
            log.debug("nats_connect_attempt_failed", url=url, error=str(err) or type(err).__name__)
        elif isinstance(err, nats.errors.SlowConsumerError):
            log.error("nats_slow_consumer", subject=err.subject, sid=err.sid)
        else:
            log.warning("nats_error", connection=name, error=str(err) or type(err).__name__)

    async def disconnected_cb() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats_disconnected", url=url)

    async def reconnected_cb() -> None:
        log.info("nats_reconnected", url=url)

    nc = FastHeaderClient()
    try:
        servers: str | list[str] = [u.strip() for u in url.split(",") if u.strip()] if "," in url else url
        await nc.connect(
            servers, name=name, connect_timeout=timeout, reconnect_time_wait=0.5,  # type: ignore[arg-type]
            error_cb=error_cb, disconnected_cb=disconnected_cb, reconnected_cb=reconnected_cb,
            allow_reconnect=True, drain_timeout=5,
            # The first connect gives up after a few tries (a wrong URL is an error to report);
            # once connected, reconnects never stop (docs/architecture.md §10).
            max_reconnect_attempts=2,
            **(creds.connect_options() if creds is not None else {}),
        )
        nc.options["max_reconnect_attempts"] = -1
        connecting = False
        return nc
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        if refused:
            raise InfrastructureError(
                f"NATS at {url} refused the credentials of {creds.user if creds else 'no user'}: "
                "use the files `ndif up` wrote under $NDIF_HOME/auth/ or set NDIF_CREDS") from None
        raise InfrastructureError(
            f"cannot reach NATS at {url} ({exc or type(exc).__name__}): start one with `ndif up` "
            "or pass --nats URL / set NDIF_NATS_URL"
        ) from None


# Roles whose users may create no consumer (controlplane/auth.py): they read the log by direct gets.
DIRECT_READ_ROLES = frozenset({"dashboard", "agent"})


class JetStreamEventLog:
    """`EventLog` and `SnapshotStore` on JetStream. One object per connection.

    ``async with await JetStreamEventLog.open(url) as log: ...`` owns its connection;
    ``JetStreamEventLog(nc)`` borrows one.
    """

    def __init__(self, nc: NatsClient, *, timeout: float = 5.0, replicas: int | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=timeout)
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
        # Read with batched direct gets instead of an ordered consumer (controlplane/direct.py):
        # for roles that may create no consumer (DIRECT_READ_ROLES), since a consumer's deliver
        # subject is beyond what subject permissions can restrict.
        self.direct_reads = False
        self.direct_poll_s = 0.5  # a direct-read follower asks again this often without a wake-up

    @classmethod
    async def open(cls, url: str, *, timeout: float = 5.0, replicas: int | None = None, ensure: bool = True,
                   name: str = "ndif", creds: Creds | None = None, role: str = "admin",
                   node_id: str = "") -> JetStreamEventLog:
        """Connect as `creds`, or as the local user of `role` (auth.resolve: NDIF_CREDS, $NDIF_HOME/auth/)."""
        if creds is None:
            creds = resolve(role, url=url, node_id=node_id)
        self = cls(await connect(url, name=name, timeout=timeout, creds=creds), timeout=timeout, replicas=replicas)
        self._owns_nc = True
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
        if not self._owns_nc or self.nc.is_closed:
            return
        step = asyncio.ensure_future(self.nc.drain() if not self.nc.is_reconnecting else self.nc.close())
        done, _ = await asyncio.wait([step], timeout=CLOSE_TIMEOUT_S)
        if not done:
            step.cancel()  # not awaited: nats-py's drain swallows cancellation
            log.warning("nats_close_timed_out", seconds=CLOSE_TIMEOUT_S)
        elif not step.cancelled() and (err := step.exception()) is not None:
            log.warning("nats_drain_failed", error=str(err) or type(err).__name__)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> JetStreamEventLog:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ---- setup -------------------------------------------------------------------------------

    async def ensure(self, *, start_new_history: bool = False) -> None:
        """Create or update every stream and bucket of docs/architecture.md §2. Safe to call any number of times.

        A user who may not create streams (any role but admin) only checks that they exist. The
        event stream is never created anew where the rest of a deployment exists (the request
        stream or any bucket): its history was lost (deleted, or a wrong store) and an operator
        must decide; `start_new_history=True` (`ndif up --new-history`) is that decision.
        """
        if not self.may_create:
            for name in (EVENTS_STREAM, REQUESTS_STREAM):
                await self._stream_info_or_fail(name)
            return
        if not start_new_history:
            await self._refuse_lost_history()
        await self._ensure_stream(api.StreamConfig(
            name=EVENTS_STREAM, subjects=[EVENTS_ALL], retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE, num_replicas=self.replicas, deny_delete=True, deny_purge=True,
            allow_atomic=True, allow_direct=True, duplicate_window=DUPLICATE_WINDOW_S,
            max_msg_size=EVENT_MAX_MSG_BYTES,
            description="ndif control-plane events: the only source of truth (docs/architecture.md §2-3)",
        ))
        await self._ensure_stream(api.StreamConfig(
            name=REQUESTS_STREAM, subjects=[REQUESTS_ALL], retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE, num_replicas=self.replicas, duplicate_window=DUPLICATE_WINDOW_S,
            max_msg_size=REQUEST_MAX_MSG_BYTES,
            description="ndif user requests, one durable consumer per model subject",
        ))
        await self._ensure_bucket(self.js.create_key_value, self.js.key_value, HEARTBEATS_BUCKET,
                                  api.KeyValueConfig(bucket=HEARTBEATS_BUCKET, ttl=HEARTBEAT_TTL_S,
                                                     replicas=self.replicas, storage=api.StorageType.FILE))
        # A request's status, as it is stored, is republished by the server on its status subject:
        # the terminal one (kept once, by compare-and-set) reaches the client the moment it is kept,
        # and only if it was (a losing write is never seen).
        status_republish = api.RePublish(src=f"$KV.{REQUEST_STATUS_BUCKET}.>", dest=f"{STATUS_PREFIX}.>")
        await self._ensure_bucket(self.js.create_key_value, self.js.key_value, REQUEST_STATUS_BUCKET,
                                  api.KeyValueConfig(bucket=REQUEST_STATUS_BUCKET, ttl=REQUEST_STATUS_TTL_S,
                                                     replicas=self.replicas, storage=api.StorageType.FILE,
                                                     republish=status_republish, direct=True,
                                                     max_value_size=STATUS_MAX_VALUE_BYTES))
        info = await self.js.stream_info(f"KV_{REQUEST_STATUS_BUCKET}")
        # Direct gets name the key in the API subject, so a client's permission can be its own keys
        # only (controlplane/auth.py); a stored get names it in the body, which permissions cannot see.
        if (info.config.republish is None or info.config.republish.dest != status_republish.dest
                or not info.config.allow_direct):
            info.config.republish = status_republish  # a bucket made by an earlier version
            info.config.allow_direct = True
            await self.js.update_stream(info.config)
            log.info("stream_updated", stream=f"KV_{REQUEST_STATUS_BUCKET}", republish=status_republish.dest)
        for bucket in (RESULTS_BUCKET, SNAPSHOTS_BUCKET):
            await self._ensure_bucket(self.js.create_object_store, self.js.object_store, bucket,
                                      api.ObjectStoreConfig(bucket=bucket, replicas=self.replicas,
                                                            storage=api.StorageType.FILE))

    async def _stream_info_or_fail(self, name: str) -> None:
        try:
            await self.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            raise InfrastructureError(f"stream {name} does not exist and this user may not create it: an admin "
                                      "creates it (`ndif up`)") from None
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise InfrastructureError(f"JetStream is not answering ({type(exc).__name__}): is the server "
                                      "running with -js?") from None

    async def _refuse_lost_history(self) -> None:
        """Raise when the event stream is missing but the rest of a deployment exists."""
        try:
            await self.js.stream_info(EVENTS_STREAM)
            return
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            return  # reported by _ensure_stream
        others = [REQUESTS_STREAM, f"KV_{HEARTBEATS_BUCKET}", f"KV_{REQUEST_STATUS_BUCKET}",
                  f"OBJ_{RESULTS_BUCKET}", f"OBJ_{SNAPSHOTS_BUCKET}"]
        found = []
        for name in others:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.stream_info(name)
                found.append(name)
        if found:
            log.error("event_stream_missing", existing=found)
            raise InfrastructureError(
                f"stream {EVENTS_STREAM} is missing but {', '.join(found)} exist: the event history was deleted "
                "or this is the wrong store. Not starting an empty history: restore the stream, or, to start "
                "a new one on purpose, run `ndif up --new-history`", retryable=False)

    async def _ensure_stream(self, cfg: api.StreamConfig) -> None:
        assert cfg.name is not None
        try:
            info = await self.js.stream_info(cfg.name)
        except nats.js.errors.NotFoundError:
            await self.js.add_stream(cfg)
            log.info("stream_created", stream=cfg.name)
            return
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise InfrastructureError(f"JetStream is not answering ({type(exc).__name__}): is the server "
                                      "running with -js?") from None
        have = info.config
        flags = ("deny_delete", "deny_purge", "allow_atomic", "allow_direct")
        if (sorted(have.subjects or []) != sorted(cfg.subjects or []) or have.retention != cfg.retention
                or any(bool(getattr(have, f)) != bool(getattr(cfg, f)) for f in flags)
                or (cfg.max_msg_size or -1) != (have.max_msg_size or -1)):  # a stream made before the limit
            cfg = dataclasses.replace(cfg, num_replicas=have.num_replicas)  # an update never changes the copies
            await self.js.update_stream(cfg)
            log.info("stream_updated", stream=cfg.name)

    async def _ensure_bucket(self, create: Any, bind: Any, bucket: str, cfg: Any) -> None:
        try:
            await bind(bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            with contextlib.suppress(nats.js.errors.BadRequestError):  # created by a racing peer
                await create(config=cfg) if create == self.js.create_key_value else await create(bucket, config=cfg)
                log.info("bucket_created", bucket=bucket)

    # ---- appends -----------------------------------------------------------------------------

    async def last_seq(self) -> int:
        try:
            info = await self.js.stream_info(EVENTS_STREAM)
        except nats.errors.TimeoutError:
            raise InfrastructureTimeout(f"stream_info({EVENTS_STREAM}) timed out after {self.timeout}s") from None
        except nats.js.errors.NotFoundError:
            raise InfrastructureError(f"stream {EVENTS_STREAM} does not exist: run `ndif up` or ensure()") from None
        return int(info.state.last_seq)

    async def append(self, events: Sequence[Event], expected_last_seq: int | None,
                     *, _resend: bool = False) -> AppendResult:
        check_batch(events)
        n = len(events)
        try:
            if n == 1:
                ack = await self._publish_one(events[0], expected_last_seq)
            else:
                ack = await self._publish_batch(events, expected_last_seq)
        except (TimeoutError, nats.errors.TimeoutError):
            if expected_last_seq is None:
                # Unguarded observed facts: a resend with the same ids is deduplicated by the server.
                if _resend:
                    raise InfrastructureTimeout(
                        f"append of {n} observed events timed out twice; is JetStream up? (`ndif up`)") from None
                return await self.append(events, None, _resend=True)
            # The request may or may not have been stored: find out before answering.
            found = await self._read_back(events, expected_last_seq)
            if found is not None:
                return found
            raise InfrastructureTimeout(
                f"append of {n} events timed out and is not in the log after seq {expected_last_seq}; "
                "retry with the same event ids (a late landing is then reported as already appended)"
            ) from None
        except nats.errors.NoRespondersError:
            raise InfrastructureError(f"no stream answers on ndif.evt.>: create {EVENTS_STREAM} (`ndif up`)") from None
        if ack.error is None:
            if ack.duplicate and expected_last_seq is not None:  # a resend inside the duplicate window
                found = await self._read_back(events, expected_last_seq)
                if found is not None:
                    return found
                return AppendResult(first_seq=ack.seq - n + 1, last_seq=ack.seq, already_appended=True)
            return AppendResult(first_seq=ack.seq - n + 1, last_seq=ack.seq)
        err = ack.error
        if err.err_code in (ERR_WRONG_LAST_SEQ, ERR_BATCH_DUPLICATE) and expected_last_seq is not None:
            found = await self._read_back(events, expected_last_seq)
            if found is not None:
                return found
            m = _LAST_SEQ_RE.search(err.description)
            actual = int(m.group(1)) if m else await self.last_seq()
            raise ConflictError(
                f"log moved: expected last seq {expected_last_seq}, it is {actual}; fold the tail and decide again",
                expected_last_seq=expected_last_seq, actual_last_seq=actual,
            )
        if err.err_code == ERR_BATCH_TOO_LARGE:
            raise InvalidCommand(f"append: batch refused as too large ({err.description})")
        raise InfrastructureError(f"append refused by JetStream: {err.code}/{err.err_code} {err.description}")

    async def _publish_one(self, ev: Event, expected: int | None) -> _PubAck:
        hdr = event_headers(ev)
        if expected is not None:
            hdr["Nats-Expected-Last-Sequence"] = str(expected)
        msg = await self.nc.request(event_subject(ev), encode_event(ev), timeout=self.timeout, headers=hdr)
        return _ack_decoder.decode(msg.data)

    async def _publish_batch(self, events: Sequence[Event], expected: int | None) -> _PubAck:
        batch_id = uuid.uuid4().hex
        last = len(events)
        for i, ev in enumerate(events[:-1], start=1):
            hdr = event_headers(ev)
            hdr["Nats-Batch-Id"] = batch_id
            hdr["Nats-Batch-Sequence"] = str(i)
            if i == 1 and expected is not None:
                hdr["Nats-Expected-Last-Sequence"] = str(expected)
            await self.nc.publish(event_subject(ev), encode_event(ev), headers=hdr)
        ev = events[-1]
        hdr = event_headers(ev)
        hdr.update({"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(last), "Nats-Batch-Commit": "1"})
        msg = await self.nc.request(event_subject(ev), encode_event(ev), timeout=self.timeout, headers=hdr)
        return _ack_decoder.decode(msg.data)

    async def _read_back(self, events: Sequence[Event], expected: int) -> AppendResult | None:
        """Are these event ids stored right after `expected`? (Then a resend or late success.)"""
        n = len(events)
        for offset, ev in ((0, events[0]), (n - 1, events[-1])):
            try:
                raw = await self.js.get_msg(EVENTS_STREAM, expected + 1 + offset, direct=True)
            except (nats.js.errors.NotFoundError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return None
            if not raw.headers or raw.headers.get(HDR_MSG_ID) != ev.event_id:
                return None
            if n == 1:
                break
        log.info("append_already_stored", first_seq=expected + 1, events=n)
        return AppendResult(first_seq=expected + 1, last_seq=expected + n, already_appended=True)

    # ---- reads -------------------------------------------------------------------------------

    async def read(self, start_seq: int = 1, *, start_time: datetime | None = None,
                   stop_seq: int | None = None) -> AsyncIterator[Stored]:
        async for batch in self.read_batches(start_seq, start_time=start_time, stop_seq=stop_seq):
            for pair in batch:
                yield pair

    async def read_batches(self, start_seq: int = 1, *, start_time: datetime | None = None,
                           stop_seq: int | None = None) -> AsyncIterator[list[Stored]]:
        """Like `read`, in lists of whatever arrived together (a fold then loops without awaiting)."""
        stop = await self.last_seq() if stop_seq is None else stop_seq
        if start_time is not None:
            found = await self.seq_at(start_time)
            if found is None:
                return
            start_seq = max(start_seq, found)
        if stop < max(start_seq, 1):
            return
        async for batch in self._feed(start_seq, stop):
            yield batch

    async def follow(self, start_seq: int = 1) -> AsyncIterator[Stored]:
        async for batch in self._feed(start_seq, None):
            for pair in batch:
                yield pair

    def follow_batches(self, start_seq: int = 1) -> AsyncIterator[list[Stored]]:
        return self._feed(start_seq, None)

    async def seq_at(self, when: datetime) -> int | None:
        """Sequence of the first event stored at or after `when` (None if there is none)."""
        req = msgspec.json.encode({"start_time": when.isoformat().replace("+00:00", "Z")})
        try:
            resp = await self.nc.request(f"$JS.API.STREAM.MSG.GET.{EVENTS_STREAM}", req, timeout=self.timeout)
        except nats.errors.TimeoutError:
            raise InfrastructureTimeout("looking up a sequence by time timed out") from None
        body = msgspec.json.decode(resp.data)
        if "error" in body:
            if body["error"].get("code") == 404:
                return None
            raise InfrastructureError(f"looking up a sequence by time: {body['error'].get('description')}")
        return int(body["message"]["seq"])

    async def _feed(self, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
        """Batches of events from `start_seq` to `stop_seq` (or forever): by direct gets or a consumer."""
        feed = self._feed_direct if self.direct_reads else self._feed_consumer
        async for batch in feed(start_seq, stop_seq):
            yield batch

    async def _feed_direct(self, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
        """Batched direct gets (no consumer). Following, it asks again when an event is published on
        `ndif.evt.>` (a core subscription, only a wake-up) or after `direct_poll_s` without one."""
        expected = max(start_seq, 1)
        wake = asyncio.Event()
        woke = False
        sub = None
        if stop_seq is None:
            async def on_event(_: Msg) -> None:
                wake.set()

            with contextlib.suppress(Exception):  # without it (or refused by the server) polling alone
                sub = await self.nc.subscribe(EVENTS_ALL, cb=on_event)
        try:
            while stop_seq is None or expected <= stop_seq:
                want = MAX_BATCH if stop_seq is None else min(MAX_BATCH, stop_seq - expected + 1)
                wake.clear()
                batch: list[Stored] = []
                for m in await direct_batch(self.nc, EVENTS_STREAM, expected, want, timeout=self.timeout):
                    if stop_seq is not None and m.seq > stop_seq:
                        break
                    item = decode_or_skip(m.data)
                    problem = subject_problem(m.subject, item)
                    if problem is not None:
                        item = Skipped(reason=problem, type=event_tag(item))  # type: ignore[arg-type]
                    batch.append((m.seq, item))
                if batch:
                    expected = batch[-1][0] + 1
                    yield batch
                    continue
                if stop_seq is not None:
                    return  # nothing left up to stop_seq
                # Woken but nothing stored yet (the core message can come before the stream has
                # it): look again shortly rather than at the next poll.
                wait, woke = (0.02 if woke else self.direct_poll_s), False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), wait)
                    woke = True
        finally:
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _feed_consumer(self, start_seq: int, stop_seq: int | None) -> AsyncIterator[list[Stored]]:
        """Ordered consumer over the whole stream, from `start_seq` to `stop_seq` (or forever).

        Sequences must be contiguous: on a gap (a client-side drop) or a stall the feed
        resubscribes from the next sequence it wants. Messages are decoded in the delivery callback
        into a deque (nats-py's `next_msg()` costs a future per message and caps a drain near
        30k msg/s here; callbacks run about 3x faster).
        """
        expected = max(start_seq, 1)
        while True:
            buf: collections.deque[Stored | None] = collections.deque()
            ready = asyncio.Event()
            limit = self.pending_msgs_limit
            want = [expected]  # next seq the callback accepts; a mismatch ends this subscription

            async def on_msg(msg: Msg, buf: collections.deque[Stored | None] = buf, ready: asyncio.Event = ready,
                             want: list[int] = want, limit: int = limit) -> None:
                if not msg.reply or want[0] < 0:
                    return  # a control message, or this subscription is being replaced
                seq = stream_seq(msg)
                if seq != want[0]:
                    if seq < want[0]:
                        return  # replay after an ordered-consumer reset
                    log.warning("event_feed_gap", expected=want[0], got=seq)
                    want[0] = -1
                    buf.append(None)  # tells the reader to resubscribe
                elif len(buf) >= limit:  # past the limit drop it: the gap check recovers
                    return
                else:
                    want[0] = seq + 1
                    item = decode_or_skip(msg.data)
                    problem = subject_problem(msg.subject, item)
                    if problem is not None:
                        item = Skipped(reason=problem, type=event_tag(item))  # type: ignore[arg-type]
                    buf.append((seq, item))
                ready.set()

            sub = await self._subscribe(expected, on_msg)
            try:
                while True:
                    if not buf:
                        ready.clear()
                        try:
                            await asyncio.wait_for(ready.wait(), self.stall_check_s)
                        except TimeoutError:
                            # Quiet, or stalled: after a client-side drop the consumer's flow control
                            # can wait forever for a reply that never comes. Ask the stream which.
                            if self.nc.is_closed:
                                raise InfrastructureError("NATS connection closed while following events") from None
                            if await self.last_seq() >= expected:
                                log.warning("event_feed_stalled", expected=expected)
                                break  # resubscribe from `expected`
                        continue
                    batch: list[Stored] = []
                    gap = False
                    while buf:
                        item = buf.popleft()
                        if item is None:
                            gap = True
                            break
                        if stop_seq is not None and item[0] > stop_seq:
                            break
                        batch.append(item)
                    if batch:
                        expected = batch[-1][0] + 1
                        yield batch
                    if stop_seq is not None and expected > stop_seq:
                        return
                    if gap:
                        break  # resubscribe from `expected`
            finally:
                want[0] = -1
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _subscribe(self, start_seq: int, cb: Any) -> Any:
        # An ordered consumer: its flow control keeps the server from flooding us (a plain push
        # consumer measured slower here, ~45k vs ~75k events/s, the client drowning in its input).
        cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
        try:
            return await self.js.subscribe(
                EVENTS_ALL, stream=EVENTS_STREAM, ordered_consumer=True, config=cfg,
                deliver_policy=cfg.deliver_policy, cb=cb, pending_msgs_limit=self.pending_msgs_limit,
                pending_bytes_limit=self.pending_bytes_limit,
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            # A server lost or a leader being elected (a cluster): the follower retries, never dies.
            raise InfrastructureTimeout(f"subscribing to {EVENTS_STREAM} from seq {start_seq} failed: "
                                        f"{type(exc).__name__}; retrying") from None
        except nats.js.errors.APIError as exc:
            raise InfrastructureError(f"subscribing to {EVENTS_STREAM} from seq {start_seq} failed: {exc}") from None

    # ---- snapshots ---------------------------------------------------------------------------

    async def save_snapshot(self, name: str, data: bytes) -> None:
        obs = await self.js.object_store(SNAPSHOTS_BUCKET)
        await obs.put(name, data)

    async def load_snapshot(self, name: str) -> bytes | None:
        obs = await self.js.object_store(SNAPSHOTS_BUCKET)
        try:
            res = await obs.get(name)
        except nats.js.errors.ObjectNotFoundError:
            return None
        return bytes(res.data) if res.data is not None else None
