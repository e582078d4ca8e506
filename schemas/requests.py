"""User requests and their statuses (docs/architecture.md §2, §4): what the SDK publishes and what it is told.

A request is a JSON object on `ndif.req.<mtok>.<user>` (`ndif.req.<mtok>` on an open server) in the
work-queue stream `NDIF_REQUESTS`, with `Nats-Msg-Id` = `<user>.<mac>.<request id>` (the mac keyed
by the client's password, controlplane/ops/auth.py `request_msg_id`, so no one else can take the id
first; the request id alone on an open server; a resend within the dedup window is stored once). Each status change is a `StatusUpdate` on
`ndif.status.<user>.<request id>`; the latest is kept in KV `ndif_request_status` under
`<user>.<request id>`, and a terminal one (COMPLETED or ERROR) is written
there exactly once (compare-and-set), so a client sees exactly one.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import msgspec

from schemas.errors import InvalidCommand, decode_bounded
from schemas.status import RequestStatus

MAX_REQUEST_BYTES = 1 << 20  # larger payloads are refused (ERROR), not queued
INLINE_RESULT_BYTES = 256 * 1024  # larger results go to the `ndif_results` Object Store
# A status holds at most an inline result and its fields: anything larger is not one (the status
# bucket's value limit, controlplane/store/eventstore/connection.py, is 512 KiB).
STATUS_MAX_BYTES = 512 * 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class Request(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    model_key: str
    payload: dict[str, Any]
    submitted_at: datetime
    client: str = ""
    # The owner, set by the dispatcher from the request's subject (`ndif.req.<mtok>.<user>`, which
    # the server lets only that user publish); whatever a body says here is overwritten.
    user: str = ""


class StatusUpdate(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    request_id: str
    status: RequestStatus
    ts: datetime
    model_key: str = ""
    message: str = ""
    queue_position: int | None = None  # QUEUED: 0 = next
    replica_id: int | None = None  # DISPATCHED / RUNNING / COMPLETED: which replica
    result: Any = None  # COMPLETED, when small
    result_ref: str | None = None  # COMPLETED, when large: object name in `ndif_results`
    error: str | None = None  # ERROR: the error class (BadRequest, UnknownModel, ...)
    attempt: int = 1  # > 1 after a redelivery or a replica lost mid-request
    user: str = ""  # the request's owner (its status key is `<user>.<request_id>`)

    @property
    def terminal(self) -> bool:
        return self.status.terminal


_request_decoder = msgspec.json.Decoder(Request)
status_decoder = msgspec.json.Decoder(StatusUpdate)
encoder = msgspec.json.Encoder()


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID.match(request_id):
        raise InvalidCommand(f"request id {request_id!r}: 1-128 characters of [A-Za-z0-9_-]")
    return request_id


def decode_request(data: bytes) -> Request:
    """Decode and check a request body; malformed input is InvalidCommand, never a crash."""
    req = decode_bounded(_request_decoder, data, limit=MAX_REQUEST_BYTES, what="request")
    check_request_id(req.request_id)
    return req


def status_or_none(data: bytes) -> StatusUpdate | None:
    """A status from bytes someone else wrote (a kept KV value, a live message), or None when they are
    not one: malformed, invalid UTF-8 (a ValueError), nested past the parser's depth. Never raises."""
    if len(data) > STATUS_MAX_BYTES:
        return None
    try:
        return status_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
