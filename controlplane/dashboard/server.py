"""The dashboard's web server (aiohttp, on the caller's asyncio loop): static page, JSON API, live stream.

It reads NDIF_EVENTS (never appends), folds it into a `DashboardModel`, follows it live and pushes
each batch of events with the node and model views they changed to every open page over
server-sent events. Queue figures come from the dispatcher (`ndif.dispatcher.state`) and from
JetStream (each model's work-queue consumer), asked once a second and pushed when they change.
Every request passes the door first (door.py: the Host header, the operator token, live-stream
slots per client, security headers). Endpoints: docs/dashboard.md.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web
from nats.aio.client import Client as NatsClient

from controlplane.core.ports import EventLog
from controlplane.core.projections import ClusterState
from controlplane.dashboard.door import (
    TOKEN_QUERY,
    Connections,
    Door,
    GuardedProtocol,
    StreamSlots,
    add_security_headers,
    connections_middleware,
    door_middleware,
)
from controlplane.dashboard.metrics import registry_for
from controlplane.dashboard.model import (
    WINDOW,
    BadQuery,
    DashboardModel,
    UnknownEntity,
    event_row,
    int_param,
    model_json,
    node_json,
    state_json,
    touched,
)
from controlplane.dashboard.past import Past
from controlplane.dashboard.routes import add_routes
from controlplane.dashboard.sampler import QueueSamples
from controlplane.service.follow import follow_log
from controlplane.service.parts import Connect, Parts, connect_url, given, start_or_stop
from controlplane.service.tasks import cancel_and_wait
from controlplane.store.collector import collector_paused
from controlplane.store.credentials import JS_API, Creds
from controlplane.store.rebuild import newest_snapshot
from schemas import errors as errs
from schemas.guard import Refused, decode_any
from schemas.subjects import DISPATCHER_STATE, REQUESTS_STREAM, model_token, request_consumer_token

logger = structlog.get_logger("ndif.dashboard")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
CLIENT_QUEUE = 512  # messages buffered per page; past that the page is told to reload its state
MAX_EVENTS_PER_MESSAGE = 200  # event rows sent per update (the views changed are always complete)
MAX_CATCH_UP = 5000  # a page asking for more events than this since its state gets a resync instead
MAX_CLIENTS = 64  # live streams in all
MAX_CLIENTS_PER_ADDRESS = 8  # live streams one client address may hold (a page holds one)
FLUSH_S = 0.05  # changes are pushed at most this long after they are folded (20 updates a second at most)
QUEUE_POLL_S = 1.0
MAX_QUEUE_CONSUMERS = 10_000  # consumers listed per round (256 a request)
STATIC = resources.files("controlplane.dashboard") / "static"
_enc = msgspec.json.Encoder()
_CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png",
                  ".ico": "image/x-icon", ".txt": "text/plain"}


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=_enc.encode({"error": message, "status": status}),
                        content_type="application/json")


def _json(obj: Any) -> web.Response:
    return web.Response(body=_enc.encode(obj), content_type="application/json")


_QUEUE_FIELDS = ("status", "queued", "in_flight", "completed", "errors", "serving_replicas", "oldest_wait_s",
                 "run_ms", "latency_s")
MAX_STATE_BYTES = 8 << 20  # a dispatcher's state answer: bounded by what one NATS message carries


def dispatcher_rows(data: bytes) -> tuple[Any, dict[str, dict[str, Any]], str | None]:
    """A dispatcher's state answer as (its name, each model's queue row, why it could not be read
    or None). Never raises: whatever the bytes, the rows it could read."""
    d = decode_any(data, limit=MAX_STATE_BYTES, what="dispatcher state")
    if not isinstance(d, dict):
        return None, {}, d.reason if isinstance(d, Refused) else "the dispatcher's state is not an object"
    rows: dict[str, dict[str, Any]] = {}
    procs = d.get("processors")
    for p in procs if isinstance(procs, list) else []:
        if isinstance(p, dict) and isinstance(p.get("model_key"), str):
            rows[p["model_key"]] = {k: p.get(k) for k in _QUEUE_FIELDS}
    name = d.get("dispatcher")
    return name if isinstance(name, str) else None, rows, None


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every refusal is a JSON body with the reason; nothing a client sends stops the server."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except BadQuery as exc:
        return _error(400, str(exc))
    except UnknownEntity as exc:
        return _error(404, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason or "error")


class Dashboard:
    """`async with Dashboard.from_url(url, port=...) as d: print(d.url)`: serve until the block ends.

    Give it its parts (`Parts`, or a `Connect` that opens them on start); without a NATS connection
    (`Parts(MemoryEventLog(), None)`) it serves the log's projections and says the queues are unknown."""

    def __init__(self, parts: Parts | Connect, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 window: int = WINDOW, queue_poll_s: float = QUEUE_POLL_S, token: str | None = None,
                 allowed_hosts: tuple[str, ...] = (), max_streams: int = MAX_CLIENTS,
                 max_streams_per_client: int = MAX_CLIENTS_PER_ADDRESS, connections: Connections | None = None) -> None:
        """`token`: the operator token (None: a new one for this process, in `url`); `allowed_hosts`:
        names besides the loopback ones and `host` that the Host header may carry; `connections`:
        the caps on open connections and their idle time (door.py's defaults)."""
        self.parts = parts
        self.host, self.port = host, port
        self.door = Door.make(token, bound=host, extra=allowed_hosts)
        self.slots = StreamSlots(total=max_streams, per_client=max_streams_per_client)
        self.connections = Connections() if connections is None else connections
        self._listening: asyncio.Server | None = None
        self.window = window  # newest events kept in memory (older pages read the log)
        self.model = DashboardModel(window=window)  # replaced on start by one from the newest snapshot
        self.past: Past | None = None
        self.queue_poll_s = queue_poll_s
        self.log: EventLog | None = None
        self.nc: NatsClient | None = None
        self._close: Callable[[], Awaitable[None]] | None = None
        self.runner: web.AppRunner | None = None
        self.clients: set[asyncio.Queue[bytes | None]] = set()  # one per open live stream
        self.queues: dict[str, Any] = {"dispatcher": None, "error": "not asked yet", "models": {}}
        self.samples = QueueSamples(queue_poll_s)  # the queue figures over time (routes.py, sampler.py)
        self.metrics = registry_for(self)  # `/metrics` (metrics.py)
        self._tasks: list[asyncio.Task[None]] = []
        # Changes folded and not yet pushed (see _apply).
        self._rows: list[dict[str, Any]] = []
        self._nodes: set[str] = set()
        self._models: set[str] = set()
        self._flush_at: asyncio.TimerHandle | None = None

    @classmethod
    def from_url(cls, nats_url: str, *, creds: Creds | None = None, **kw: Any) -> Dashboard:
        """A dashboard on its own connection to `nats_url`, as `creds` (None: the read-only dashboard
        role's local user where the server has users); it creates no stream or bucket."""
        return cls(connect_url(nats_url, name="ndif-dashboard", creds=creds, role="dashboard", ensure=False), **kw)

    @property
    def base_url(self) -> str:
        """The dashboard's address, without its token (API clients send `Authorization: Bearer`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def url(self) -> str:
        """What the operator opens: the address with the token (the page keeps it in a cookie)."""
        return f"{self.base_url}?{TOKEN_QUERY}={self.door.token}"

    @property
    def token(self) -> str:
        return self.door.token

    def auth_headers(self) -> dict[str, str]:
        """The header an API client (tests, tools/bench/dashboard.py) sends."""
        return {"Authorization": f"Bearer {self.door.token}"}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[connections_middleware(self.connections), _errors,
                                           door_middleware(self.door, lambda: self.port, _error,
                                                           lambda r: self.connections.trusted(r.transport))])
        app.on_response_prepare.append(add_security_headers)
        app.router.add_get("/", self._index)
        app.router.add_get("/favicon.ico", self._favicon)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/events", self._events)
        app.router.add_get("/api/history", self._history)
        app.router.add_get("/api/queues", self._queues)
        app.router.add_get("/api/stream", self._stream)
        add_routes(app, self)
        return app

    async def start(self) -> Dashboard:
        self.log, self.nc, self._close = await given(self.parts)
        return await start_or_stop(self._start, self.stop)

    async def _start(self) -> Dashboard:
        assert self.log is not None
        t0 = time.perf_counter()
        # The newest snapshot that matches the log, then the events after it (kept in memory).
        start = await newest_snapshot(self.log)
        self.model = DashboardModel(start.state, window=self.window)
        async for batch in self.log.read_batches(start.state.seq + 1):
            self.model.add_all(batch)
        self.past = Past(self.log, self.model)
        logger.info("dashboard_folded", seq=self.model.seq, snapshot=start.name, snapshot_seq=self.model.start_seq,
                    seconds=round(time.perf_counter() - t0, 3))
        # handler_cancellation: a page that goes away ends its stream (and gives back its slot) at once,
        # not at the next write.
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True)
        await self.runner.setup()
        server = self.runner.server
        assert server is not None
        try:  # the runner's HTTP protocol behind the connection caps (door.py `Connections`)
            self._listening = await asyncio.get_running_loop().create_server(
                lambda: GuardedProtocol(server(), self.connections), self.host, self.port)
        except OSError as exc:
            raise errs.InfrastructureError(f"dashboard cannot listen on {self.host}:{self.port} ({exc.strerror}); "
                                           "try --port") from None
        if self.port == 0:
            self.port = int(self._listening.sockets[0].getsockname()[1])
        self._tasks += [asyncio.create_task(self._follow(), name="dashboard-follow"),
                        asyncio.create_task(self._poll_queues(), name="dashboard-queues")]
        logger.info("dashboard_started", url=self.base_url, seq=self.model.seq)  # never the token: logs are read by many
        return self

    async def stop(self) -> None:
        for q in list(self.clients):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)
        if self._flush_at is not None:
            self._flush_at.cancel()
        await cancel_and_wait(self._tasks, owner="dashboard")
        if self._listening is not None:
            self._listening.close()  # no new connection; the runner's cleanup ends the open ones
        if self.runner is not None:
            await self.runner.cleanup()
        if self._close is not None:
            await self._close()

    async def __aenter__(self) -> Dashboard:
        return self if self.runner is not None else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- following the log -----------------------------------------------------------------

    async def _follow(self) -> None:
        # The page shows the fold's anomalies itself: nothing to log per batch (no `fold=`).
        assert self.log is not None
        await follow_log(self.log, lambda: self.model.seq + 1, self._apply, logger=logger, retry_s=1.0,
                         refold=self._refold)

    async def _refold(self, state: ClusterState) -> None:
        """The log went back: the page shows what it holds now (its series start again there)."""
        assert self.log is not None
        self.model = DashboardModel(state, window=self.window)
        self.past = Past(self.log, self.model)
        logger.warning("dashboard_refolded", seq=state.seq)

    def _apply(self, batch: list[Any]) -> None:
        """Fold a batch; what it changed goes out with the next flush (at most FLUSH_S later), so a
        burst or a backlog costs one view per changed node and model per flush, not per batch."""
        m = self.model
        for seq, item in batch:
            if seq <= m.seq:
                continue
            try:  # each event in its own guard: one the page cannot show is logged, the next is read
                if self.clients:
                    n, mk = touched(m.live, item)
                    self._nodes |= n
                    self._models |= mk
                    self._rows.append(event_row(seq, item))
                m.add(seq, item)
            except Exception as exc:  # noqa: BLE001 - the fold itself never raises (it ran, or ran first)
                logger.warning("event_not_shown", seq=seq, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        if self._rows and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        rows, nodes, models = self._rows, self._nodes, self._models
        self._rows, self._nodes, self._models = [], set(), set()
        if rows and self.clients:
            self._broadcast(self._update(rows, nodes, models))

    def _update(self, rows: list[dict[str, Any]], nodes: set[str], models: set[str]) -> bytes:
        st = self.model.live
        body = {"seq": st.seq, "last_seq": st.seq, "events": rows[-MAX_EVENTS_PER_MESSAGE:],
                "events_dropped": max(0, len(rows) - MAX_EVENTS_PER_MESSAGE),
                "nodes": [node_json(st, n) for n in sorted(nodes) if n in st.nodes],
                "models": [model_json(st, mk) for mk in sorted(models)],
                "anomaly_count": st.anomaly_count}
        return b"event: update\ndata: " + _enc.encode(body) + b"\n\n"

    def _broadcast(self, msg: bytes) -> None:
        for q in list(self.clients):
            try:
                q.put_nowait(msg)
            except asyncio.QueueFull:  # a page that cannot keep up reloads its state instead
                while not q.empty():
                    q.get_nowait()
                q.put_nowait(b"event: resync\ndata: {}\n\n")

    # ---- queues ------------------------------------------------------------------------------

    async def _poll_queues(self) -> None:
        last = b""
        while True:
            try:
                q = await self._ask_queues()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - shown on the page as it is
                q = {"dispatcher": None, "error": str(exc) or type(exc).__name__, "models": {}}
            self.queues = q
            self.samples.record(time.time(), q)
            same = _enc.encode({k: v for k, v in q.items() if k != "asked_at"})
            if same != last and self.clients:  # pushed only when a figure changed
                self._broadcast(b"event: queues\ndata: " + _enc.encode(q) + b"\n\n")
            last = same
            await asyncio.sleep(self.queue_poll_s)

    async def _ask_queues(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dispatcher": None, "error": None, "models": {}, "asked_at": time.time()}
        models: dict[str, dict[str, Any]] = out["models"]
        if self.nc is None:
            out["error"] = "no NATS connection: queues unknown"
            return out
        try:
            msg = await self.nc.request(DISPATCHER_STATE, b"", timeout=1.0)
            out["dispatcher"], rows, problem = dispatcher_rows(msg.data)
            models.update(rows)
            if problem:
                out["error"] = problem
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            out["error"] = f"no dispatcher answered ({type(exc).__name__})"
        # Every model's work-queue consumer in a few listing requests (256 a page), not one request each.
        seen: dict[str, tuple[str, int, int]] = {}  # consumer name -> (model token, pending, ack pending)
        listed, capped = 0, False  # consumers listed so far, ours or not: the next page's offset
        # The JetStream API as this user reaches it (the dashboard's account imports it under another prefix).
        js = self.nc.jetstream(prefix=getattr(self.log, "api", JS_API))
        with contextlib.suppress(nats.js.errors.NotFoundError):
            while True:
                if listed >= MAX_QUEUE_CONSUMERS:
                    capped = True
                    break
                page = await js.consumers_info(REQUESTS_STREAM, offset=listed or None)
                listed += len(page)
                for info in page:  # by name: a consumer made meanwhile shifts the pages, never counts twice
                    token = request_consumer_token(info.name or "")
                    if token is not None:
                        seen[info.name or ""] = (token, info.num_pending or 0, info.num_ack_pending or 0)
                if len(page) < 256:
                    break
        pending: dict[str, tuple[int, int]] = {}
        for token, n, a in seen.values():  # a model's consumers (its user partitions'), summed
            was = pending.get(token, (0, 0))
            pending[token] = (was[0] + n, was[1] + a)
        if capped:
            out["pending_note"] = (f"the request stream's consumers were listed up to {MAX_QUEUE_CONSUMERS:,}: a model "
                                   "without a count was not listed, and a count may miss some of its partitions")
        for mk in self.model.live.models:
            got = pending.get(model_token(mk))
            row = models.setdefault(mk, {})
            # None: no consumer yet (nothing was ever submitted for the model), or not listed (capped).
            row["pending"], row["ack_pending"] = got if got is not None else (None, None)
        return out

    # ---- handlers ----------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=(STATIC / "index.html").read_bytes(), content_type="text/html")

    async def _favicon(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=(STATIC / "favicon.ico").read_bytes(), content_type="image/x-icon",
                            headers={"Cache-Control": "max-age=86400"})

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        ext = Path(name).suffix
        f = STATIC / name
        if "/" in name or name.startswith(".") or ext not in _CONTENT_TYPES or not f.is_file():
            return _error(404, f"no static file {name[:80]!r}")
        return web.Response(body=f.read_bytes(), content_type=_CONTENT_TYPES[ext],
                            headers={"Cache-Control": "no-cache"})

    async def _state(self, request: web.Request) -> web.StreamResponse:
        until = request.query.get("until")
        m = self.model
        if until is None or until == "" or until == "live":
            return self._state_response(m.live, None)
        if len(until) > 64:
            raise BadQuery("until is too long (a sequence number or an ISO time)")
        assert self.past is not None
        seq, st = await self.past.at(m.parse_until(until))
        return self._state_response(st, seq)

    def _state_response(self, st: ClusterState, seq: int | None) -> web.Response:
        """The page's whole state, live (`seq` None) or at a past `seq`: built and encoded with the
        collector paused (tens of thousands of dicts, no cycles: controlplane/store/collector.py),
        and freed before it resumes."""
        m = self.model
        with collector_paused():
            body = state_json(st, last_seq=m.seq, live=seq is None or seq >= m.seq)
            if seq is not None:
                body["seq"] = seq
                # Queue figures are not in the log: those this dashboard sampled at that time, or null.
                t = body["ts"]
                body["queues_at"] = self.samples.at(t) if t is not None and seq < m.seq else None
            data = _enc.encode(body)
            del body
        return web.Response(body=data, content_type="application/json")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        assert self.past is not None
        rows, next_before = await self.past.events(
            model=q.get("model") or None, replica_id=int_param(q, "replica"), type_=q.get("type") or None,
            actor=q.get("actor") or None, before=int_param(q, "before", lo=1), limit=int_param(q, "limit", lo=1, hi=1000) or 100)
        return _json({"events": rows, "next_before": next_before, "last_seq": self.model.seq})

    async def _history(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        model = q.get("model")
        if not model:
            raise BadQuery("history needs ?model=MODEL_KEY (and optionally &replica=ID)")
        assert self.past is not None
        return _json(await self.past.history(model, int_param(q, "replica"), before=int_param(q, "before", lo=1)))

    async def _queues(self, request: web.Request) -> web.StreamResponse:
        return _json(self.queues)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `update` (events + changed views), `queues`, `resync` (reload state)."""
        since = int_param(request.query, "since", lo=0)
        m = self.model
        if since is not None and since > m.seq:
            raise BadQuery(f"since {since} is past the end of the log (last seq {m.seq})")
        client = request.remote or "unknown"
        refused = self.slots.take(client)  # before any await: concurrent requests cannot all pass
        if refused is not None:
            busy = _error(*refused)
            busy.headers["Retry-After"] = "5"
            return busy
        q: asyncio.Queue[bytes | None] = asyncio.Queue(CLIENT_QUEUE)
        self.clients.add(q)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            first = b": ndif dashboard stream\n\n" + b"event: queues\ndata: " + _enc.encode(self.queues) + b"\n\n"
            if since is not None and since < m.seq:
                lo = bisect.bisect_right(m.seqs, since)
                if since < m.first_kept - 1 or len(m.seqs) - lo > MAX_CATCH_UP or self.past is None:
                    first += b"event: resync\ndata: {}\n\n"
                else:  # what happened between the page's state and this stream, folded again from `since`
                    st = (await self.past.at_seq(since)).copy()  # a copy: past states are cached and shared
                    nodes: set[str] = set()
                    models: set[str] = set()
                    rows = []
                    for i in range(lo, len(m.seqs)):
                        seq, item = m.seqs[i], m.items[i]
                        n, mk = touched(st, item)  # read before the event, as live updates do
                        nodes |= n
                        models |= mk
                        st.apply(seq, item)
                        rows.append(event_row(seq, item))
                    first += self._update(rows, nodes, models)
            await resp.write(first)
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), 15.0)
                except TimeoutError:
                    msg = b": keepalive\n\n"
                if msg is None:
                    break
                await resp.write(msg)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.clients.discard(q)
            self.slots.give(client)
        return resp


