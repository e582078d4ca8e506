"""Commands (imperatives sent on `ndif.cmd.<verb>`) and their replies.

A command is a request, not a fact: the controller decides and appends events, then replies.
`command_id` makes it idempotent: the same id again returns the first result, appends nothing.
"""

from __future__ import annotations

import re
from typing import Final, Union

import msgspec

from schemas.errors import InvalidCommand
from schemas.status import Level


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="verb"):
    command_id: str
    actor: str = "cli"


class Deploy(Command, frozen=True, kw_only=True, tag="deploy"):
    """Create `replicas` HOT replicas of a model that has none (else rejected: use scale)."""

    model_key: str
    replicas: int = 1
    dedicated: bool = False
    size_bytes: int | None = None  # override the measured size at registration


class Scale(Command, frozen=True, kw_only=True, tag="scale"):
    """At least `replicas` HOT replicas; with `scale_up`, `replicas` more than now. Never scales down."""

    model_key: str
    replicas: int
    scale_up: bool = False
    dedicated: bool = False


class ScaleDown(Command, frozen=True, kw_only=True, tag="scale-down"):
    """At most `replicas` HOT replicas: drains, then unloads the highest ids."""

    model_key: str
    replicas: int


class Evict(Command, frozen=True, kw_only=True, tag="evict"):
    """Evict one replica, a model's replicas, or (`all`) every HOT replica; WARM where cache allows."""

    model_key: str | None = None
    replica_id: int | None = None
    all: bool = False
    cold: bool = False


class Restart(Command, frozen=True, kw_only=True, tag="restart"):
    model_key: str
    replica_id: int | None = None


AnyCommand = Union[Deploy, Scale, ScaleDown, Evict, Restart]
VERBS: Final[tuple[str, ...]] = tuple(c.__struct_config__.tag for c in AnyCommand.__args__)  # type: ignore[attr-defined,misc]


# A command id becomes the id of its events (`<command_id>.<n>`, the `Nats-Msg-Id` header): one
# printable token, bounded. An actor is recorded in every event of the decision.
_COMMAND_ID = re.compile(r"[A-Za-z0-9_.:@+=/-]{1,128}")
_ACTOR = re.compile(r"[\x21-\x7e][\x20-\x7e]{0,199}")


def validate(cmd: AnyCommand) -> AnyCommand:
    """Reject what no cluster state could make valid; raises InvalidCommand."""
    if not _COMMAND_ID.fullmatch(cmd.command_id):
        raise InvalidCommand(f"command id {cmd.command_id[:60]!r}: 1-128 characters of [A-Za-z0-9_.:@+=/-]")
    if not _ACTOR.fullmatch(cmd.actor):
        raise InvalidCommand(f"actor {cmd.actor[:60]!r}: 1-200 printable ASCII characters")
    replicas = getattr(cmd, "replicas", None)
    if replicas is not None and replicas < 0:
        raise InvalidCommand(f"--replicas must be 0 or more, got {replicas}")
    if isinstance(cmd, (Deploy, Scale)) and cmd.replicas < 1:
        raise InvalidCommand(f"{cmd.__struct_config__.tag}: --replicas must be at least 1, got {cmd.replicas}")
    if isinstance(cmd, Deploy) and cmd.size_bytes is not None and cmd.size_bytes <= 0:
        raise InvalidCommand(f"--size-bytes must be positive, got {cmd.size_bytes}")
    if isinstance(cmd, Evict):
        if cmd.all and cmd.model_key:
            raise InvalidCommand("evict: give a model or --all, not both")
        if not cmd.all and not cmd.model_key:
            raise InvalidCommand("evict: give a model (optionally --replica-id N) or --all")
        if cmd.replica_id is not None and not cmd.model_key:
            raise InvalidCommand("evict: --replica-id needs a model")
    rid = getattr(cmd, "replica_id", None)
    if rid is not None and rid < 0:
        raise InvalidCommand(f"--replica-id must be 0 or more, got {rid}")
    return cmd


class ReplicaOutcome(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replica_id: int
    level: Level
    node_id: str = ""
    gpu_indices: tuple[int, ...] = ()
    action: str = ""  # scheduled | reused-warm | evicted | restarted | unchanged


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    model_key: str
    replicas: int
    needed_bytes: int
    free_bytes: int
    reason: str = "CANT_ACCOMMODATE"


class CommandResult(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's reply once the decision is appended (or found already appended)."""

    command_id: str
    ok: bool
    first_seq: int = 0
    last_seq: int = 0
    duplicate: bool = False  # the command_id was already decided; this is the first result
    replicas: tuple[ReplicaOutcome, ...] = ()
    evictions: tuple[ReplicaOutcome, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    message: str = ""
    error: str | None = None  # error class name when not ok (InvalidCommand, UnknownModel, ...)


_command_decoder = msgspec.json.Decoder(AnyCommand)


def decode_command(data: bytes, *, verb: str | None = None) -> AnyCommand:
    """Decode and validate a command body; malformed input is InvalidCommand, never a crash.

    `verb` is the last token of the subject it came on (`ndif.cmd.<verb>`): the body's verb must be
    the same (an evict sent on `ndif.cmd.scale` is refused, not run as an evict), so a server
    permission on a verb's subject means what it says.
    """
    try:
        cmd = _command_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidCommand(f"malformed command: {exc}") from None
    if verb is not None and cmd.__struct_config__.tag != verb:
        raise InvalidCommand(f"command {cmd.command_id!r} is a {cmd.__struct_config__.tag!r} sent on the subject of "
                             f"{verb[:40]!r}: send it on ndif.cmd.{cmd.__struct_config__.tag}")
    return validate(cmd)
