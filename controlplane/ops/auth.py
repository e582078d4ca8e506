"""Roles as NATS users in NATS accounts: who may publish and subscribe to what, and where an answer can go.

Accounts close a whole class of hole: nats-server delivers every answer (a JetStream API response,
a publish ack, a direct get's messages, a service's reply) to whatever reply subject the asker
named, and checks that subject against no permission. Inside one account a reply subject can
therefore be any subject the account's streams capture. So the streams, buckets and services live
in the system's account and every untrusted role has an account of its own:

- `NDIF` (the system's, JetStream on): admin (everything; the only one who may create, update or
  delete streams), controller (appends decisions, reads events and heartbeats, answers
  `ndif.cmd.*`, writes the fold's snapshots), dispatcher (requests, statuses, results buckets, replica calls, its drain reports);
- one account per client, named by the client's user name: publishes requests on
  `ndif.req.*.<user>`, kills through `ndif.dispatcher.kill.<user>`, receives `ndif.status.<user>.>`,
  reads its own keys of the status bucket and its own results bucket by direct gets;
- one account per node agent, named by the node's token: appends its own node's observed facts
  (`ndif.evt.node.<ntok>.<ntok>`, `ndif.evt.replica.*.*.<ntok>`, stored in `NDIF_FACTS`, which the log
  sources; it may read a fact back there by sequence, by a direct get) and heartbeat key, reads the
  log by direct gets (its wake-up is the `ndif.evt.>` stream import), and exports its replica endpoints
  `ndif.run.<ntok>.>` to the system, which imports each node's;
- `NDIF_DASHBOARD`: reads the log by direct gets, the dispatcher's state and the request
  consumers' list; writes nothing.

An account reaches the system only through what `NDIF` exports and it imports: services (a request
goes into `NDIF`, its answer comes back through the import's response map to the asking account,
and only there) and streams (messages flow out of `NDIF`, never in). Whatever reply subject a client,
agent or dashboard names, the answer is delivered inside its own account, where no stream listens
and whose imports are only what it may publish anyway. Exports that carry an account's own token
(`ndif.req.*.<user>`, `ndif.status.<user>.>`, a node's event subjects, its heartbeat key, its own
keys' direct gets) are exported with `account_token_position`: the server itself refuses a config
that imports another account's token. Results buckets are exported privately to their owner.
The system's JetStream API is imported under `$JS.NDIF.API` (controlplane/store/credentials.py
`IMPORTED_JS_API`): every account also has the server's own `$JS.API.>`.

Each untrusted account holds at most its role's connections, each with at most its role's
subscriptions (`AccountLimits`, the account's `limits`): one researcher cannot take the server's
descriptors, nor multiply each of her statuses past their product.

Within each account, each user still has an allow list of publish and subscribe subjects and its own
inbox prefix (`_INBOX_<user>.>`). No role outside the system account may create a consumer or read
stream info of the status bucket (which would list every user's request ids).

`ndif up` generates a password per user on first start (`ensure_local`), keeps the credentials
(and the dashboard's operator token) under `$NDIF_HOME/auth/` (0600) and writes the server's config from them; every local command
finds its role's file there (`resolve`). Server-config users and accounts rather than decentralised
JWTs: one file, no operator/account keys to manage. A node or a client is added by making the file
again and restarting the server (each in turn in a cluster): nats-server 2.15 does not wire the
imports of an account that a config reload adds (observed: its requests get "no responders").
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from controlplane.store.credentials import (
    DASHBOARD_ACCOUNT,
    IMPORTED_JS_API,
    JS_API,
    SYSTEM_ACCOUNT,
    Creds,
    _check_client_name,
    _write_private,
    auth_dir,
    creds_file,
    dashboard_token_file,
    ensure_dashboard_token,
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
    FACT_GATE_CONSUMER,
    FACTS_STREAM,
    FIGURES_ANY,
    HEARTBEATS_BUCKET,
    MODEL_EVENTS_ANY,
    NODE_EVENTS_ANY,
    NODE_FACTS_ANY,
    REFUSED_PREFIX,
    REFUSED_STREAM,
    REPLICA_CALLS_ALL,
    REPLICA_DECISIONS_ANY,
    REPLICA_FACTS_ANY,
    REQUEST_STATUS_BUCKET,
    REQUESTS_ALL,
    REQUESTS_STREAM,
    RESULTS_BUCKET,
    SNAPSHOTS_BUCKET,
    STATUS_ALL,
    STATUS_PREFIX,
    command_subject,
    fact_inbox,
    kill_subject,
    node_facts_from,
    node_logs_subjects,
    node_run_subjects,
    node_token,
    refused_subject,
    replica_facts_from,
    results_bucket,
    user_requests,
    user_statuses,
)

ROLES = ("admin", "controller", "agent", "dispatcher", "client", "dashboard")


class AccountLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What an account of an untrusted role may hold on the server at once (the account's `limits`
    in the server config): connections in all, and subscriptions on each connection (nats-server
    applies an account's `max_subscriptions` per connection). Past them the server refuses the
    connection, or the subscription (nats-py then closes that connection). Each subscription to a
    status subject is one more copy of every status, so a client's copies are at most the product.
    An SDK client holds one connection with two subscriptions; an agent one connection for itself
    and one per replica on its node; the dashboard one. Set by `ACCOUNT_LIMIT_SETTINGS`."""

    client_connections: int = 16
    client_subscriptions: int = 16
    agent_connections: int = 512
    agent_subscriptions: int = 512
    dashboard_connections: int = 16
    dashboard_subscriptions: int = 256

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AccountLimits:
        got: dict[str, int] = {}
        for field, name in ACCOUNT_LIMIT_SETTINGS.items():
            raw = env.get(name)
            if not raw:
                continue
            try:
                got[field] = int(raw)
            except ValueError:
                raise InvalidCommand(f"{name}={raw!r}: a whole number") from None
            if not 1 <= got[field] <= MAX_ACCOUNT_LIMIT:
                raise InvalidCommand(f"{name}={raw!r}: 1 to {MAX_ACCOUNT_LIMIT:,}")
        return cls(**got)

    def of(self, role: str) -> dict[str, int] | None:
        """The `limits` block of an account of `role` (None: the system's, which runs the service)."""
        if role not in ("client", "agent", "dashboard"):
            return None
        return {"max_connections": getattr(self, f"{role}_connections"),
                "max_subscriptions": getattr(self, f"{role}_subscriptions")}


