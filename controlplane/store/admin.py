"""The typed async admin client: what the CLI and tests use to command and read the control plane.

``async with await AdminClient.open(url) as admin: await admin.deploy("org/model", replicas=2)``.
Commands go to a controller by request/reply and come back as `CommandResult`; refusals raise the
matching `NdifError`. Reads fold the event log directly, with the same reducers as every component.
"""

from __future__ import annotations

import asyncio
import getpass
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from types import TracebackType

import msgspec
import nats.errors

from controlplane.core.ports import Stored
from controlplane.core.projections import ClusterState
from controlplane.store.credentials import Creds
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.rebuild import rebuild
from schemas import errors as errs
from schemas.autoscale import AutoscalePolicy
from schemas.commands import (
    AnyCommand,
    Autoscale,
    CommandResult,
    Deploy,
    Evict,
    Restart,
    Scale,
    ScaleDown,
    Undeploy,
    decode_result,
    validate,
)
from schemas.events import Event, ReplicaEvent
from schemas.guard import Refused
from schemas.inventory import Requirements
from schemas.keys import canonical_model_key, display_name
from schemas.status import ReplicaState
from schemas.subjects import command_subject

_encoder = msgspec.json.Encoder()
_ERRORS: dict[str, type[errs.NdifError]] = {
    c.__name__: c for c in (errs.InvalidCommand, errs.CommandIdConflict, errs.AlreadyDeployed, errs.OnDemandRefused,
                            errs.NotFound,
                            errs.UnknownModel, errs.ConflictError, errs.PlacementError, errs.InfrastructureError)
}


def new_command_id() -> str:
    return f"cmd-{uuid.uuid4().hex[:16]}"


def resolve_name(state: ClusterState, name: str) -> str:
    """The canonical key of a model the log knows, from any name an operator types: a full key, a
    repo id, a checkpoint path, or a short name (the repo id's or directory's last part) that
    matches exactly one model. Unknown -> UnknownModel (exit 3); several matches -> InvalidCommand.
    """
    known = set(state.models) | state.undeployed
    try:
        mk = canonical_model_key(name)
    except errs.InvalidCommand:
        mk = None
    if mk is not None and mk in known:
        return mk
    short = name.rstrip("/")
    hits = sorted(k for k in known
                  if display_name(k) == short or display_name(k).rstrip("/").rsplit("/", 1)[-1] == short)
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise errs.InvalidCommand(f"{name!r} matches {len(hits)} models ({', '.join(map(display_name, hits))}); "
                                  "give the full repo id or path")
    names = ", ".join(sorted(display_name(k) for k in known)[:10]) or "none yet"
    raise errs.UnknownModel(f"unknown model {name!r}: no model of that name in the log (models: {names})")


