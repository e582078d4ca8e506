"""Roles as NATS users with subject permissions: who may publish and subscribe to what.

One user per role in the server's config (`authorization { users = [...] }`), each with an allow
list of publish and subscribe subjects and its own inbox prefix (`_INBOX_<user>.>`), so no user can
read another's replies:

- admin: everything (commands, every stream's API, the only one who may create, update or delete streams);
- controller: appends decisions (`ndif.evt.model.*`, `ndif.evt.replica.<m>.<r>`, `ndif.evt.node.*`),
  reads events and heartbeats, answers `ndif.cmd.*`, writes the fold's snapshots (`ndif_snapshots`);
- agent (one user per node): appends observed facts of its own node only
  (`ndif.evt.node.<ntok>`, `ndif.evt.replica.*.*.<ntok>`), its own heartbeat key, serves its own
  node's replica endpoints only (`ndif.run.<ntok>.>`), reads events by direct gets (no consumer);
- dispatcher: requests, the status bucket and subjects, every user's results bucket
  (`ndif_results_<user>`, which it creates), `ndif.run.>`, `ndif.cmd.deploy` (provisioning) and
  its drain reports (`ndif.evt.replica.*.*.dispatcher`);
- client (one user per person): publishes requests on `ndif.req.*.<user>`, reads only
  `ndif.status.<user>.>`, its own keys of the status bucket and its own results bucket (by direct
  gets), kills only through `ndif.dispatcher.kill.<user>`;
- dashboard: reads events (direct gets, no consumer), stream info and the dispatcher's state;
  writes nothing.

Neither a read-only role nor an agent may create a consumer: a consumer's deliver subject is in
the request body, beyond what subject permissions see, so whoever creates one can make the server
publish a stream's messages on any subject. Those roles read by direct gets (controlplane/store/direct.py).

`ndif up` generates a password per user on first start (`ensure_local`), keeps the credentials
under `$NDIF_HOME/auth/` (0600) and writes the server's config from them; every local command
finds its role's file there (`resolve`). Server-config users rather than decentralised JWTs: one
file, no operator/account keys to manage, and a reload (`nats-server --signal reload`) adds a node.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.store.credentials import (
    Creds,
    _check_name,
    _write_private,
    auth_dir,
    creds_file,
    load_creds,
    local_client_name,
    save_creds,
    user_name,
)
from schemas.errors import InvalidCommand
from schemas.events import DISPATCHER_SOURCE
from schemas.subjects import (
    COMMAND_EVENTS_ANY,
    COMMANDS_ANY,
    DISPATCHER_KILL,
    DISPATCHER_STATE,
    EVENTS_ALL,
    EVENTS_STREAM,
    HEARTBEATS_BUCKET,
    MODEL_EVENTS_ANY,
    NODE_EVENTS_ANY,
    NODE_EVENTS_PREFIX,
    REPLICA_CALLS_ALL,
    REPLICA_DECISIONS_ANY,
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    SNAPSHOTS_BUCKET,
    STATUS_ALL,
    command_subject,
    kill_subject,
    node_run_subjects,
    node_token,
    replica_facts_from,
    results_bucket,
    user_requests,
    user_statuses,
)

ROLES = ("admin", "controller", "agent", "dispatcher", "client", "dashboard")


# ---- permissions -------------------------------------------------------------------------------

_API = "$JS.API"


def _read_stream(stream: str) -> list[str]:
    """What reading a stream takes: its info, direct/stored gets, ordered consumers (create, delete, flow control)."""
    return [f"{_API}.STREAM.INFO.{stream}", f"{_API}.DIRECT.GET.{stream}", f"{_API}.DIRECT.GET.{stream}.>",
            f"{_API}.STREAM.MSG.GET.{stream}", f"{_API}.CONSUMER.CREATE.{stream}",
            f"{_API}.CONSUMER.CREATE.{stream}.>", f"{_API}.CONSUMER.DELETE.{stream}.>",
            f"{_API}.CONSUMER.INFO.{stream}.>", f"$JS.FC.{stream}.>"]


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _obj(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _direct_read(stream: str) -> list[str]:
    """Reading a stream by direct gets only (its info, gets by sequence, batch or last by subject)."""
    return [f"{_API}.STREAM.INFO.{stream}", f"{_API}.DIRECT.GET.{stream}", f"{_API}.DIRECT.GET.{stream}.>"]


def _snapshot_writer() -> list[str]:
    """The controller writes the fold's snapshots (nats-py's object put and delete: chunks and meta,
    the last meta of a name, a purge of replaced chunks) and reads them by direct gets."""
    b = SNAPSHOTS_BUCKET
    return [*_direct_read(_obj(b)), f"{_API}.STREAM.MSG.GET.{_obj(b)}", f"{_API}.STREAM.PURGE.{_obj(b)}", f"$O.{b}.>"]


def _results_writer(user: str) -> list[str]:
    """What the dispatcher needs on one user's results bucket: create it, put objects (nats-py's put
    reads an object's last meta and purges a replaced object's chunks)."""
    b = results_bucket(user)
    return [f"{_API}.STREAM.CREATE.{_obj(b)}", f"{_API}.STREAM.INFO.{_obj(b)}", f"{_API}.STREAM.MSG.GET.{_obj(b)}",
            f"{_API}.DIRECT.GET.{_obj(b)}.>", f"{_API}.STREAM.PURGE.{_obj(b)}", f"$O.{b}.>"]


def permissions(role: str, *, name: str = "", node_id: str = "", clients: tuple[str, ...] = ()) -> dict[str, Any]:
    """The server-side permissions of one user (nats-server `permissions` block).

    `clients`: every client user's name (the dispatcher gets the results bucket of each)."""
    inbox = f"_INBOX_{user_name(role, name=name, node_id=node_id)}.>"
    pub: list[str]
    sub: list[str]
    events = _read_stream(EVENTS_STREAM)
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "controller":
        pub = [MODEL_EVENTS_ANY, REPLICA_DECISIONS_ANY, NODE_EVENTS_ANY, COMMAND_EVENTS_ANY, *events,
               *_read_stream(_kv(HEARTBEATS_BUCKET)), *_snapshot_writer(),
               f"{_API}.STREAM.INFO.{REQUESTS_STREAM}", f"{_API}.STREAM.INFO.{_kv(REQUEST_STATUS_BUCKET)}",
               f"{_API}.STREAM.INFO.{_obj(RESULTS_BUCKET)}"]
        sub = [COMMANDS_ANY, inbox]
    elif role == "agent":
        ntok = node_token(node_id)
        # Events by direct gets only (no consumer: its deliver subject could be anyone's); the event
        # subjects themselves are its follower's wake-up.
        pub = [f"{NODE_EVENTS_PREFIX}{ntok}", replica_facts_from(ntok), f"$KV.{HEARTBEATS_BUCKET}.{ntok}",
               f"{_API}.STREAM.INFO.{_kv(HEARTBEATS_BUCKET)}", *_direct_read(EVENTS_STREAM),
               f"{_API}.STREAM.MSG.GET.{EVENTS_STREAM}",
               # its own node's last heartbeat (a node id held by a live agent is not taken twice)
               f"{_API}.STREAM.MSG.GET.{_kv(HEARTBEATS_BUCKET)}",
               f"{_API}.DIRECT.GET.{_kv(HEARTBEATS_BUCKET)}.$KV.{HEARTBEATS_BUCKET}.{ntok}",
               *_direct_read(_obj(SNAPSHOTS_BUCKET))]  # its fold starts from the newest snapshot
        sub = [node_run_subjects(node_id), EVENTS_ALL, inbox]
    elif role == "dispatcher":
        pub = [replica_facts_from(DISPATCHER_SOURCE), command_subject("deploy"), STATUS_ALL, REPLICA_CALLS_ALL,
               f"$KV.{REQUEST_STATUS_BUCKET}.>", f"$O.{RESULTS_BUCKET}.>", *events,
               *_read_stream(_kv(REQUEST_STATUS_BUCKET)), *_read_stream(_obj(RESULTS_BUCKET)),
               *_read_stream(REQUESTS_STREAM), *_direct_read(_obj(SNAPSHOTS_BUCKET)),
               f"{_API}.CONSUMER.DURABLE.CREATE.{REQUESTS_STREAM}.>",
               f"{_API}.CONSUMER.MSG.NEXT.{REQUESTS_STREAM}.>", f"$JS.ACK.{REQUESTS_STREAM}.>",
               # requests for models the log does not know: refused ones deleted, stale consumers swept
               f"{_API}.STREAM.MSG.DELETE.{REQUESTS_STREAM}", f"{_API}.CONSUMER.LIST.{REQUESTS_STREAM}",
               *(x for c in clients for x in _results_writer(_check_name(c, "client name")))]
        sub = [REQUESTS_ALL, DISPATCHER_STATE, DISPATCHER_KILL, kill_subject("*"), inbox]
    elif role == "client":
        me = _check_name(name, "client name")
        st = _kv(REQUEST_STATUS_BUCKET)
        pub = [user_requests(me), kill_subject(me),
               f"{_API}.STREAM.INFO.{st}", f"{_API}.DIRECT.GET.{st}.$KV.{REQUEST_STATUS_BUCKET}.{me}.>",
               # Large results: its own bucket only, read by direct gets (a meta get, then its chunks).
               *_direct_read(_obj(results_bucket(me)))]
        sub = [user_statuses(me), inbox]
    elif role == "dashboard":
        # Events by direct gets (no consumer: its deliver subject could be anyone's), a lookup by
        # time (a stored get), and the event subjects themselves as a follower's wake-up.
        pub = [*_direct_read(EVENTS_STREAM), f"{_API}.STREAM.MSG.GET.{EVENTS_STREAM}",
               *_direct_read(_obj(SNAPSHOTS_BUCKET)),  # the fold and past positions start from snapshots
               f"{_API}.STREAM.INFO.*", f"{_API}.STREAM.NAMES", f"{_API}.STREAM.LIST",
               f"{_API}.INFO", DISPATCHER_STATE,
               # the queue view: each model's work-queue consumer (pending counts), listed a page at a time
               f"{_API}.CONSUMER.LIST.{REQUESTS_STREAM}", f"{_API}.CONSUMER.INFO.{REQUESTS_STREAM}.*"]
        sub = [EVENTS_ALL, inbox]
    else:
        raise InvalidCommand(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub}, "allow_responses": role != "dashboard"}