MAX_ACCOUNT_LIMIT = 1_000_000  # nats-server keeps each limit in 32 bits: a larger one would wrap, not bound
ACCOUNT_LIMIT_SETTINGS = {  # AccountLimits field -> the environment setting that sets it
    "client_connections": "NDIF_CLIENT_MAX_CONNECTIONS",
    "client_subscriptions": "NDIF_CLIENT_MAX_SUBSCRIPTIONS",
    "agent_connections": "NDIF_AGENT_MAX_CONNECTIONS",
    "agent_subscriptions": "NDIF_AGENT_MAX_SUBSCRIPTIONS",
    "dashboard_connections": "NDIF_DASHBOARD_MAX_CONNECTIONS",
    "dashboard_subscriptions": "NDIF_DASHBOARD_MAX_SUBSCRIPTIONS",
}


# ---- permissions and accounts -------------------------------------------------------------------

_API = JS_API


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


class Import(NamedTuple):
    """One subject an account takes from the system's: a service (requests in, answers back to the
    asker only) or a stream (messages out of the system). `to`: the subject in the importing account
    (the system's JetStream API under `$JS.NDIF.API`); "" when it is the same."""

    kind: str  # "service" | "stream"
    subject: str  # as the system's account has it
    to: str = ""

    @property
    def local(self) -> str:
        return self.to or self.subject


def _api_import(api_subject: str) -> Import:
    """A JetStream API subject of the system's account, imported under `$JS.NDIF.API`."""
    assert api_subject.startswith(f"{JS_API}.")
    return Import("service", api_subject, IMPORTED_JS_API + api_subject[len(JS_API):])


