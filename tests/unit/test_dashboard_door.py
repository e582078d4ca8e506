"""Attacks on the dashboard's door, from outside: real HTTP against the real server (aiohttp on loopback,
the memory log behind it, no NATS needed).

- without the operator token, or with a wrong one, every route but the favicon is refused (401);
- a Host header that is not one of its names (a DNS-rebinding page) is refused (421), token or not;
- one client address cannot take every live-stream slot, even with requests sent all at once;
- nor every connection: past its cap (or the cap in all) a connection is closed unread, and one
  with no request under way (nothing sent, or a request head sent a byte at a time) is closed
  after the idle time, while a live stream stays open for as long as it runs;
- every response carries the security headers, refusals and the live stream included.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.dashboard.door import SECURITY_HEADERS, Connections, Door, StreamSlots, host_name
from controlplane.dashboard.server import MAX_CLIENTS_PER_ADDRESS, Dashboard
from controlplane.service.parts import Parts
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E

TOKEN = "t" * 20 + "0123456789abcdefghij"  # 40 URL-safe characters
ROUTES = ["/", "/static/app.js", "/static/style.css", "/api/state", "/api/events", "/api/history?model=x",
          "/api/queues", "/api/stream", "/api/nothing-here", "/static/nothing.js"]


def _joined(node: str) -> E.NodeJoined:
    return E.NodeJoined(event_id=f"join-{node}", ts=datetime.now(UTC), actor=f"agent:{node}", node_id=node,
                        cpu_cache_bytes=10**9,
                        gpus=(E.GpuInfo(index=0, memory_bytes=80 * 10**9, name="H100"),))


@contextlib.asynccontextmanager
async def dashboard(**kw: Any) -> AsyncIterator[Dashboard]:
    log = MemoryEventLog()
    await log.append([_joined("node-a")], expected_last_seq=0)
    async with Dashboard(Parts(log, None), port=0, token=TOKEN, queue_poll_s=5.0, **kw) as d:
        yield d


def session(local: str | None = None, **kw: Any) -> aiohttp.ClientSession:
    """A client; `local`: the loopback address it connects from (127.0.0.0/8 is all this machine)."""
    conn = aiohttp.TCPConnector(local_addr=(local, 0) if local else None, force_close=True)
    return aiohttp.ClientSession(connector=conn, cookie_jar=aiohttp.CookieJar(unsafe=True), **kw)


async def status_of(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, dict[str, Any] | None]:
    async with http.get(url, allow_redirects=False, **kw) as r:
        body = await r.json(content_type=None) if r.content_type == "application/json" else None
        return r.status, body


# ---- the token -----------------------------------------------------------------------------------


async def test_without_the_token_or_with_a_wrong_one_every_route_is_refused() -> None:
    async with dashboard() as d, session() as http:
        base = d.base_url.rstrip("/")
        wrong = {"none": {}, "wrong bearer": {"headers": {"Authorization": "Bearer " + "x" * 40}},
                 "prefix of it": {"headers": {"Authorization": "Bearer " + TOKEN[:-1]}},
                 "longer": {"headers": {"Authorization": "Bearer " + TOKEN + "x"}},
                 "huge": {"headers": {"Authorization": "Bearer " + "x" * 5000}},
                 "basic": {"headers": {"Authorization": "Basic " + TOKEN}},
                 "wrong cookie": {"cookies": {d.door.cookie_name(d.port): "y" * 40}},
                 "another port's cookie": {"cookies": {d.door.cookie_name(d.port + 1): TOKEN}}}
        for path in ROUTES:
            for what, kw in wrong.items():
                status, body = await status_of(http, base + path, **kw)
                assert status == 401, (path, what, status)
                assert body is not None and "operator token" in body["error"]
        # The token in the query opens the page only, never the API (it would sit in the address bar).
        for path in ("/api/state", "/api/stream", "/static/app.js"):
            assert (await status_of(http, f"{base}{path}?token={TOKEN}"))[0] == 401, path
        assert (await status_of(http, f"{base}/?token={'x' * 43}"))[0] == 401
        assert (await status_of(http, f"{base}/?token=", headers=d.auth_headers()))[0] == 401
        assert len(http.cookie_jar) == 0  # nothing was kept from any refused request
        assert len(d.slots) == 0 and not d.clients  # no stream was opened


async def test_the_token_opens_the_page_which_keeps_it_in_a_strict_http_only_cookie() -> None:
    async with dashboard() as d, session() as http:
        base = d.base_url.rstrip("/")
        assert d.url == f"{d.base_url}?token={TOKEN}"  # what `ndif up` prints
        async with http.get(d.url) as r:
            assert r.status == 200 and "ndif dashboard" in await r.text()
            cookie = r.headers["Set-Cookie"]
        assert f"{d.door.cookie_name(d.port)}={TOKEN}" in cookie
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        for path in ("/", "/api/state", "/static/app.js"):  # the cookie alone, as the page's own requests
            assert (await status_of(http, base + path))[0] == 200, path
        async with http.get(base + "/api/stream") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert (await r.content.readline()).startswith(b": ndif dashboard stream")
    async with dashboard() as d, session(headers=d.auth_headers()) as http:  # an API client: the header
        status, body = await status_of(http, d.base_url + "api/state")
        assert status == 200 and body is not None and body["nodes"][0]["node_id"] == "node-a"


async def test_a_dashboard_without_a_given_token_makes_its_own() -> None:
    log = MemoryEventLog()
    async with Dashboard(Parts(log, None), port=0) as a, Dashboard(Parts(log, None), port=0) as b, session() as http:
        assert a.token != b.token and len(a.token) >= 32
        assert (await status_of(http, a.base_url + "api/state"))[0] == 401
        assert (await status_of(http, a.base_url + "api/state", headers=b.auth_headers()))[0] == 401
        assert (await status_of(http, a.base_url + "api/state", headers=a.auth_headers()))[0] == 200
    with pytest.raises(Exception, match="32-128 characters"):
        Dashboard(Parts(log, None), port=0, token="short")


# ---- the Host header -----------------------------------------------------------------------------


async def test_a_forged_host_header_is_refused_before_anything_is_read() -> None:
    async with dashboard(allowed_hosts=("dash.internal",)) as d, session(headers=d.auth_headers()) as http:
        base = d.base_url.rstrip("/")
        forged = ["evil.example", f"evil.example:{d.port}", "127.0.0.1.nip.io", f"localhost.evil.example:{d.port}",
                  "dash.internal.evil.example", "127.0.0.2", "[::2]", "0.0.0.0", "localhost.", "xn--lcalhost-9za"]
        for host in forged:
            for path in [*ROUTES, f"/?token={TOKEN}", "/favicon.ico"]:
                status, body = await status_of(http, base + path, headers={"Host": host, **d.auth_headers()})
                assert status == 421, (host, path, status)
                assert body is not None and "not a name of this dashboard" in body["error"], body
        assert len(http.cookie_jar) == 0 and len(d.slots) == 0
        # Its own names, on any port (an ssh tunnel or a proxy changes the port, never the name).
        for host in ("localhost", f"localhost:{d.port}", "LOCALHOST:9999", "127.0.0.1:1", "[::1]:8470",
                     "dash.internal", "Dash.Internal:443"):
            assert (await status_of(http, base + "/api/state", headers={"Host": host}))[0] == 200, host


async def test_a_request_without_a_host_header_is_refused() -> None:
    async with dashboard() as d:
        reader, writer = await asyncio.open_connection("127.0.0.1", d.port)
        writer.write(f"GET /api/state HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.read(200), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.0 421") or head.startswith(b"HTTP/1.1 421"), head


def test_host_names_are_read_as_browsers_send_them() -> None:
    assert host_name("[::1]:8470") == "::1" and host_name("Example.COM:80") == "example.com"
    assert host_name("localhost") == "localhost" and host_name("127.0.0.1:8470") == "127.0.0.1"
    door = Door.make(TOKEN, bound="0.0.0.0", extra=["Dash.Example"])
    assert door.host_refusal("0.0.0.0:8470") is None and door.host_refusal("dash.example") is None
    assert door.host_refusal("[0:0:0:0:0:0:0:1]:1") is None  # ::1 however it is written
    assert door.host_refusal("10.1.2.3") is not None and door.host_refusal("") is not None


_ALLOWED = {"localhost", "127.0.0.1", "::1", "dash.example"}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_other_host_is_refused_and_the_check_never_raises(header: str) -> None:
    door = Door.make(TOKEN, bound="127.0.0.1", extra=["dash.example"])
    refused = door.host_refusal(header)
    name = host_name(header)
    try:
        name = str(ipaddress.ip_address(name))
    except ValueError:
        pass
    assert (refused is None) == (name in _ALLOWED)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=300)))
def test_only_the_token_itself_is_accepted_and_the_check_never_raises(presented: str | None) -> None:
    door = Door.make(TOKEN, bound="127.0.0.1")
    assert door.token_ok(presented) == (presented == TOKEN)
    assert door.token_ok(TOKEN)


# ---- live-stream slots ---------------------------------------------------------------------------


async def _open_stream(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       held: list[aiohttp.ClientResponse]) -> int:
    r = await http.get(url, headers=headers)
    if r.status == 200:
        held.append(r)  # kept open: the slot stays taken
    else:
        r.release()
    return r.status


async def test_one_client_cannot_take_every_live_stream_slot() -> None:
    async with dashboard() as d:
        url, hdr = d.base_url + "api/stream", d.auth_headers()
        held: list[aiohttp.ClientResponse] = []
        async with session("127.0.0.1") as one, session("127.0.0.2") as other, session("127.0.0.3") as burst:
            statuses = [await _open_stream(one, url, hdr, held) for _ in range(MAX_CLIENTS_PER_ADDRESS)]
            assert statuses == [200] * MAX_CLIENTS_PER_ADDRESS
            async with one.get(url, headers=hdr) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "5"
                assert "the most one client address may hold" in (await r.json())["error"]
            # Another client still gets a live stream.
            assert await _open_stream(other, url, hdr, held) == 200
            # All at once, from a third address: the slots are taken before any request awaits.
            got = await asyncio.gather(*(_open_stream(burst, url, hdr, held) for _ in range(3 * MAX_CLIENTS_PER_ADDRESS)))
            assert sorted(got).count(200) == MAX_CLIENTS_PER_ADDRESS and set(got) == {200, 429}
            assert d.slots.held["127.0.0.1"] == MAX_CLIENTS_PER_ADDRESS == d.slots.held["127.0.0.3"]
            # A closed stream gives its slot back.
            for r in held:
                r.close()
            held.clear()
            async with asyncio.timeout(5):
                while len(d.slots):
                    await asyncio.sleep(0.02)
            assert await _open_stream(one, url, hdr, held) == 200
            for r in held:
                r.close()


async def test_the_streams_in_all_are_bounded_with_a_clear_refusal() -> None:
    async with dashboard(max_streams=4, max_streams_per_client=2) as d:
        url, hdr = d.base_url + "api/stream", d.auth_headers()
        held: list[aiohttp.ClientResponse] = []
        clients = [session(f"127.0.0.{i}") for i in range(1, 4)]
        try:
            got = [await _open_stream(c, url, hdr, held) for c in clients for _ in range(2)]
            assert got == [200, 200, 200, 200, 503, 503]
            async with clients[2].get(url, headers=hdr) as r:
                assert "all 4 live streams of this dashboard are taken" in (await r.json())["error"]
        finally:
            for r in held:
                r.close()
            for c in clients:
                await c.close()


async def _socket(d: Dashboard, local: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", d.port, local_addr=(local, 0))


async def _closed(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closes the connection within `within` s (what it sent before is read past)."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def _asked(d: Dashboard, local: str, path: str = "/api/state", token: bool = True) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    """A kept-alive connection that asked once (with the token, or without), its answer's head read."""
    r, w = await _socket(d, local)
    auth = f"Authorization: Bearer {TOKEN}\r\n" if token else ""
    w.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 "), head
    return r, w