def server_config(users: list[Creds]) -> str:
    """The `authorization` block of a nats-server config (the payload limit is the server's own setting).

    Values are JSON (which nats-server's config format reads), so subjects such as `$JS.API.>` are
    quoted strings, never variables. Usable as the whole config (`-c`) or `include`d by another.
    """
    clients = tuple(sorted({c.name for c in users if c.role == "client"}))
    entries = [{"user": c.user, "password": c.password,
                "permissions": permissions(c.role, name=c.name, node_id=c.node_id, clients=clients)} for c in users]
    return (f"# Generated by ndif (controlplane/ops/auth.py): one user per role. Keep it private (0600).\n"
            f"authorization: {json.dumps({'users': entries}, indent=2)}\n")


def make_creds(role: str, *, name: str = "", node_id: str = "") -> Creds:
    if role not in ROLES:
        raise InvalidCommand(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if role == "agent" and not node_id:
        raise InvalidCommand("an agent's credentials are for one node: give its node id")
    return Creds(role=role, user=user_name(role, name=name, node_id=node_id), password=secrets.token_urlsafe(24),
                 name=name, node_id=node_id)


@dataclass
class LocalAuth:
    """The credentials `ndif up` made: the server config path and every user."""

    config_path: Path
    users: dict[str, Creds]

    def role(self, role: str) -> Creds:
        return self.users[role]


def ensure_local(node_ids: list[str], *, clients: list[str] | None = None, home: Path | None = None) -> LocalAuth:
    """Credentials for every role (made once, kept) and the server config written from them (0600)."""
    clients = clients or [local_client_name()]
    wanted: list[tuple[str, str, str]] = [(r, "", "") for r in ("admin", "controller", "dispatcher", "dashboard")]
    wanted += [("client", _check_name(c, "client name"), "") for c in clients]
    wanted += [("agent", "", n) for n in node_ids]
    users: dict[str, Creds] = {}
    for role, name, node_id in wanted:
        path = creds_file(role, name=name, node_id=node_id, home=home)
        if path.exists():
            c = load_creds(path)
        else:
            c = make_creds(role, name=name, node_id=node_id)
            save_creds(c, path)
        key = role if role not in ("client", "agent") else f"{role}:{name or node_id}"
        users[key] = c
        if role == "client" and "client" not in users:
            users["client"] = c
        if role == "agent" and "agent" not in users:
            users["agent"] = c
    # Users added by hand earlier (other clients, other nodes) stay in the config.
    for path in sorted(auth_dir(home).glob("*.creds")):
        c = load_creds(path)
        users.setdefault(f"{c.role}:{c.name or c.node_id}" if c.role in ("client", "agent") else c.role, c)
    conf = auth_dir(home) / "nats-auth.conf"
    unique = {c.user: c for c in users.values()}
    _write_private(conf, server_config(list(unique.values())).encode())
    return LocalAuth(config_path=conf, users=users)


def main(argv: list[str] | None = None) -> int:
    """`python -m controlplane.ops.auth --home DIR --node ID... --client NAME...`: credentials and the
    server config for a deployment (deploy/nats/*.conf include the config; each service gets its
    role's file through NDIF_CREDS). Existing credentials are kept; new nodes and clients are added."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m controlplane.ops.auth", description=main.__doc__)
    p.add_argument("--home", type=Path, default=None, help="where auth/ goes (default $NDIF_HOME, ~/.ndif)")
    p.add_argument("--node", action="append", default=[], help="a node id that runs an agent (repeat)")
    p.add_argument("--client", action="append", default=[], help="a client user name (repeat)")
    a = p.parse_args(argv)
    made = ensure_local(a.node, clients=a.client or None, home=a.home)
    print(f"server config: {made.config_path}")
    for key, c in sorted(made.users.items()):
        if key in ("client", "agent"):
            continue
        print(f"  {key:<40} NDIF_CREDS={creds_file(c.role, name=c.name, node_id=c.node_id, home=a.home)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