def system_subject(local: str) -> str:
    """Where a subject published in an importing account arrives in the system's (`$JS.NDIF.API.x` -> `$JS.API.x`)."""
    if local.startswith(f"{IMPORTED_JS_API}."):
        return JS_API + local[len(IMPORTED_JS_API):]
    return local


def _log_reader_imports() -> list[Import]:
    """Reading the event log without a consumer: direct gets (by batch, by subject), its info, a
    lookup by time; the event subjects themselves as a follower's wake-up."""
    ev = EVENTS_STREAM
    sn = _obj(SNAPSHOTS_BUCKET)  # its fold starts from the newest snapshot, read by direct gets
    return [Import("stream", EVENTS_ALL),
            *(_api_import(f"{JS_API}.{x}") for x in (f"DIRECT.GET.{ev}", f"DIRECT.GET.{ev}.>", f"STREAM.INFO.{ev}",
                                                      f"STREAM.MSG.GET.{ev}", f"DIRECT.GET.{sn}",
                                                      f"DIRECT.GET.{sn}.>"))]


def imports(role: str, *, name: str = "", node_id: str = "") -> list[Import]:
    """What the account of a client, an agent or the dashboard imports from the system's ([] for its own roles)."""
    st, hb = REQUEST_STATUS_BUCKET, HEARTBEATS_BUCKET
    if role == "client":
        me = _check_client_name(name)
        res = _obj(results_bucket(me))
        return [Import("service", user_requests(me)), Import("service", kill_subject(me)),
                Import("stream", user_statuses(me)),
                _api_import(f"{JS_API}.DIRECT.GET.{_kv(st)}.$KV.{st}.{me}.>"),
                # Large results: its own bucket, by direct gets (a meta get, then its chunks)
                _api_import(f"{JS_API}.DIRECT.GET.{res}"), _api_import(f"{JS_API}.DIRECT.GET.{res}.>")]
    if role == "agent":
        ntok = node_token(node_id)
        return [Import("service", fact_inbox(node_facts_from(ntok))),
                Import("service", fact_inbox(replica_facts_from(ntok))),
                # a fact's duplicate ack is checked by reading that message back (by sequence)
                _api_import(f"{JS_API}.DIRECT.GET.{FACTS_STREAM}"),
                # the fact gate's last refusal of its own facts (an append ends refused, with why)
                _api_import(f"{JS_API}.DIRECT.GET.{REFUSED_STREAM}.{refused_subject(ntok, '*')}"),
                Import("service", f"$KV.{hb}.{ntok}"),
                # its own node's last heartbeat (a node id held by a live agent is not taken twice)
                _api_import(f"{JS_API}.DIRECT.GET.{_kv(hb)}.$KV.{hb}.{ntok}"), *_log_reader_imports()]
    if role == "dashboard":
        # the queue view: the dispatcher's state, each model's work-queue consumer (pending counts)
        return [*_log_reader_imports(), Import("service", DISPATCHER_STATE),
                _api_import(f"{JS_API}.CONSUMER.LIST.{REQUESTS_STREAM}")]
    return []


