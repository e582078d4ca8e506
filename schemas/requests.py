"""User requests and their statuses (docs/architecture.md §2, §4): what the SDK publishes and what it is told.

A request is a JSON object on `ndif.req.<mtok>.<user>` (`ndif.req.<mtok>` on an open server) in the
work-queue stream `NDIF_REQUESTS`, with `Nats-Msg-Id` = `<user>.<mac>.<request id>` (the mac keyed
by the client's password, controlplane/store/credentials.py `request_msg_id`, so no one else can take the id
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
from schemas.events import ModelKey, model_key_hook, model_ref
from schemas.guard import Refused, decode_guarded
from schemas.status import RequestStatus

MAX_REQUEST_BYTES = 1 << 20  # larger payloads are refused (ERROR), not queued
MAX_STATUS_BYTES = 512 * 1024  # a status holds a result of at most INLINE_RESULT_BYTES inline
MAX_BATCH_TOKENS = 1 << 16  # a request's input_ids may hold at most this many tokens
MAX_NEW_TOKENS = 1024
OPS = ("forward", "generate", "echo")
INLINE_RESULT_BYTES = 256 * 1024  # larger results go to the `ndif_results` Object Store
# A status holds at most an inline result and its fields: anything larger is not one (the status
# bucket's value limit, controlplane/store/eventstore/connection.py, is 512 KiB).
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class Request(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    model_key: ModelKey  # on the wire an object, as in events (`encode_request`); a string is read too
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
    model_key: ModelKey = ""  # on the wire an object, as in events (`encode_status`); a string is read too
    message: str = ""
    queue_position: int | None = None  # QUEUED: 0 = next
    wait_estimate_s: float | None = None  # QUEUED: seconds until it starts, by recent run times (None: unknown)
    replica_id: int | None = None  # DISPATCHED / RUNNING / COMPLETED: which replica
    result: Any = None  # COMPLETED, when small
    result_ref: str | None = None  # COMPLETED, when large: object name in `ndif_results`
    error: str | None = None  # ERROR: the error class (BadRequest, UnknownModel, ...)
    attempt: int = 1  # > 1 after a redelivery or a replica lost mid-request
    user: str = ""  # the request's owner (its status key is `<user>.<request_id>`)
    limit: int | None = None  # ERROR QueueLimitExceeded: the user's limit of queued requests for the model
    count: int | None = None  # ERROR QueueLimitExceeded: the user's requests queued when it arrived

    @property
    def terminal(self) -> bool:
        return self.status.terminal


_request_decoder = msgspec.json.Decoder(Request, dec_hook=model_key_hook)
_status_decoder = msgspec.json.Decoder(StatusUpdate, dec_hook=model_key_hook)
status_decoder = _status_decoder  # raises on bad bytes: for tests reading what they wrote; services use decode_status
encoder = msgspec.json.Encoder()  # writes a model key as its string: `encode_status` / `encode_request` write the object


def encode_status(u: StatusUpdate) -> bytes:
    """A status as published and kept: `model_key` as the object events carry (`schemas.events.model_ref`),
    a key without that form (not canonical, extra kwargs, none) as the string it is."""
    ref = model_ref(u.model_key) if u.model_key else None
    return encoder.encode(u if ref is None else msgspec.structs.replace(u, model_key=ref))


def encode_request(req: Request) -> bytes:
    """A request as the SDK publishes it: `model_key` as the object events carry (as `encode_status`)."""
    ref = model_ref(req.model_key) if req.model_key else None
    return encoder.encode(req if ref is None else msgspec.structs.replace(req, model_key=ref))


def decode_status(data: bytes) -> StatusUpdate | Refused:
    """A status as published or kept in KV: the update, or `Refused` with the reason. Never raises."""
    return decode_guarded(_status_decoder, data, limit=MAX_STATUS_BYTES, what="status")


def check_request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID.match(request_id):
        raise InvalidCommand(f"request id {request_id!r}: 1-128 characters of [A-Za-z0-9_-]")
    return request_id


def decode_request(data: bytes) -> Request:
    """Decode and check a request body: the request, or InvalidCommand with the reason, whatever the
    bytes (nothing else is raised)."""
    req = decode_bounded(_request_decoder, data, limit=MAX_REQUEST_BYTES, what="request")
    check_request_id(req.request_id)
    return req


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def payload_problem(payload: object) -> str | None:
    """Why a replica would refuse this payload whatever model runs it (None: nothing it can tell
    without the model). The replica applies these rules first (dataplane/replica/model.py) and then
    its model's own (vocabulary, context length, a tokenizer for `prompt`, module names); `ndif
    submit` applies them before anything is sent."""
    if not isinstance(payload, dict):
        return "the payload must be a JSON object"
    op = payload.get("op", "forward")
    if op not in OPS:
        return f"unknown op {op!r}: use 'forward', 'generate' or 'echo'"
    if op == "echo":
        return None
    ids = payload.get("input_ids")
    if ids is None:
        if "prompt" not in payload:
            return "request needs input_ids (a list of token ids, or a list of such lists) or prompt"
        if not isinstance(payload["prompt"], str) or not payload["prompt"]:
            return "prompt must be a non-empty string"
    else:
        rows = [ids] if isinstance(ids, list) and ids and _int(ids[0]) else ids
        if (not isinstance(rows, list) or not rows or not all(isinstance(row, list) and row for row in rows)
                or len({len(row) for row in rows}) != 1):
            return "input_ids must be a non-empty list of equally long, non-empty lists of ints"
        if sum(len(row) for row in rows) > MAX_BATCH_TOKENS:
            return f"input_ids hold more than {MAX_BATCH_TOKENS} tokens"
        if any(not _int(t) or t < 0 for row in rows for t in row):
            return "input_ids must be ints in [0, the model's vocabulary size)"
    if op == "generate":
        n = payload.get("max_new_tokens", 16)
        if not _int(n) or not 1 <= n <= MAX_NEW_TOKENS:
            return f"max_new_tokens must be an int in [1, {MAX_NEW_TOKENS}]"
    modules = payload.get("modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        return "modules must be a list of module names"
    top_k = payload.get("top_k")
    if top_k is not None and not _int(top_k):
        return "top_k must be an int"
    return None


def status_or_none(data: bytes) -> StatusUpdate | None:
    """A status from bytes someone else wrote (a kept KV value, a live message), or None when they are
    not one (`decode_status`'s refusal). Never raises."""
    u = decode_status(data)
    return None if isinstance(u, Refused) else u