async def _cut_while_sending(r: asyncio.StreamReader, w: asyncio.StreamWriter, chunks: Iterable[bytes],
                             every_s: float) -> bool:
    """Whether the server closed the connection while (or just after) `chunks` were sent `every_s` apart."""
    try:
        for chunk in chunks:
            w.write(chunk)
            await w.drain()
            await asyncio.sleep(every_s)
    except ConnectionError:
        return True
    return await _closed(r, 0.1)


async def test_connections_without_the_token_make_room_and_one_address_cannot_hold_every_connection() -> None:
    async with dashboard(connections=Connections(total=8, per_client=5, idle_s=30)) as d:
        held = [await _socket(d, "127.0.0.2") for _ in range(5)]
        held.append(await _socket(d, "127.0.0.2"))  # a sixth from that address: its oldest makes room
        assert await _closed(held[0][0], 2), "the oldest of one address's connections was kept past its cap"
        assert d.connections.held["127.0.0.2"] == 5
        held += [await _socket(d, "127.0.0.3") for _ in range(3)]  # 8 in all
        async with session("127.0.0.4") as http:  # the operator: a tokenless one makes room for her
            assert (await status_of(http, d.base_url + "api/state", headers=d.auth_headers()))[0] == 200
        assert await _closed(held[1][0], 2), "the oldest tokenless connection was kept past the cap in all"
        assert len(d.connections) <= 8
        for _, w in held:
            w.close()
    async with dashboard(connections=Connections(total=4, per_client=4, idle_s=30)) as d:
        trusted = [await _asked(d, "127.0.0.2") for _ in range(4)]  # each carried the token
        refused, refused_w = await _socket(d, "127.0.0.3")
        assert await _closed(refused, 2), "a fifth connection was kept while four trusted ones were open"
        assert not any([await _closed(r, 0.2) for r, _ in trusted])
        for _, w in [*trusted, (refused, refused_w)]:
            w.close()


