"""Credentials: who a process is on NATS, where its file lives, and which one a local command uses.

A `Creds` is one NATS user (role, user name, password, subject token). `ndif up` makes them
(controlplane/ops/auth.py, with the server config); services, the CLI and the SDK only read them:
`resolve(role, url=...)` finds the file a local command of that role uses.

Each user lives in a NATS account (controlplane/ops/auth.py): the system's (`NDIF`: admin,
controller, dispatcher), which holds the streams, or one of its own (each client, each node's
agent, the dashboard), which reaches the system's JetStream API only under the imported prefix
`$JS.NDIF.API` (`Creds.js_api`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

from schemas.errors import InvalidCommand
from schemas.subjects import node_token

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

SYSTEM_ACCOUNT = "NDIF"  # the streams, buckets and services, and the roles that run them
DASHBOARD_ACCOUNT = "NDIF_DASHBOARD"
SYSTEM_ROLES = frozenset({"admin", "controller", "dispatcher"})
# Names a client may not take (its account is named by it): the system's accounts, and the
# dispatcher's source token on replica facts. Account names are case-sensitive.
RESERVED_NAMES = frozenset({SYSTEM_ACCOUNT, DASHBOARD_ACCOUNT, "dispatcher"})
JS_API = "$JS.API"  # the JetStream API in the account that has JetStream (and on an open server)
# The system's JetStream API as the other accounts import it: every account also has the server's own
# `$JS.API.>` (which answers "JetStream not enabled for account"), so an import under the same
# name would race that answer.
IMPORTED_JS_API = f"$JS.{SYSTEM_ACCOUNT}.API"


class Creds(msgspec.Struct, frozen=True, kw_only=True):
    """One user's credentials: `name` is its subject token (client users, agent node tokens)."""

    role: str
    user: str
    password: str
    name: str = ""
    node_id: str = ""

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX_{self.user}"

    def connect_options(self) -> dict[str, Any]:
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}

    @property
    def account(self) -> str:
        """The NATS account this user is in (the server config puts it there)."""
        return account_name(self.role, name=self.name, node_id=self.node_id)

    @property
    def js_api(self) -> str:
        """The JetStream API prefix this user reaches the system's streams under."""
        return JS_API if self.role in SYSTEM_ROLES else IMPORTED_JS_API


def js_api(creds: Creds | None) -> str:
    """The JetStream API prefix of `creds` (`$JS.API` without a user: an open server)."""
    return JS_API if creds is None else creds.js_api


def account_name(role: str, *, name: str = "", node_id: str = "") -> str:
    """The account of a role's user: `NDIF` (the system's), `NDIF_DASHBOARD`, a client's own name,
    a node's token. A client's and a node's account is named by the subject token that the system's
    exports require in that position (`account_token_position`), so the server itself checks that an
    account imports only its own subjects."""
    if role in SYSTEM_ROLES:
        return SYSTEM_ACCOUNT
    if role == "dashboard":
        return DASHBOARD_ACCOUNT
    if role == "agent":
        return node_token(node_id)
    return _check_client_name(name)


def _check_client_name(name: str) -> str:
    _check_name(name, "client name")
    if name in RESERVED_NAMES:
        raise InvalidCommand(f"client name {name!r} is reserved (one of {', '.join(sorted(RESERVED_NAMES))})")
    return name


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise InvalidCommand(f"{what} {name!r}: 1-64 characters of [A-Za-z0-9_-]")
    return name


def user_name(role: str, *, name: str = "", node_id: str = "") -> str:
    if role == "agent":
        return f"agent-{node_token(node_id)}"
    if role == "client":
        return f"client-{_check_client_name(name)}"
    return role


def request_msg_id(request_id: str, creds: Creds | None) -> str:
    """The `Nats-Msg-Id` a client stores its request under: `<user>.<mac>.<request id>`, where
    `mac` is keyed by the client's own password, so no other user can compute it.

    The request stream deduplicates by this id across all users, and no permission can check a
    header: with a guessable id (`<user>.<request id>`) anyone could publish first under another
    user's future id and have the victim's request dropped as a duplicate. A resend of the same
    request by its owner still gets the same id (stored once). Without a client's credentials (an
    open server) it is the request id alone. The last token is the request id, as readers expect.
    """
    if creds is None or creds.role != "client":
        return request_id
    mac = hmac.new(creds.password.encode(), f"{creds.user}.{request_id}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"{creds.name}.{mac}.{request_id}"


def msg_id_problem(msg_id: str, *, user: str, request_id: str) -> str | None:
    """Why a stored request's dedup id is not one its owner would send, or None.

    The server checks no header, so a client may store its own request under any `Nats-Msg-Id`.
    With a user the id must name that user (the subject's) and the request: `<user>.<mac>.<request
    id>` (`request_msg_id`; the mac is not checkable without the owner's password). A request without
    one, or on an open server (no user), is not refused here."""
    if not msg_id or not user:
        return None
    parts = msg_id.split(".")
    if len(parts) != 3 or parts[0] != user or parts[2] != request_id:
        return (f"the request's dedup id (Nats-Msg-Id {msg_id[:200]!r}) does not name its user {user!r} and "
                f"request id {request_id!r} as <user>.<mac>.<request id>")
    return None


# ---- files under $NDIF_HOME ---------------------------------------------------------------------


def ndif_home() -> Path:
    return Path(os.environ.get("NDIF_HOME") or (Path.home() / ".ndif"))


def auth_dir(home: Path | None = None) -> Path:
    return (home or ndif_home()) / "auth"


def creds_file(role: str, *, name: str = "", node_id: str = "", home: Path | None = None) -> Path:
    d = auth_dir(home)
    if role == "agent":
        return d / f"agent-{node_token(node_id)}.creds"
    if role == "client":
        return d / f"client-{name}.creds"
    return d / f"{role}.creds"


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def load_creds(path: Path) -> Creds:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Creds)
    except (OSError, msgspec.DecodeError) as exc:
        raise InvalidCommand(f"credentials file {path}: {exc}") from None


