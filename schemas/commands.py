"""Commands (imperatives sent on `ndif.cmd.<verb>`) and their replies.

A command is a request, not a fact: the controller decides and appends events, then replies.
`command_id` makes it idempotent: the same id again returns the first result, appends nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Final, Union

import msgspec

from schemas.autoscale import AutoscalePolicy
from schemas.errors import InvalidCommand, decode_bounded
from schemas.guard import Refused, decode_guarded
from schemas.inventory import Requirements, check_requirements
from schemas.status import Level

MAX_HEADROOM: Final = 4.0  # charging more than 5x a model's size is a typo, not a setting
MAX_GPUS: Final = 64  # cards per replica; more than any node holds


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="verb"):
    command_id: str
    actor: str = "cli"


class Deploy(Command, frozen=True, kw_only=True, tag="deploy"):
    """Create `replicas` HOT replicas of a model that has none (else rejected: use scale)."""

    model_key: str
    replicas: int = 1
    dedicated: bool = False
    size_bytes: int | None = None  # override the measured size at registration
    headroom: float | None = None  # fraction charged over the size (None: the controller's default)
    gpus: int | None = None  # exactly N cards of one node per replica (None: as few as hold the charge)
    # Only nodes meeting these hold its replicas, kept for the model (`--require`; None: any node).
    requires: Requirements | None = None
    # Asked for by a user's request (the dispatcher's provisioning), not by the operator: the model
    # must be one the operator offers (controlplane/service/registry.py). Trusted as sent: only the
    # operator and the dispatcher may send commands (controlplane/ops/auth.py).
    for_request: bool = False
    # The user whose request asked for it (the request subject's, never the body's; "" on an open
    # server): what the operator's on-demand rights and limits are counted against.
    for_user: str | None = None


class Scale(Command, frozen=True, kw_only=True, tag="scale"):
    """At least `replicas` HOT replicas; with `scale_up`, `replicas` more than now. Never scales down."""

    model_key: str
    replicas: int
    scale_up: bool = False
    dedicated: bool = False
    gpus: int | None = None  # exactly N cards per new replica, kept for the model (None: unchanged)


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
    """Restart Available or Failed replicas in place; a LoadFailed one is scheduled again (same id).

    `rolling` (the CLI's and the admin client's default; `--all-at-once` turns it off): a model's
    Available replicas restart one at a time, each after the previous is Available again, so the
    model keeps serving. Absent in a command body means all at once, as commands meant before the
    field existed.
    """

    model_key: str
    replica_id: int | None = None
    rolling: bool = False


class Undeploy(Command, frozen=True, kw_only=True, tag="undeploy"):
    """Remove a model: drain and unload every replica to COLD, then forget the model and its ids."""

    model_key: str


class Autoscale(Command, frozen=True, kw_only=True, tag="autoscale"):
    """Set a model's autoscaling policy (`off`: remove it; the replica count then stays as it is).

    Setting a policy again also ends an operator's manual count: after a `scale`/`scale-down` of
    an autoscaled model the autoscaler leaves its count alone until the next `autoscale`."""

    model_key: str
    policy: AutoscalePolicy = msgspec.field(default_factory=AutoscalePolicy)
    off: bool = False


AnyCommand = Union[Deploy, Scale, ScaleDown, Evict, Restart, Undeploy, Autoscale]
VERBS: Final[tuple[str, ...]] = tuple(c.__struct_config__.tag for c in AnyCommand.__args__)  # type: ignore[attr-defined,misc]

# How an operator raises the replica bounds, named in every refusal that cites them.
RAISE_REPLICA_LIMITS = ("NDIF_MAX_REPLICAS_PER_MODEL / NDIF_MAX_REPLICAS_PER_COMMAND in the environment of "
                        "`ndif up` or `ndif controller`, or `ndif controller --max-replicas-per-model/-per-command`")
# Replica bounds. A controller is configured with its own (`ndif controller --max-replicas-per-model`,
# env NDIF_MAX_REPLICAS_PER_MODEL / NDIF_MAX_REPLICAS_PER_COMMAND); these are the defaults.
MAX_REPLICAS_PER_MODEL: Final = 128
MAX_REPLICAS_PER_COMMAND: Final = 64
# What any client refuses before sending, whatever a controller allows: beyond this a count is a typo.
ABSOLUTE_MAX_REPLICAS: Final = 100_000


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds on what one command may ask; checked when a command is decoded, before any decision."""

    max_replicas_per_model: int = MAX_REPLICAS_PER_MODEL
    max_replicas_per_command: int = MAX_REPLICAS_PER_COMMAND

    @classmethod
    def from_env(cls, env: Mapping[str, str], **override: int | None) -> Limits:
        """The defaults, then NDIF_MAX_REPLICAS_PER_MODEL / _PER_COMMAND of `env` (the caller's
        environment: schemas read none), then `override` (None = keep)."""
        vals = {"max_replicas_per_model": _env_int(env, "NDIF_MAX_REPLICAS_PER_MODEL", MAX_REPLICAS_PER_MODEL),
                "max_replicas_per_command": _env_int(env, "NDIF_MAX_REPLICAS_PER_COMMAND", MAX_REPLICAS_PER_COMMAND)}
        vals.update({k: v for k, v in override.items() if v is not None})
        for k, v in vals.items():
            if not 1 <= v <= ABSOLUTE_MAX_REPLICAS:
                raise InvalidCommand(f"{k} must be between 1 and {ABSOLUTE_MAX_REPLICAS}, got {v}")
        return cls(**vals)


