"""A replica's recent log lines, asked of the agent of its node (`ndif logs`; docs/cli.md).

The admin asks on `ndif.logs.<ntok>.<mtok>.<replica_id>` (schemas/subjects.py `replica_logs_subject`):
only the agent of that node subscribes there (its account exports it to the system's, where only
the admin may publish on `ndif.logs.>`; controlplane/ops/auth.py), so a client, the dispatcher or
another node's agent can neither ask nor answer. The body asks for at most `MAX_LINES` lines; the
answer holds at most `MAX_LINES` lines of at most `MAX_LINE_CHARS` characters, `MAX_REPLY_BYTES` in
all (the newest kept: `truncated` says lines were left out).
"""

from __future__ import annotations

from typing import Final

import msgspec

from schemas.errors import InvalidCommand, decode_bounded

MAX_LINES: Final = 1000  # the most lines one answer holds (and an agent keeps per replica)
DEFAULT_LINES: Final = 100
MAX_LINE_CHARS: Final = 2000  # a longer line is cut, ending in "…"
MAX_REPLY_BYTES: Final = 256 * 1024  # the answer's body (well under NATS's payload limit)
MAX_ASK_BYTES: Final = 1024


class LogsAsk(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    lines: int = DEFAULT_LINES


class LogsReply(msgspec.Struct, frozen=True, kw_only=True):
    """`ok` false with `error` (`NotFound`: the agent has no such replica) and `message`, or the lines."""

    ok: bool
    node_id: str = ""
    replica_id: int = -1
    lines: list[str] = msgspec.field(default_factory=list)
    truncated: bool = False  # older lines (or bytes) were left out to keep within the bounds
    missing: str = ""  # with `ok`: why the replica process's own lines are not among `lines` (else "")
    error: str = ""
    message: str = ""


_ask_decoder = msgspec.json.Decoder(LogsAsk)
_reply_decoder = msgspec.json.Decoder(LogsReply)
_encoder = msgspec.json.Encoder()


def check_lines(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_LINES:
        raise InvalidCommand(f"--lines must be an int in [1, {MAX_LINES}]")
    return n


def encode_ask(lines: int) -> bytes:
    return _encoder.encode(LogsAsk(lines=check_lines(lines)))


def decode_ask(data: bytes) -> LogsAsk:
    """InvalidCommand for anything but a bounded, well-formed ask (an empty body asks for the default)."""
    if not data:
        return LogsAsk()
    ask = decode_bounded(_ask_decoder, data, limit=MAX_ASK_BYTES, what="logs request")
    check_lines(ask.lines)
    return ask


def clip_line(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 1] + "…"


def encode_reply(reply: LogsReply) -> bytes:
    """The answer, kept within `MAX_REPLY_BYTES` by dropping the oldest lines (then `truncated`)."""
    lines = [clip_line(x) for x in reply.lines[-MAX_LINES:]]
    truncated = reply.truncated or len(lines) < len(reply.lines)
    body = _encoder.encode(msgspec.structs.replace(reply, lines=lines, truncated=truncated))
    while len(body) > MAX_REPLY_BYTES and lines:
        # drop about the share over the bound, oldest first
        drop = max(1, len(lines) * (len(body) - MAX_REPLY_BYTES) // len(body) + 1)
        lines = lines[drop:]
        body = _encoder.encode(msgspec.structs.replace(reply, lines=lines, truncated=True))
    return body


def decode_reply(data: bytes) -> LogsReply:
    """InvalidCommand (raised) for an answer that is not one; at most `MAX_REPLY_BYTES`."""
    return decode_bounded(_reply_decoder, data, limit=MAX_REPLY_BYTES, what="logs answer")