class AdminClient:
    def __init__(self, log: JetStreamEventLog, *, timeout: float = 30.0, actor: str | None = None) -> None:
        self.log = log
        self.timeout = timeout
        self.actor = actor or f"cli:{getpass.getuser()}"

    @classmethod
    async def open(cls, url: str, *, timeout: float = 30.0, actor: str | None = None,
                   creds: Creds | None = None) -> AdminClient:
        log = await JetStreamEventLog.open(url, ensure=False, name="ndif-admin", creds=creds, role="admin")
        return cls(log, timeout=timeout, actor=actor)

    async def close(self) -> None:
        await self.log.close()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # ---- commands ----------------------------------------------------------------------------

    async def command(self, cmd: AnyCommand) -> CommandResult:
        """Send a command to a controller; the result once appended, or the refusal as an NdifError."""
        validate(cmd)  # bad input fails here, before any controller sees it
        verb = cmd.__struct_config__.tag
        try:
            msg = await self.log.nc.request(command_subject(str(verb)), _encoder.encode(cmd), timeout=self.timeout)
        except nats.errors.NoRespondersError:
            raise errs.InfrastructureError(
                "no controller is answering on ndif.cmd.*: start one (`ndif up` or `ndif controller`)"
            ) from None
        except nats.errors.TimeoutError:
            raise errs.InfrastructureTimeout(
                f"no controller answered within {self.timeout:.0f}s; the command may still be decided: "
                f"re-run it with the same command id ({cmd.command_id}) to get its result"
            ) from None
        res = decode_result(msg.data)
        if isinstance(res, Refused):
            raise errs.InfrastructureError(f"the controller's answer to {cmd.command_id} cannot be read: {res.reason}")
        if not res.ok and not res.last_seq:  # refused, nothing appended (a short placement is a result)
            cls = _ERRORS.get(res.error or "", errs.NdifError)
            if cls is errs.ConflictError:
                raise errs.ConflictError(res.message or "conflict", expected_last_seq=0, actual_last_seq=None)
            raise cls(res.message or "refused")
        return res

    def _cmd(self, cls: type, command_id: str | None, **fields: object) -> AnyCommand:
        # The model key is canonicalised here, where the user typed it: a relative checkpoint path
        # means this process's directory (the controller refuses relative paths).
        if isinstance(fields.get("model_key"), str):
            fields["model_key"] = canonical_model_key(fields["model_key"])  # type: ignore[arg-type]
        return cls(command_id=command_id or new_command_id(), actor=self.actor, **fields)  # type: ignore[no-any-return]

    async def deploy(self, model: str, replicas: int = 1, *, dedicated: bool = False, size_bytes: int | None = None,
                     command_id: str | None = None, headroom: float | None = None,
                     gpus: int | None = None, for_request: bool = False, for_user: str | None = None,
                     requires: Requirements | None = None) -> CommandResult:
        """`for_request`: asked for by a user's request (the dispatcher, for `for_user`), so only a
        model the operator offers is deployed (controlplane/service/registry.py), within the
        operator's on-demand rights and limits (`OnDemandRefused` otherwise)."""
        return await self.command(self._cmd(Deploy, command_id, model_key=model, replicas=replicas,
                                            dedicated=dedicated, size_bytes=size_bytes, headroom=headroom, gpus=gpus,
                                            for_request=for_request, for_user=for_user, requires=requires))

    async def scale(self, model: str, replicas: int, *, scale_up: bool = False, dedicated: bool = False,
                    command_id: str | None = None, gpus: int | None = None) -> CommandResult:
        return await self.command(self._cmd(Scale, command_id, model_key=model, replicas=replicas, scale_up=scale_up,
                                            dedicated=dedicated, gpus=gpus))

    async def scale_down(self, model: str, replicas: int, *, command_id: str | None = None) -> CommandResult:
        return await self.command(self._cmd(ScaleDown, command_id, model_key=model, replicas=replicas))

    async def evict(self, model: str | None = None, *, replica_id: int | None = None, all: bool = False,
                    cold: bool = False, command_id: str | None = None) -> CommandResult:
        return await self.command(self._cmd(Evict, command_id, model_key=model, replica_id=replica_id, all=all,
                                            cold=cold))

    async def restart(self, model: str, *, replica_id: int | None = None, rolling: bool = True,
                      command_id: str | None = None) -> CommandResult:
        """Restart one replica, or every replica of the model: by default one at a time (each after
        the previous is Available again); `rolling=False` restarts them all at once."""
        return await self.command(self._cmd(Restart, command_id, model_key=model, replica_id=replica_id,
                                            rolling=rolling))

    async def wait_rollout(self, model: str, *, timeout: float = 600.0, poll_s: float = 0.5) -> ClusterState:
        """The state once the model's rolling restart has ended (nothing remaining, the last
        replica back or failed); TimeoutError past `timeout`."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            state = await self.state()
            m = state.models.get(model)
            cur = None if m is None or m.rollout_current is None else state.replicas.get((model, m.rollout_current))
            if m is None or (not m.rollout and (cur is None or cur.state is not ReplicaState.RESTARTING)):
                return state
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the rolling restart of {display_name(model)} did not end within {timeout:g}s")
            await asyncio.sleep(poll_s)

    async def autoscale(self, model: str, policy: AutoscalePolicy | None = None, *, off: bool = False,
                        command_id: str | None = None) -> CommandResult:
        """Set the model's autoscaling policy (default: `AutoscalePolicy()`), or turn it `off`."""
        return await self.command(self._cmd(Autoscale, command_id, model_key=model, off=off,
                                            policy=policy or AutoscalePolicy()))

    async def undeploy(self, model: str, *, command_id: str | None = None) -> CommandResult:
        return await self.command(self._cmd(Undeploy, command_id, model_key=model))

    # ---- reads -------------------------------------------------------------------------------

    async def state(self, *, until_seq: int | None = None, until_time: datetime | None = None,
                    strict: bool = False) -> ClusterState:
        """The cluster view now, or as it was at `until_seq` / `until_time` (`ndif replay`): the newest
        snapshot at or before that point plus the events after it (controlplane/store/rebuild.py)."""
        return await rebuild(self.log, until_seq=until_seq, until_time=until_time, strict=strict)

    async def events(self, *, model: str | None = None, replica_id: int | None = None, start_seq: int = 1,
                     follow: bool = False) -> AsyncIterator[Stored]:
        """Stored events, optionally of one model (and replica); with `follow`, live."""
        mk = canonical_model_key(model) if model else None
        source = self.log.follow(start_seq) if follow else self.log.read(start_seq)
        async for seq, item in source:
            if mk is not None and (not isinstance(item, Event) or item.model_key != mk):
                continue
            if replica_id is not None and not (isinstance(item, ReplicaEvent) and item.replica_id == replica_id):
                continue
            yield seq, item

    async def wait(self, result: CommandResult, *, timeout: float = 300.0) -> ClusterState:
        """Follow the log until every replica the command scheduled or restarted is loaded or failed."""
        want = {(r.model_key, r.replica_id) for r in result.replicas}
        state = await self.state()
        settled = {ReplicaState.AVAILABLE, ReplicaState.LOAD_FAILED, ReplicaState.FAILED}

        def done() -> bool:
            return all(k in state.replicas and state.replicas[k].state in settled
                       and state.replicas[k].since_seq > result.first_seq - 1 for k in want)

        if done():
            return state

        async def follow() -> None:
            async for batch in self.log.follow_batches(state.seq + 1):
                for seq, item in batch:
                    state.apply(seq, item)
                if done():
                    return

        try:
            await asyncio.wait_for(follow(), timeout)
        except TimeoutError:
            pending = sorted(f"{k[1]}:{state.replicas[k].state if k in state.replicas else '?'}" for k in want)
            raise errs.InfrastructureTimeout(
                f"replicas not loaded after {timeout:.0f}s ({', '.join(pending)}); is an agent running for their node?"
            ) from None
        return state