def _exports(clients: list[str], readers: list[str], agents: list[str]) -> list[dict[str, Any]]:
    """The system account's exports. Those that carry the importer's token in a subject require it
    there (`account_token_position`, 1-based): the server refuses an import of another account's."""
    st, hb, ev = REQUEST_STATUS_BUCKET, HEARTBEATS_BUCKET, EVENTS_STREAM
    out: list[dict[str, Any]] = [
        {"service": user_requests("*"), "account_token_position": 4},  # ndif.req.<mtok>.<user>
        {"service": kill_subject("*"), "account_token_position": 4},  # ndif.dispatcher.kill.<user>
        {"stream": f"{STATUS_PREFIX}.*.>", "account_token_position": 3},  # ndif.status.<user>.<id>
        {"service": f"{JS_API}.DIRECT.GET.{_kv(st)}.$KV.{st}.*.>", "account_token_position": 8},
        {"service": fact_inbox(node_facts_from("*")), "account_token_position": 4},  # ndif.fact.node.<ntok>.<ntok>
        {"service": fact_inbox(replica_facts_from("*")), "account_token_position": 6},  # ndif.fact.replica.<m>.<r>.<ntok>
        {"service": f"{JS_API}.DIRECT.GET.{REFUSED_STREAM}.{refused_subject('*', '*')}", "account_token_position": 8},
        {"service": f"$KV.{hb}.*", "account_token_position": 3},
        {"service": f"{JS_API}.DIRECT.GET.{_kv(hb)}.$KV.{hb}.*", "account_token_position": 8},
    ]
    # An export with an empty account list would be public: each is written only with its accounts.
    if agents:
        out += [{"service": f"{JS_API}.DIRECT.GET.{FACTS_STREAM}", "response_type": "stream", "accounts": agents}]
    if readers:
        out += [{"stream": EVENTS_ALL, "accounts": readers},
                {"service": f"{JS_API}.DIRECT.GET.{ev}", "response_type": "stream", "accounts": readers},
                {"service": f"{JS_API}.DIRECT.GET.{ev}.>", "accounts": readers},
                {"service": f"{JS_API}.STREAM.INFO.{ev}", "accounts": readers},
                {"service": f"{JS_API}.STREAM.MSG.GET.{ev}", "accounts": readers},
                {"service": f"{JS_API}.DIRECT.GET.{_obj(SNAPSHOTS_BUCKET)}", "response_type": "stream",
                 "accounts": readers},
                {"service": f"{JS_API}.DIRECT.GET.{_obj(SNAPSHOTS_BUCKET)}.>", "accounts": readers}]
    if DASHBOARD_ACCOUNT in readers:
        out += [{"service": DISPATCHER_STATE, "accounts": [DASHBOARD_ACCOUNT]},
                {"service": f"{JS_API}.CONSUMER.LIST.{REQUESTS_STREAM}", "accounts": [DASHBOARD_ACCOUNT]}]
    for c in clients:  # a bucket per user: private exports (its name is no subject token of its own)
        res = _obj(results_bucket(c))
        out += [{"service": f"{JS_API}.DIRECT.GET.{res}", "response_type": "stream", "accounts": [c]},
                {"service": f"{JS_API}.DIRECT.GET.{res}.>", "accounts": [c]}]
    return out


# A replica call's answer may come long after the call (a long generation); the server keeps the
# way back to the dispatcher this long (its default is 2 minutes).
REPLICA_CALL_RESPONSE_THRESHOLD = "30m"


