"""The dashboard's door: who may ask it anything, under which name, and how many live streams each.

Before any request, the connection itself: at most `per_client` open connections per client
address and `total` in all (past them the oldest that never carried the token makes room, else the
new one is closed unread), and a connection with no request with the token under way for `idle_s`
is closed, so idle, slow or tokenless sockets cannot hold the process's descriptors nor keep the
operator out (`Connections`).

Four checks, in this order, on every request (docs/dashboard.md, "Who can see it"):

- the Host header must name this dashboard: a loopback name, the address it listens on, or a name
  the operator configured (421 otherwise). A page of another site whose name an attacker re-points
  at 127.0.0.1 (DNS rebinding) sends its own name, and is refused before anything is read;
- the operator token: from the URL `ndif up` prints (`/?token=...`, on the page only, which then
  keeps it in an HttpOnly SameSite=Strict cookie), the cookie, or `Authorization: Bearer ...`
  (401 otherwise; compared in constant time). Only `/favicon.ico` is served without it;
- live streams: at most `per_client` per client address and `total` in all (429 / 503);
- security headers on every response: a Content-Security-Policy without inline script or style,
  nosniff, no framing, no referrer.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import hdrs, web

from controlplane.store.credentials import check_dashboard_token, new_dashboard_token

TOKEN_QUERY = "token"
MAX_PRESENTED = 256  # a presented token longer than this is refused unread
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
PUBLIC_PATHS = frozenset({"/favicon.ico"})  # nothing of the cluster in it

SECURITY_HEADERS = {
    # The page is one HTML file, a JS module and a stylesheet of its own; everything else is refused,
    # inline script and style included (the page sets its widths through the CSSOM).
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}

Refusal = tuple[int, str]  # an HTTP status and the reason, in the operator's terms


def host_name(header: str) -> str:
    """The name part of a Host header, lower-cased: `[::1]:8470` -> `::1`, `Example:80` -> `example`."""
    h = header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    name, sep, port = h.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name
    return h


def _literal(name: str) -> str:
    """An IP literal in its canonical form (so `::0001` and `::1` are one name); a name as it is."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


@dataclass
class Door:
    """The token and the names this dashboard answers to (`allowed_names`: the bound address and the
    operator's extra names; loopback names are always in)."""

    token: str
    allowed_names: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def make(cls, token: str | None, *, bound: str, extra: Iterable[str] = ()) -> Door:
        names = {_literal(host_name(n)) for n in (bound, *extra) if n}
        return cls(token=check_dashboard_token(token) if token is not None else new_dashboard_token(),
                   allowed_names=frozenset(names | LOOPBACK_NAMES))

    def host_refusal(self, header: str | None) -> Refusal | None:
        """None when the Host header names this dashboard (its port is not checked: an ssh tunnel or
        a proxy changes it, and a rebinding page cannot change the name)."""
        if not header:
            return 421, "no Host header: this dashboard answers only requests that name it"
        name = _literal(host_name(header))
        if name in self.allowed_names:
            return None
        shown = ", ".join(sorted(self.allowed_names))
        return 421, (f"Host {header[:80]!r} is not a name of this dashboard ({shown}); a page of another site "
                     "pointed at this address is refused. Add the name the dashboard is reached by with "
                     "--allowed-host NAME")

    def token_ok(self, presented: str | None) -> bool:
        if not presented or len(presented) > MAX_PRESENTED:
            return False
        return hmac.compare_digest(presented.encode("utf-8", "replace"), self.token.encode())

    def cookie_name(self, port: int) -> str:
        # Cookies are per host, not per port: two dashboards on one machine keep a cookie each.
        return f"ndif_dashboard_{port}"

    def presented(self, request: web.Request, port: int) -> str | None:
        """The token a request carries: its Bearer header, else its cookie."""
        auth = request.headers.get(hdrs.AUTHORIZATION, "")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip()
        return request.cookies.get(self.cookie_name(port))


@dataclass
class StreamSlots:
    """Live streams held, per client address and in all. `take` before the first await of a stream
    (so concurrent requests cannot all pass the check), `give` when it ends."""

    total: int
    per_client: int
    held: Counter[str] = field(default_factory=Counter)

    def __len__(self) -> int:
        return sum(self.held.values())

    def take(self, client: str) -> Refusal | None:
        if self.held[client] >= self.per_client:
            return 429, (f"{client} already holds {self.held[client]} live streams, the most one client address "
                         f"may hold; close a dashboard page (or its other connections) first")
        if len(self) >= self.total:
            return 503, f"all {self.total} live streams of this dashboard are taken; try again later"
        self.held[client] += 1
        return None

    def give(self, client: str) -> None:
        self.held[client] -= 1
        if self.held[client] <= 0:
            del self.held[client]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def door_middleware(door: Door, port: Callable[[], int], refuse: Callable[[int, str], web.StreamResponse],
                    passed: Callable[[web.Request], None] = lambda _: None) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Host check, then the token (`port()`: the port the dashboard listens on, for its cookie's
    name); `passed` is told of each request that carried it."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        bad_host = door.host_refusal(request.headers.get(hdrs.HOST))
        if bad_host is not None:
            return refuse(*bad_host)
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        # The printed URL carries the token for the page only: it is kept in the cookie from there.
        in_query = request.query.get(TOKEN_QUERY) if request.path == "/" else None
        presented = in_query if in_query is not None else door.presented(request, port())
        if not door.token_ok(presented):
            resp = refuse(401, "this dashboard needs its operator token: open the URL `ndif up` (or `ndif "
                               "dashboard`) printed, with its ?token=..., or send `Authorization: Bearer TOKEN` "
                               "(the token is in $NDIF_HOME/auth/dashboard.token)")
            resp.headers[hdrs.WWW_AUTHENTICATE] = 'Bearer realm="ndif dashboard"'
            return resp
        passed(request)
        resp = await handler(request)
        if in_query is not None:
            resp.set_cookie(door.cookie_name(port()), door.token, path="/", httponly=True, samesite="Strict")
        return resp

    return guard