async def test_idle_slow_and_tokenless_connections_are_closed_and_a_live_stream_is_not() -> None:
    idle_s = 2.0
    async with dashboard(connections=Connections(idle_s=idle_s)) as d:
        silent, silent_w = await _socket(d, "127.0.0.2")
        assert await _closed(silent, 3 * idle_s), "a connection that sent nothing was kept"
        slow_r, slow_w = await _socket(d, "127.0.0.2")
        slow_w.write(b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        lines = (f"X-Slow-{i}: x\r\n".encode() for i in range(int(3 * idle_s / 0.1)))  # the head never ends
        assert await _cut_while_sending(slow_r, slow_w, lines, 0.1), "a request head sent a line at a time held its connection"
        # Asking without the token, again and again, does not keep a connection either.
        r, w = await _asked(d, "127.0.0.3", "/favicon.ico", token=False)
        asks = (b"GET /favicon.ico HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" for _ in range(int(4 * idle_s / 0.3)))
        assert await _cut_while_sending(r, w, asks, 0.3), "tokenless requests kept their connection open"
        sr, sw = await _asked(d, "127.0.0.4", "/api/stream")
        assert not await _closed(sr, 1.5 * idle_s), "a live stream was closed as idle"
        for x in (silent_w, slow_w, w, sw):
            x.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4)), max_size=60))
