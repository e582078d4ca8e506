"""The replica call and its answers, as they travel: one typed vocabulary for both of its ways.

A dispatcher calls a replica's `run_batch` with a `Call` (a batch of request payloads). Over NATS
(the replica's endpoint, dataplane/replica/endpoint.py; the dispatcher's side is
dataplane/serving/link.py) the call is msgpack and the reply is a `Reply`: the batch's `Answers`,
or `Parked` when the answers do not fit in one message (the dispatcher then takes them through the
runtime). Through the runtime itself (Ray) the same `Answer` structs travel, pickled.

Every request of a call gets one `Answer`: `Completed` (its result), `Failed` (its own error, which
never touches the other requests) or `NotRun` (the replica stopped being HOT before it; the
dispatcher hands it to another replica). Structs are array-like (positional on the wire, for
speed) with explicit tags; a new field goes at the end with a default, and never changes type.
The answers are not kw_only (build them with keywords anyway): Ray pickles them on its path, and a
kw_only struct pickles through a dict of its fields, about twice the time of a positional one.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from schemas.guard import Refused

T = TypeVar("T")

# A call or a reply goes over NATS only while it is smaller than the server's max payload minus
# this much (the room its headers and the protocol line take).
HEADROOM_BYTES = 4096


class Call(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The requests of one replica call, run one after the other, and whose each is (`users`, in
    the same order: the replica's turns go by it, dataplane/replica/turns.py; a call without it,
    from an older dispatcher, runs as one anonymous user's)."""

    payloads: list[dict[str, Any]]
    users: list[str] = msgspec.field(default_factory=list)


class Completed(msgspec.Struct, frozen=True, array_like=True, tag="completed"):
    """The request ran: its result, and how long it ran (the dispatcher's batch budget uses it)."""

    result: Any
    seconds: float


class Failed(msgspec.Struct, frozen=True, array_like=True, tag="failed"):
    """The request ran and raised: the error's class name and the line a user is told."""

    error: str
    message: str
    seconds: float


class NotRun(msgspec.Struct, frozen=True, array_like=True, tag="not_run"):
    """The replica was not HOT (any more) when this request's turn came: run it elsewhere."""

    reason: str


Answer = Completed | Failed | NotRun


class Answers(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="answers"):
    """The reply of a call: one answer per request, in the call's order."""

    answers: list[Answer]


class Parked(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="parked"):
    """The answers are too big for one message (or not msgpack-able): the replica keeps them for
    the caller to take through the runtime (`take_answer` with the call's reply subject)."""


Reply = Answers | Parked

_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)  # the endpoint's
_reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(Reply)  # the link's


def encode_call(payloads: list[dict[str, Any]], users: list[str] | None = None) -> bytes:
    return _encoder.encode(Call(payloads=payloads, users=users or []))


def decode_call(data: bytes) -> Call | Refused:
    """A call's body, or `Refused` with the reason (never raises)."""
    return _decode(_call_decoder, data, "replica call")


def encode_reply(reply: Reply) -> bytes:
    """A reply's body; TypeError or msgspec.EncodeError when a result is not msgpack-able."""
    return _encoder.encode(reply)


def decode_reply(data: bytes) -> Reply | Refused:
    """A reply's body, or `Refused` with the reason (never raises)."""
    return _decode(_reply_decoder, data, "replica answer")


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T | Refused:
    # msgpack has no text to scan for depth first (schemas/guard.py's way for JSON): msgspec raises
    # DecodeError for what is malformed (UnicodeDecodeError for bad UTF-8 before 0.23), RecursionError
    # for nesting past the interpreter's limit.
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return Refused(reason=f"malformed {what}: {exc}")
    except Exception as exc:  # noqa: BLE001 - RecursionError, or anything else: a refusal, never raised
        return Refused(reason=f"unreadable {what}: {type(exc).__name__}: {str(exc)[:200]}")