async def add_security_headers(request: web.Request, resp: web.StreamResponse) -> None:
    """`on_response_prepare`: every response, refusals and the live stream included."""
    for k, v in SECURITY_HEADERS.items():
        resp.headers[k] = v
    resp.headers.setdefault(hdrs.CACHE_CONTROL, "no-store")


MAX_CONNECTIONS = 512  # open TCP connections in all
MAX_CONNECTIONS_PER_ADDRESS = 64  # one client address's (a browser opens about 6 to a host)
IDLE_S = 15.0  # a connection with no request under way this long is closed (a slow request head too)


@dataclass(eq=False)
class Connections:
    """Open connections, per client address and in all, each with its requests under way and when it
    last had one that carried the token: `admit` on connect, `begin`/`end` around each request,
    `trusted` when a request passed the token check, `release` when it closes.

    Past a cap, the oldest connection that never carried the token and has nothing under way is
    closed to make room (else the new one is closed unread), so connections without the token
    cannot keep the operator out. A connection idle for `idle_s` is closed by its own timer; only
    a request with the token makes it less idle (one without lives `idle_s` from its connect)."""

    total: int = MAX_CONNECTIONS
    per_client: int = MAX_CONNECTIONS_PER_ADDRESS
    idle_s: float = IDLE_S
    held: Counter[str] = field(default_factory=Counter)
    _open: dict[asyncio.BaseTransport, _Conn] = field(default_factory=dict)  # oldest first

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self.held[client] >= self.per_client and not self._make_room(client):
            return False
        if len(self._open) >= self.total and not self._make_room(None):
            return False
        self.held[client] += 1
        conn = self._open[transport] = _Conn(client)
        conn.timer = asyncio.get_running_loop().call_later(self.idle_s, self._check, transport)
        return True

    def _make_room(self, client: str | None) -> bool:
        """Close the oldest untrusted connection with nothing under way (of `client`, or of anyone)."""
        for transport, conn in self._open.items():
            if not conn.trusted and conn.busy == 0 and client in (None, conn.client):
                self.release(transport)
                transport.close()
                return True
        return False

    def begin(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None and (conn := self._open.get(transport)) is not None:
            conn.busy += 1

    def trusted(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None and (conn := self._open.get(transport)) is not None:
            conn.trusted = True

    def end(self, transport: asyncio.BaseTransport | None) -> None:
        if transport is not None and (conn := self._open.get(transport)) is not None:
            conn.busy -= 1
            if conn.trusted:
                conn.last = time.monotonic()

    def release(self, transport: asyncio.BaseTransport) -> None:
        conn = self._open.pop(transport, None)
        if conn is None:
            return
        if conn.timer is not None:
            conn.timer.cancel()
        self.held[conn.client] -= 1
        if self.held[conn.client] <= 0:
            del self.held[conn.client]

    def _check(self, transport: asyncio.BaseTransport) -> None:
        conn = self._open.get(transport)
        if conn is None:
            return
        idle = time.monotonic() - conn.last
        # an answer still being written to a slow reader is a request under way too
        writing = isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size() > 0
        if conn.busy == 0 and not writing and idle >= self.idle_s:
            transport.close()
            return
        wait = self.idle_s if conn.busy or writing else self.idle_s - idle
        conn.timer = asyncio.get_running_loop().call_later(wait, self._check, transport)


@dataclass(eq=False)
class _Conn:
    client: str
    busy: int = 0
    trusted: bool = False  # a request on it carried the operator token
    last: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None


class GuardedProtocol(asyncio.Protocol):
    """The HTTP server's protocol for one connection, let through only when `Connections` admits it."""

    def __init__(self, inner: asyncio.Protocol, connections: Connections) -> None:
        self.inner = inner
        self.connections = connections
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.connections.admit(transport):
            transport.close()  # nothing read, nothing answered: the cap is for sockets, not for pages
            return
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.transport is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.connections.release(self.transport)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def connections_middleware(connections: Connections) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A request under way keeps its connection from being closed as idle (a live stream for hours)."""

    @web.middleware
    async def under_way(request: web.Request, handler: Handler) -> web.StreamResponse:
        connections.begin(request.transport)
        try:
            return await handler(request)
        finally:
            connections.end(request.transport)

    return under_way