def permissions(role: str, *, name: str = "", node_id: str = "", clients: tuple[str, ...] = ()) -> dict[str, Any]:
    """The server-side permissions of one user inside its account (nats-server `permissions` block).

    `clients`: every client user's name (the dispatcher gets the results bucket of each)."""
    inbox = f"_INBOX_{user_name(role, name=name, node_id=node_id)}.>"
    pub: list[str]
    sub: list[str]
    events = _read_stream(EVENTS_STREAM)
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "controller":
        pub = [MODEL_EVENTS_ANY, REPLICA_DECISIONS_ANY, NODE_EVENTS_ANY, COMMAND_EVENTS_ANY, *events,
               # its fact gate: the facts stream in order, the admitted into the log, the refused kept
               NODE_FACTS_ANY, REPLICA_FACTS_ANY, f"{REFUSED_PREFIX}.*.*",
               f"{_API}.CONSUMER.MSG.NEXT.{FACTS_STREAM}.{FACT_GATE_CONSUMER}",
               f"{_API}.CONSUMER.INFO.{FACTS_STREAM}.{FACT_GATE_CONSUMER}",
               f"$JS.ACK.{FACTS_STREAM}.{FACT_GATE_CONSUMER}.>",
               *_read_stream(_kv(HEARTBEATS_BUCKET)), *_snapshot_writer(),
               f"{_API}.STREAM.INFO.{REQUESTS_STREAM}", f"{_API}.STREAM.INFO.{_kv(REQUEST_STATUS_BUCKET)}",
               f"{_API}.STREAM.INFO.{_obj(RESULTS_BUCKET)}", f"{_API}.STREAM.INFO.{_obj(SNAPSHOTS_BUCKET)}"]
        sub = [COMMANDS_ANY, FIGURES_ANY, inbox]
    elif role == "dispatcher":
        pub = [fact_inbox(replica_facts_from(DISPATCHER_SOURCE)), f"{_API}.DIRECT.GET.{FACTS_STREAM}",  # its facts, read back
               f"{_API}.DIRECT.GET.{REFUSED_STREAM}.{refused_subject(DISPATCHER_SOURCE, '*')}",  # the gate's refusals
               command_subject("deploy"), FIGURES_ANY, STATUS_ALL, REPLICA_CALLS_ALL,
               f"$KV.{REQUEST_STATUS_BUCKET}.>", f"$O.{RESULTS_BUCKET}.>", *events,
               *_read_stream(_kv(REQUEST_STATUS_BUCKET)), *_read_stream(_obj(RESULTS_BUCKET)),
               *_read_stream(REQUESTS_STREAM), *_direct_read(_obj(SNAPSHOTS_BUCKET)),
               f"{_API}.CONSUMER.DURABLE.CREATE.{REQUESTS_STREAM}.>",
               f"{_API}.CONSUMER.MSG.NEXT.{REQUESTS_STREAM}.>", f"$JS.ACK.{REQUESTS_STREAM}.>",
               # requests for models the log does not know: refused ones deleted, stale consumers swept
               f"{_API}.STREAM.MSG.DELETE.{REQUESTS_STREAM}", f"{_API}.CONSUMER.LIST.{REQUESTS_STREAM}",
               *(x for c in clients for x in _results_writer(_check_client_name(c)))]
        sub = [REQUESTS_ALL, DISPATCHER_STATE, DISPATCHER_KILL, kill_subject("*"), inbox]
    elif role in ("client", "agent", "dashboard"):
        # Exactly what its account imports: services to publish to, streams to subscribe to.
        got = imports(role, name=name, node_id=node_id)
        pub = [i.local for i in got if i.kind == "service"]
        sub = [i.local for i in got if i.kind == "stream"] + [inbox]
        if role == "agent":
            sub.insert(0, node_run_subjects(node_id))  # its own node's replica endpoints, which it exports
            sub.insert(1, node_logs_subjects(node_id))  # its own node's replicas' logs, asked by the admin only
    else:
        raise InvalidCommand(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    # Only the roles that answer requests publish on the reply subjects they are given.
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub},
            "allow_responses": role in ("controller", "dispatcher", "agent")}