def test_slots_never_exceed_either_bound(ops: list[tuple[bool, int]]) -> None:
    slots = StreamSlots(total=6, per_client=2)
    held: list[str] = []
    for take, who in ops:
        client = f"10.0.0.{who}"
        if take:
            if slots.take(client) is None:
                held.append(client)
        elif client in held:
            held.remove(client)
            slots.give(client)
        assert len(slots) == len(held) <= 6
        assert all(n <= 2 for n in slots.held.values())


# ---- headers -------------------------------------------------------------------------------------


async def test_every_response_carries_the_security_headers() -> None:
    assert "unsafe-inline" not in SECURITY_HEADERS["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in SECURITY_HEADERS["Content-Security-Policy"]
    async with dashboard() as d, session() as http:
        base = d.base_url.rstrip("/")
        cases: list[tuple[str, str, dict[str, str], int]] = [
            *(("GET", p, d.auth_headers(), 0) for p in ROUTES if p != "/api/stream"),
            *(("GET", p, {}, 401) for p in ROUTES),
            ("GET", "/api/state", {"Host": "evil.example", **d.auth_headers()}, 421),
            ("GET", "/api/state?until=yesterday", d.auth_headers(), 400),
            ("POST", "/api/state", d.auth_headers(), 405),
            ("GET", "/favicon.ico", {}, 200),
            ("GET", f"/?token={TOKEN}", {}, 200),
        ]
        for method, path, headers, want in cases:
            async with http.request(method, base + path, headers=headers, allow_redirects=False) as r:
                assert want == 0 or r.status == want, (method, path, r.status)
                for k, v in SECURITY_HEADERS.items():
                    assert r.headers.get(k) == v, (method, path, r.status, k)
                assert r.headers.get("Cache-Control"), path
        async with http.get(base + "/api/stream", headers=d.auth_headers()) as r:  # the live stream too
            assert r.status == 200
            for k, v in SECURITY_HEADERS.items():
                assert r.headers.get(k) == v, k


async def test_the_favicon_is_served_without_the_token() -> None:
    async with dashboard() as d, session() as http:
        async with http.get(d.base_url + "favicon.ico") as r:
            body = await r.read()
            assert r.status == 200 and r.content_type == "image/x-icon"
            assert body[:4] == b"\x00\x00\x01\x00" and len(body) < 2048  # an ICO header, a tiny icon
