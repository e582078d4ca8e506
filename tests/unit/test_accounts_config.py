"""The generated server config's accounts (controlplane/ops/auth.py), checked without a server: only the
system's account has JetStream and users of its own roles, every other account imports only subjects
of its own token, no export is public, and the names that would make two roles share an account are
refused. tests/integration/test_reply_subjects.py checks the same config on a real nats-server."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.ops.auth import AccountLimits, accounts, imports, make_creds, permissions, system_subject
from controlplane.store.credentials import (
    DASHBOARD_ACCOUNT,
    IMPORTED_JS_API,
    JS_API,
    SYSTEM_ACCOUNT,
    account_name,
)
from schemas.errors import InvalidCommand
from schemas.requests import StatusUpdate, encoder, status_or_none
from schemas.status import RequestStatus
from schemas.subjects import node_token

NODES = ("node-a.cluster", "node-b.cluster")
CLIENTS = ("alice", "bob")


def _users() -> list[Any]:
    return ([make_creds(r) for r in ("admin", "controller", "dispatcher", "dashboard")]
            + [make_creds("client", name=c) for c in CLIENTS] + [make_creds("agent", node_id=n) for n in NODES])


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def test_only_the_system_account_has_jetstream_and_its_roles() -> None:
    accs = accounts(_users())
    assert [a for a, e in accs.items() if e.get("jetstream")] == [SYSTEM_ACCOUNT]
    assert {u["user"] for u in accs[SYSTEM_ACCOUNT]["users"]} == {"admin", "controller", "dispatcher"}
    assert set(accs) == {SYSTEM_ACCOUNT, DASHBOARD_ACCOUNT, *CLIENTS, *(node_token(n) for n in NODES)}
    for name, entry in accs.items():
        if name != SYSTEM_ACCOUNT:
            assert len(entry["users"]) == 1, name  # one user per account outside the system's


def test_every_import_is_of_the_importers_own_token_where_the_export_requires_one() -> None:
    """What the server checks for `account_token_position`, here over the whole generated config."""
    accs = accounts(_users())
    exports = accs[SYSTEM_ACCOUNT]["exports"]
    for name, entry in accs.items():
        if name == SYSTEM_ACCOUNT:
            continue
        for imp in entry["imports"]:
            kind = "service" if "service" in imp else "stream"
            subject = imp[kind]["subject"]
            assert imp[kind]["account"] == SYSTEM_ACCOUNT
            found = [e for e in exports if kind in e and _matches(e[kind], subject)]
            assert len(found) == 1, (name, subject, found)  # exactly one export answers for it
            e = found[0]
            if "account_token_position" in e:
                assert subject.split(".")[e["account_token_position"] - 1] == name, (name, subject)
            else:
                assert name in e["accounts"], (name, subject)


def test_no_export_is_public_and_results_buckets_are_their_owners() -> None:
    exports = accounts(_users())[SYSTEM_ACCOUNT]["exports"]
    for e in exports:
        assert e.get("account_token_position") or e.get("accounts"), e  # an empty list would be public
    for c in CLIENTS:
        mine = [e for e in exports if f"ndif_results_{c}" in e.get("service", "")]
        assert mine and all(e["accounts"] == [c] for e in mine)


def test_a_users_permissions_are_its_accounts_imports() -> None:
    for c in _users():
        if c.role in ("admin", "controller", "dispatcher"):
            assert c.js_api == JS_API
            continue
        assert c.js_api == IMPORTED_JS_API
        got = imports(c.role, name=c.name, node_id=c.node_id)
        perms = permissions(c.role, name=c.name, node_id=c.node_id)
        assert perms["publish"]["allow"] == [i.local for i in got if i.kind == "service"]
        assert not any(s.startswith(f"{JS_API}.") for s in perms["publish"]["allow"])  # the system's own API: never
        assert perms["allow_responses"] == (c.role == "agent")  # only an agent answers (its replicas' calls)
        status_api = [s for s in perms["publish"]["allow"] if "STREAM.INFO.KV_ndif_request_status" in s]
        assert status_api == []  # its info would list every user's request ids


def test_imported_api_subjects_arrive_as_the_systems() -> None:
    assert system_subject(f"{IMPORTED_JS_API}.DIRECT.GET.X") == f"{JS_API}.DIRECT.GET.X"
    assert system_subject("ndif.req.m.alice") == "ndif.req.m.alice"


def test_every_untrusted_account_has_its_roles_limits_and_the_system_none() -> None:
    limits = AccountLimits.from_env({"NDIF_CLIENT_MAX_CONNECTIONS": "7", "NDIF_AGENT_MAX_SUBSCRIPTIONS": "99"})
    acc = accounts(_users(), limits)
    assert "limits" not in acc[SYSTEM_ACCOUNT]
    for c in CLIENTS:
        assert acc[account_name("client", name=c)]["limits"] == {"max_connections": 7, "max_subscriptions": 16}
    for n in NODES:
        assert acc[account_name("agent", node_id=n)]["limits"] == {"max_connections": 512, "max_subscriptions": 99}
    assert acc[DASHBOARD_ACCOUNT]["limits"] == {"max_connections": 16, "max_subscriptions": 256}


@pytest.mark.parametrize("raw", ["", "0", "-3", "x", "1.5", "1000001", str(2**32)])
def test_account_limits_from_the_environment_are_whole_positive_numbers(raw: str) -> None:
    env = {"NDIF_DASHBOARD_MAX_CONNECTIONS": raw}
    if raw == "":
        assert AccountLimits.from_env(env) == AccountLimits()  # unset: the default
        return
    with pytest.raises(InvalidCommand, match="NDIF_DASHBOARD_MAX_CONNECTIONS"):
        AccountLimits.from_env(env)


def test_names_that_would_share_an_account_are_refused() -> None:
    ntok = node_token(NODES[0])
    with pytest.raises(InvalidCommand, match="would hold"):
        accounts([*_users(), make_creds("client", name=ntok)])  # a client named like a node's token
    for reserved in (SYSTEM_ACCOUNT, DASHBOARD_ACCOUNT, "dispatcher"):
        with pytest.raises(InvalidCommand, match="reserved"):
            make_creds("client", name=reserved)
    assert account_name("client", name="ndif") == "ndif"  # account names are case-sensitive: a user `ndif` is fine


@given(st.binary(max_size=2048))
def test_a_status_from_arbitrary_bytes_is_a_status_or_none(data: bytes) -> None:
    u = status_or_none(data)
    assert u is None or isinstance(u, StatusUpdate)


def test_status_or_none_refuses_what_msgspec_raises_other_errors_for() -> None:
    from datetime import UTC, datetime

    ok = StatusUpdate(request_id="r", status=RequestStatus.COMPLETED, ts=datetime.now(UTC), user="bob")
    assert status_or_none(encoder.encode(ok)) == ok
    # UnicodeDecodeError inside msgspec
    assert status_or_none(b'{"request_id": "\xff\xfe", "status": "COMPLETED", "ts": "2024-01-01T00:00:00Z"}') is None
    deep = b'{"request_id": "r", "status": "COMPLETED", "ts": "2024-01-01T00:00:00Z", "result": '
    assert status_or_none(deep + b"[" * 5000 + b"]" * 5000 + b"}") is None  # RecursionError inside msgspec
    assert status_or_none(b" " * (600 * 1024)) is None
