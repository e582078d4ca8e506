"""Connecting to NATS: `connect()`, the client with a faster header parser, and the message size limits.

The rest of the package (topology, appends, feed, snapshots) works on a connection made here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from controlplane.store.credentials import Creds
from controlplane.store.direct import STATUS_LINE
from schemas.errors import InfrastructureError, InvalidCommand, QuotaExceeded
from schemas.events import MAX_EVENT_BYTES
from schemas.requests import MAX_STATUS_BYTES

logger = structlog.get_logger("ndif.eventstore")

# Message size limits per stream (the server's own limit, max_payload, is 2 MiB: nats_server.py).
# An event is a few hundred bytes (a failure's error text is cut at 500 characters); a request body is
# at most MAX_REQUEST_BYTES (1 MiB) and gets headers' room; a kept status holds a result of at most
# INLINE_RESULT_BYTES (256 KiB) inline. Anything larger is refused by JetStream at the publish.
# The readers refuse the same sizes (schemas/guard.py).
EVENT_MAX_MSG_BYTES = MAX_EVENT_BYTES
REQUEST_MAX_MSG_BYTES = (1 << 20) + 64 * 1024
STATUS_MAX_VALUE_BYTES = MAX_STATUS_BYTES


def stream_seq(msg: Msg) -> int:
    """Stream sequence of a delivered JetStream message, from its reply subject (v1 or v2 form)."""
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


RawHandler = Callable[[bytes | None, bytes], None]  # (the header block as received, or None; the payload)


_VERSION_LEN = len(STATUS_LINE) - 1  # `NATS/1.0`


class NdifNatsClient(NatsClient):
    """nats-py's client with four changes: `flush()` keeps its promise, a faster header-line parser,
    raw subscriptions (`subscribe_raw`) for reads of thousands of messages, and a status only
    where the server wrote one (`_process_headers`).

    `flush()` promises that what the client sent before it has reached the server when it returns.
    nats-py 2.16 writes the flush's PING straight to the socket while commands still wait in its
    buffer, so the PONG can come back before the server has seen a SUB made just before: a
    subscription "in place" after `flush()` then missed messages published at once from another
    connection (the role-matrix test lost about one row in twelve). `_send_ping` here writes the
    waiting commands first, so the PING follows them (tests/integration/test_flush_order.py).

    Upstream checks header names with `any(c.isspace() for c in key)`, a generator step per
    character of every header of every message: in a rebuild it was the largest single cost
    (about 40% of profiled time). `key.split() != [key]` is the same test done in C (an empty key
    passes both); tests/unit/test_header_parser.py checks equivalence against upstream.

    Each message of a subscription costs nats-py a header dict, a `Msg`, a queue put and get and a
    callback coroutine: about 27 us, most of a batched direct read's time (a 5,000-event tail read
    in 120-150 ms). A raw subscription's messages go from the parser straight to a plain function
    of the header block and the payload, which reads only what it needs (controlplane/store/direct.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self._raw_subs: dict[int, RawHandler] = {}

    async def subscribe_raw(self, subject: str, on_msg: RawHandler) -> Subscription:
        """A subscription whose messages are given to `on_msg(headers, payload)` as they are parsed:
        no header parsing, `Msg`, queue or task per message. `on_msg` runs inside the connection's
        read loop, so it must neither block nor raise. Ended by the subscription's `unsubscribe()`."""
        sub = await self.subscribe(subject)
        self._raw_subs[sub._id] = on_msg
        return sub

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._raw_subs.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        on_msg = self._raw_subs.get(sid)
        if on_msg is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        on_msg(headers or None, data)

    async def _process_headers(self, headers: bytes) -> dict[str, str] | None:  # type: ignore[override]
        """Only the server's own status line is a status. Upstream reads a status code after any
        first 8 bytes; a publisher may store a message whose header block begins `NATS/1.1 204` or
        `EVIL/1.0 409` (the server keeps such a line as it is, stripping only an exact `NATS/1.0
        <code>`), or a header line `Status: 100`, and every reader of it would take the message for
        an end of batch, a heartbeat or a deleted consumer. Such a first line is dropped here (the
        lines after it are the headers), and so is a `Status` header the server did not write."""
        if not headers:
            return await super()._process_headers(headers)
        if headers.startswith(STATUS_LINE):
            return await super()._process_headers(headers)  # the server's
        if headers[_VERSION_LEN:_VERSION_LEN + 1] != b"\r":
            i = headers.find(b"\r\n")
            headers = b"NATS/1.0" + (headers[i:] if i >= 0 else b"\r\n\r\n")
        hdr = await super()._process_headers(headers)
        if hdr and "Status" in hdr:
            # A publisher's own `Status` header: nats-py would take it for the server's (with
            # `Description: Idle Heartbeat` and no payload, a JetStream consumer skips the
            # message as a heartbeat and an ordered one resets onto it again and again).
            del hdr["Status"]
        return hdr or None

    async def _send_ping(self, future: Any = None) -> None:
        if self._transport is not None and self._pending_data_size > 0 and self.is_connected:
            # as the flusher does (no await in between, so nothing is written twice)
            self._transport.writelines(self._pending[:])
            self._pending = []
            self._pending_data_size = 0
        await super()._send_ping(future)

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

    `creds`: the user of a role (controlplane/ops/auth.py); its own inbox prefix keeps its replies
    private. None connects without a user (an open server).
    """

    connecting = True
    refused: list[str] = []
    full: list[str] = []  # the account holds all the connections it may (AccountLimits)

    async def error_cb(err: Exception) -> None:
        if "authorization violation" in str(err).lower():
            refused.append(str(err))
        if "maximum account active connections" in str(err).lower():
            full.append(str(err))
        if connecting:
            logger.debug("nats_connect_attempt_failed", url=url, error=str(err) or type(err).__name__)
        elif isinstance(err, nats.errors.SlowConsumerError):
            logger.error("nats_slow_consumer", subject=err.subject, sid=err.sid)
        else:
            logger.warning("nats_error", connection=name, error=str(err) or type(err).__name__)

    async def disconnected_cb() -> None:
        if not (nc.is_closed or nc.is_draining):
            logger.warning("nats_disconnected", url=url)

    async def reconnected_cb() -> None:
        logger.info("nats_reconnected", url=url)

    nc = NdifNatsClient()
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
        if full:
            who, limit = ((f"{creds.user}'s account", f"NDIF_{creds.role.upper()}_MAX_CONNECTIONS") if creds
                          else ("this account", "its account's max_connections"))
            raise QuotaExceeded(
                f"NATS at {url} refused a connection: {who} holds as many connections as it may (the "
                f"operator's {limit}); close another of its clients, or ask the operator for more") from None
        if refused:
            raise InfrastructureError(
                (f"NATS at {url} refused the credentials of {creds.user}: " if creds else
                 f"NATS at {url} requires a user and none was found (no NDIF_CREDS, none under $NDIF_HOME/auth/): ")
                + "use the files `ndif up` wrote under $NDIF_HOME/auth/ or set NDIF_CREDS") from None
        raise InfrastructureError(
            f"cannot reach NATS at {url} ({exc or type(exc).__name__}): start one with `ndif up` "
            "or pass --nats URL / set NDIF_NATS_URL"
        ) from None