def save_creds(c: Creds, path: Path) -> None:
    _write_private(path, msgspec.json.encode(c))


def nats_context(c: Creds, url: str) -> dict[str, str]:
    """The `nats` CLI's context (its `~/.config/nats/context/<name>.json` format: url, user, password,
    inbox_prefix, jetstream_api_prefix) for one user: any NATS client can connect with these values
    alone. A user outside the system's account reaches JetStream under `IMPORTED_JS_API`."""
    ctx = {"description": f"ndif {c.role} user {c.user}", "url": url, "user": c.user, "password": c.password,
           "inbox_prefix": c.inbox_prefix}
    if c.account != SYSTEM_ACCOUNT:
        ctx["jetstream_api_prefix"] = IMPORTED_JS_API
    return ctx


def write_nats_contexts(users: list[Creds], url: str, d: Path) -> Path:
    """Write each user's `nats` context to `d/<user>.json` (`ndif up`: `$NDIF_HOME/auth/nats-context/`;
    0600; written again on each start, since the URL may change); returns `d`."""
    for c in users:
        _write_private(d / f"{c.user}.json", json.dumps(nats_context(c, url), indent=2).encode() + b"\n")
    return d


# ---- the dashboard's operator token -------------------------------------------------------------

DASHBOARD_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{32,128}$")  # printed in a URL: URL-safe, never guessed


def new_dashboard_token() -> str:
    """A fresh operator token for the dashboard (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def check_dashboard_token(token: str) -> str:
    if not DASHBOARD_TOKEN_RE.match(token):
        raise InvalidCommand("a dashboard token is 32-128 characters of [A-Za-z0-9_-]")
    return token


def dashboard_token_file(home: Path | None = None) -> Path:
    return auth_dir(home) / "dashboard.token"


def ensure_dashboard_token(home: Path | None = None) -> str:
    """The dashboard's operator token, kept in `$NDIF_HOME/auth/dashboard.token` (0600; made on first use)."""
    path = dashboard_token_file(home)
    if path.exists():
        try:
            return check_dashboard_token(path.read_text().strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidCommand(f"dashboard token file {path}: {exc}") from None
    token = new_dashboard_token()
    _write_private(path, token.encode() + b"\n")
    return token


def local_client_name() -> str:
    """The client user of this machine's person (from $USER, made subject-safe)."""
    raw = os.environ.get("NDIF_CLIENT_NAME") or os.environ.get("USER") or "local"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:64] or "local"


def _loopback(url: str) -> bool:
    hosts = [urlparse(u.strip() if "://" in u else f"nats://{u.strip()}").hostname for u in url.split(",")]
    return all(h in ("127.0.0.1", "localhost", "::1") for h in hosts)


_OPEN_SERVERS: set[str] = set()


def mark_open(url: str) -> None:
    """This process runs the server at `url` without users (`ndif up --open`, `ndif up --demo`): its
    services and clients send no credentials there, whatever `NDIF_CREDS` or `$NDIF_HOME/auth/` hold
    (a user of an account would ask JetStream under its account's API prefix, which an open server
    does not answer)."""
    _OPEN_SERVERS.add(url)


def resolve(role: str, *, url: str, node_id: str = "", name: str = "") -> Creds | None:
    """The credentials a local command of `role` uses when given none.

    None for a server this process runs open (`mark_open`); else `NDIF_CREDS` (a credentials file)
    wins; else, for a loopback URL, `$NDIF_HOME/auth/`'s file of this role (the client of $USER, the
    agent of `node_id`), if `ndif up` made one; else None (an open server). Local files are never
    sent to a remote server.
    """
    if url in _OPEN_SERVERS:
        return None
    env = os.environ.get("NDIF_CREDS")
    if env:
        return load_creds(Path(env))
    if not _loopback(url):
        return None
    if role == "client":
        name = name or local_client_name()
    path = creds_file(role, name=name, node_id=node_id)
    return load_creds(path) if path.exists() else None