ON_DEMAND_PER_USER = 2  # models one user's requests may have deployed at once (docs/reliability.md)
ON_DEMAND_TOTAL = 8  # models all users' requests may have deployed at once


class OnDemand(msgspec.Struct, frozen=True, kw_only=True):
    """Who may make the cluster load a model by sending it a request, and how many such models
    may be deployed at once: per user and in all. Such a deploy takes free room only (it evicts
    nobody's replica). `users` None: every user; empty: nobody (the operator deploys every model)."""

    users: frozenset[str] | None = None
    per_user: int = ON_DEMAND_PER_USER
    total: int = ON_DEMAND_TOTAL

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OnDemand:
        """NDIF_ON_DEMAND_USERS (`*`, the default: every user; a comma-separated list; empty: nobody),
        NDIF_ON_DEMAND_PER_USER and NDIF_ON_DEMAND_TOTAL (0 allowed: none) of `env`."""
        raw = env.get("NDIF_ON_DEMAND_USERS", "*").strip()
        users = None if raw == "*" else frozenset(u.strip() for u in raw.split(",") if u.strip())
        vals = {"per_user": _env_int(env, "NDIF_ON_DEMAND_PER_USER", ON_DEMAND_PER_USER),
                "total": _env_int(env, "NDIF_ON_DEMAND_TOTAL", ON_DEMAND_TOTAL)}
        for k, v in vals.items():
            if not 0 <= v <= ABSOLUTE_MAX_REPLICAS:
                raise InvalidCommand(f"NDIF_ON_DEMAND_{k.upper()} must be between 0 and {ABSOLUTE_MAX_REPLICAS}, got {v}")
        return cls(users=users, **vals)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidCommand(f"{name} must be an integer, got {raw!r}") from None


# A command id becomes the id of its events (`<command_id>.<n>`, the `Nats-Msg-Id` header): one
# printable token, bounded. An actor is recorded in every event of the decision.
_COMMAND_ID = re.compile(r"[A-Za-z0-9_.:@+=/-]{1,128}")
_ACTOR = re.compile(r"[\x21-\x7e][\x20-\x7e]{0,199}")