def accounts(users: list[Creds], limits: AccountLimits | None = None) -> dict[str, Any]:
    """The `accounts` block of the server config: the system's account (JetStream, exports, each
    node's replica endpoints imported) and one account per client, per node agent, for the dashboard,
    each with its role's `limits`."""
    limits = limits or AccountLimits()
    for c in users:
        if c.role not in ROLES:
            raise InvalidCommand(f"user {c.user}: unknown role {c.role!r}")
    clients = sorted({c.name for c in users if c.role == "client"})
    by_account: dict[str, list[Creds]] = {}
    for c in users:
        by_account.setdefault(c.account, []).append(c)
    for acc, members in by_account.items():
        kinds = {(c.role, c.name, c.node_id) for c in members}
        if acc != SYSTEM_ACCOUNT and len(kinds) > 1:  # e.g. a client named like a node's token
            raise InvalidCommand(f"account {acc!r} would hold {', '.join(sorted(c.user for c in members))}: "
                                 "give the client another name")
    readers = sorted(a for a, ms in by_account.items() if ms[0].role in ("agent", "dashboard"))

    def user_entry(c: Creds) -> dict[str, Any]:
        return {"user": c.user, "password": c.password,
                "permissions": permissions(c.role, name=c.name, node_id=c.node_id, clients=tuple(clients))}

    agents = sorted((c for c in users if c.role == "agent"), key=lambda c: c.account)
    system: dict[str, Any] = {
        "jetstream": "enabled",
        "users": [user_entry(c) for c in by_account.get(SYSTEM_ACCOUNT, [])],
        "exports": _exports(clients, readers, sorted({a.account for a in agents})),
        "imports": [{"service": {"account": c.account, "subject": subject(c.node_id)}}
                    for c in {a.account: a for a in agents}.values()
                    for subject in (node_run_subjects, node_logs_subjects)],
    }
    out: dict[str, Any] = {SYSTEM_ACCOUNT: system}
    for acc, members in sorted(by_account.items()):
        if acc == SYSTEM_ACCOUNT:
            continue
        first = members[0]
        entry: dict[str, Any] = {"users": [user_entry(c) for c in members]}
        if (held := limits.of(first.role)) is not None:
            entry["limits"] = held
        entry["imports"] = [{i.kind: {"account": SYSTEM_ACCOUNT, "subject": i.subject}, **({"to": i.to} if i.to else {})}
                            for i in imports(first.role, name=first.name, node_id=first.node_id)]
        if first.role == "agent":
            entry["exports"] = [{"service": node_run_subjects(first.node_id), "accounts": [SYSTEM_ACCOUNT],
                                 "response_threshold": REPLICA_CALL_RESPONSE_THRESHOLD},
                                # the admin's `ndif logs` (in the system's account only the admin may publish there)
                                {"service": node_logs_subjects(first.node_id), "accounts": [SYSTEM_ACCOUNT]}]
        out[acc] = entry
    return out


def server_config(users: list[Creds], limits: AccountLimits | None = None) -> str:
    """The `accounts` block of a nats-server config (the payload limit is the server's own setting).

    Values are JSON (which nats-server's config format reads), so subjects such as `$JS.API.>` are
    quoted strings, never variables. Usable as the whole config (`-c`) or `include`d by another.
    """
    return (f"# Generated by ndif (controlplane/ops/auth.py): one user per role, the system's account and one\n"
            f"# account per client, node agent and the dashboard. Keep it private (0600).\n"
            f"accounts: {json.dumps(accounts(users, limits), indent=2)}\n")


def make_creds(role: str, *, name: str = "", node_id: str = "") -> Creds:
    if role not in ROLES:
        raise InvalidCommand(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if role == "agent" and not node_id:
        raise InvalidCommand("an agent's credentials are for one node: give its node id")
    return Creds(role=role, user=user_name(role, name=name, node_id=node_id), password=secrets.token_urlsafe(24),
                 name=name, node_id=node_id)


@dataclass
class LocalAuth:
    """The credentials `ndif up` made: the server config path, every user and the dashboard's token."""

    config_path: Path
    users: dict[str, Creds]
    dashboard_token: str | None = None

    def role(self, role: str) -> Creds:
        return self.users[role]


def ensure_local(node_ids: list[str], *, clients: list[str] | None = None, home: Path | None = None,
                 limits: AccountLimits | None = None) -> LocalAuth:
    """Credentials for every role (made once, kept), the server config written from them (with
    `limits`; None: the defaults) and the dashboard's operator token (`auth/dashboard.token`), all
    0600 in a 0700 directory."""
    clients = clients or [local_client_name()]
    wanted: list[tuple[str, str, str]] = [(r, "", "") for r in ("admin", "controller", "dispatcher", "dashboard")]
    wanted += [("client", _check_client_name(c), "") for c in clients]
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
    _write_private(conf, server_config(list(unique.values()), limits).encode())
    return LocalAuth(config_path=conf, users=users, dashboard_token=ensure_dashboard_token(home))


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
    made = ensure_local(a.node, clients=a.client or None, home=a.home, limits=AccountLimits.from_env(os.environ))
    print(f"server config: {made.config_path}")
    for key, c in sorted(made.users.items()):
        if key in ("client", "agent"):
            continue
        print(f"  {key:<40} NDIF_CREDS={creds_file(c.role, name=c.name, node_id=c.node_id, home=a.home)}")
    print(f"dashboard operator token: {dashboard_token_file(a.home)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