async def open_dashboard(nats_url: str, port: int = DEFAULT_PORT, *, creds: Creds | None = None,
                         token: str | None = None) -> Dashboard:
    """For `ndif up`: a started dashboard on 127.0.0.1:`port`, or on a free port if that one is taken;
    `token`: the operator token `ndif up` keeps beside the credentials (None: one for this process)."""
    try:
        return await Dashboard.from_url(nats_url, port=port, creds=creds, token=token).start()
    except errs.InfrastructureError as exc:
        if port == 0:
            raise
        logger.warning("dashboard_port_taken", port=port, error=str(exc).removesuffix("; try --port"),
                       using="a free port instead (`ndif up --dashboard-port P` picks one)")
        return await Dashboard.from_url(nats_url, port=0, creds=creds, token=token).start()


async def serve(nats_url: str, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                creds: Creds | None = None, token: str | None = None, allowed_hosts: tuple[str, ...] = ()) -> None:
    """`ndif dashboard`: serve until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Dashboard.from_url(nats_url, host=host, port=port, creds=creds, token=token,
                                  allowed_hosts=allowed_hosts) as d:
        print(f"ndif dashboard: {d.url} (log at seq {d.model.seq}; read-only). Ctrl-C stops it.", flush=True)
        if host not in ("127.0.0.1", "localhost", "::1"):
            names = ", ".join(sorted(d.door.allowed_names))
            print(f"ndif dashboard: listening on {host}: whoever reaches this port and holds the token sees the "
                  f"whole cluster; it answers only to the names {names} (more with --allowed-host)", flush=True)
        await stop.wait()