def validate(cmd: AnyCommand, limits: Limits | None = None) -> AnyCommand:
    """Reject what no cluster state could make valid; raises InvalidCommand.

    With `limits` (the controller's), a count above them is refused here, in microseconds, before
    any placement is tried; without (a client), only counts above ABSOLUTE_MAX_REPLICAS are.
    """
    if not _COMMAND_ID.fullmatch(cmd.command_id):
        raise InvalidCommand(f"command id {cmd.command_id[:60]!r}: 1-128 characters of [A-Za-z0-9_.:@+=/-]")
    if not _ACTOR.fullmatch(cmd.actor):
        raise InvalidCommand(f"actor {cmd.actor[:60]!r}: 1-200 printable ASCII characters")
    replicas = getattr(cmd, "replicas", None)
    if isinstance(cmd, (Deploy, Scale)) and cmd.replicas < 1:  # negative ones too: one message for both
        raise InvalidCommand(f"{cmd.__struct_config__.tag}: --replicas must be at least 1, got {cmd.replicas} "
                             "(fewer replicas: `ndif scale-down MODEL --replicas N`, 0 for none)")
    if replicas is not None and replicas < 0:
        raise InvalidCommand(f"--replicas must be 0 or more, got {replicas}")
    if replicas is not None:
        cap = ABSOLUTE_MAX_REPLICAS if limits is None else min(limits.max_replicas_per_command,
                                                                limits.max_replicas_per_model)
        if replicas > cap and not isinstance(cmd, ScaleDown):
            which = ("the absolute limit" if limits is None else
                     "this controller's limit per command" if cap == limits.max_replicas_per_command
                     else "this controller's limit per model")
            raise InvalidCommand(f"--replicas {replicas} is above {which} ({cap} replicas); "
                                 f"ask for fewer, or raise the limit: {RAISE_REPLICA_LIMITS}")
        if isinstance(cmd, ScaleDown) and replicas > ABSOLUTE_MAX_REPLICAS:
            raise InvalidCommand(f"--replicas {replicas} is above the absolute limit ({ABSOLUTE_MAX_REPLICAS})")
    if isinstance(cmd, Deploy) and cmd.size_bytes is not None and cmd.size_bytes <= 0:
        raise InvalidCommand(f"the model size (--size-gib) must be positive, got {cmd.size_bytes} bytes")
    if isinstance(cmd, Deploy) and cmd.headroom is not None and not 0.0 <= cmd.headroom <= MAX_HEADROOM:
        raise InvalidCommand(f"--headroom must be between 0 and {MAX_HEADROOM:g} (a fraction of the size), "
                             f"got {cmd.headroom}")
    if isinstance(cmd, Deploy) and cmd.requires is not None:
        check_requirements(cmd.requires)
    gpus = getattr(cmd, "gpus", None)
    if gpus is not None and not 1 <= gpus <= MAX_GPUS:
        raise InvalidCommand(f"--gpus must be between 1 and {MAX_GPUS}, got {gpus}")
    if isinstance(cmd, Evict):
        if cmd.all and cmd.model_key:
            raise InvalidCommand("evict: give a model or --all, not both")
        if not cmd.all and not cmd.model_key:
            raise InvalidCommand("evict: give a model (optionally --replica-id N) or --all")
        if cmd.replica_id is not None and not cmd.model_key:
            raise InvalidCommand("evict: --replica-id needs a model")
    if isinstance(cmd, Autoscale) and not cmd.off:
        cmd.policy.check(ABSOLUTE_MAX_REPLICAS if limits is None else limits.max_replicas_per_model)
    rid = getattr(cmd, "replica_id", None)
    if rid is not None and not 0 <= rid <= 2**31:
        raise InvalidCommand(f"--replica-id must be between 0 and 2^31, got {rid}")
    if len(cmd.command_id) > 200 or not cmd.command_id:
        raise InvalidCommand("--command-id must be 1 to 200 characters")
    return cmd


# Fields added to a command after commands were first recorded, with their defaults: at the default
# they are left out of the fingerprint, so a command recorded before a field existed keeps its
# fingerprint (a resent old command id is still recognised, and old decisions re-decide byte for byte).
_LATER_FIELDS: dict[str, object] = {"rolling": False, "for_request": False, "requires": None, "for_user": None}


def fingerprint(cmd: AnyCommand) -> str:
    """What a command asks, without who sent it or its id: the same id with another fingerprint is
    another command (refused). Taken after the model key is made canonical."""
    fields = msgspec.to_builtins(msgspec.structs.replace(cmd, command_id="", actor=""))
    for name, default in _LATER_FIELDS.items():
        if name in fields and fields[name] == default:
            del fields[name]
    body = msgspec.json.encode(fields)
    return hashlib.blake2b(body, digest_size=12).hexdigest()


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
    # deploy/scale: replicas the decision wanted placed, and how many it placed. `ok` is false when
    # placed < asked (the decision is still in the log: first_seq..last_seq; error PlacementError).
    asked: int = 0
    placed: int = 0


MAX_COMMAND_BYTES: Final = 64 * 1024
_command_decoder = msgspec.json.Decoder(AnyCommand)
# A result lists a decision's replicas, evictions and refusals: bounded by what one NATS message carries.
MAX_RESULT_BYTES: Final = 8 << 20
_result_decoder = msgspec.json.Decoder(CommandResult)


def decode_result(data: bytes) -> CommandResult | Refused:
    """A controller's reply to a command, or `Refused` with the reason (never raises)."""
    return decode_guarded(_result_decoder, data, limit=MAX_RESULT_BYTES, what="command result")


def decode_command(data: bytes, limits: Limits | None = None, *, verb: str | None = None) -> AnyCommand:
    """Decode and validate a command body: the command, or InvalidCommand with the reason, whatever
    the bytes (nothing else is raised).

    `verb` is the last token of the subject it came on (`ndif.cmd.<verb>`): the body's verb must be
    the same (an evict sent on `ndif.cmd.scale` is refused, not run as an evict), so a server
    permission on a verb's subject means what it says.
    """
    cmd = decode_bounded(_command_decoder, data, limit=MAX_COMMAND_BYTES, what="command")
    if verb is not None and cmd.__struct_config__.tag != verb:
        raise InvalidCommand(f"command {cmd.command_id!r} is a {cmd.__struct_config__.tag!r} sent on the subject of "
                             f"{verb[:40]!r}: send it on ndif.cmd.{cmd.__struct_config__.tag}")
    return validate(cmd, limits or Limits())
