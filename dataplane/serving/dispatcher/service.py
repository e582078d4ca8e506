"""The dispatcher: durable requests in, one Processor per model, statuses out (docs/architecture.md §1, §4).

- It folds the event stream with the same reducer as every component and hands each processor its
  queue view on every event: the processor's replica set is the log's, with no second control
  plane to lag behind.
- Requests live in the work-queue stream `NDIF_REQUESTS` (`ndif.req.<mtok>.<user>`; `ndif.req.<mtok>`
  on an open server). Each model
  gets its own durable pull consumer (`proc-<mtok>`): a model waiting for provisioning holds its own
  requests only and never stalls another model's. A request is acked only at COMPLETED or ERROR;
  while held (queued or running) it is kept alive with in-progress acks. Execution is
  at-least-once (a dispatcher that dies loses its acks, so the requests are redelivered); the
  terminal status is written exactly once (KV compare-and-set), and a redelivered request that
  already has one is acked without running again.
- The first request for a model with no replicas sends `deploy` with NDIF_MODEL_REPLICAS_DEFAULT
  replicas; requests are served from the first replica that is ready. If the last replica goes
  while requests wait, it provisions again and tells the waiting users.
- A replica is called only after the dispatcher said so in the log (`ReplicaServed`); a draining
  replica takes no new request, and once idle the dispatcher appends `ReplicaDrained`.

This module holds the settings and wires the parts, each one concern, dependencies one way:
statuses (status writing) <- provisioning <- intake (consumers, triage, queue lifetime) <- follower
(the log). Processors get `ProcessorHooks` (callbacks into those parts), never the dispatcher.
Settings are read at start and handed to the parts (change `intake.queue_lifetime_s` and the like
on a running dispatcher, not the dispatcher's own copy).

Beyond its event log the parts work through the serving ports (dataplane/serving/ports.py): on
NATS they are opened on the dispatcher's connection (dataplane/serving/jetstream.py); given
(`ports=`, e.g. dataplane/serving/memory.py's) the dispatcher runs over any log, the in-memory one
included. Only with a NATS connection does it also call replicas over their endpoints (else every
call goes through its `ReplicaCaller`) and answer `ndif.dispatcher.state` and kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from controlplane.core.fairness import FairnessPolicy, decode_policy
from controlplane.core.ports import EventLog
from controlplane.core.projections import ClusterState
from controlplane.service.clock import utcnow
from controlplane.service.follow import catch_up
from controlplane.service.parts import Connect, Parts, connect_url, given, start_or_stop
from controlplane.service.tasks import cancel_and_wait
from controlplane.store.credentials import Creds
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.runtime.ports import ReplicaCaller
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.follower import LogFollower
from dataplane.serving.dispatcher.intake import Intake
from dataplane.serving.dispatcher.provisioning import Provisioner
from dataplane.serving.dispatcher.statuses import StatusWriter
from dataplane.serving.jetstream import open_ports
from dataplane.serving.link import ReplicaLink
from dataplane.serving.ports import ServingPorts
from dataplane.serving.processor import Processor, ProcessorHooks
from schemas import errors as errs
from schemas.autoscale import FIGURES_CADENCE_S, MAX_IDLE_S, QueueFigures
from schemas.subjects import DISPATCHER_STATE, figures_subject, kill_subject

_figures_encoder = msgspec.json.Encoder()

logger = structlog.get_logger("ndif.dispatcher")
# A request held by a dispatcher that dies is redelivered this long after its last in-progress ack
# (sent every third of it while held): a dead dispatcher's requests move on within seconds.
ACK_WAIT_S = 4.0
QUEUE_LIFETIME_S = 600.0  # a request still queued this long after a dispatcher took it ends in ERROR


POSITIONS_EVERY_S = 1.0  # queued requests' positions are looked at this often (each told at most this often)


def fairness_from_env() -> FairnessPolicy:
    """NDIF_FAIRNESS: the fairness policy as JSON, or `@path` of a JSON file (docs/cli.md); unset:
    every user weight 1, band 0, the default limits. A bad policy stops the dispatcher at start."""
    raw = os.environ.get("NDIF_FAIRNESS", "").strip()
    if not raw:
        return FairnessPolicy()
    if raw.startswith("@"):
        try:
            with open(raw[1:], "rb") as f:
                data = f.read(2 << 20)
        except OSError as exc:
            raise errs.InvalidCommand(f"NDIF_FAIRNESS names {raw[1:]!r}, which cannot be read: {exc}") from None
    else:
        data = raw.encode()
    return decode_policy(data)


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class Dispatcher:
    """The serving side's one service: give it its parts (`Parts`, or a `Connect` that opens them on
    start); `Dispatcher.from_url` opens a JetStream event log on its own connection. `ports`: the
    serving ports (None: opened on the parts' NATS connection); `caller`: how replicas are called
    (None: Ray's, made on start); the replica link falls back on the same caller."""

    def __init__(self, parts: Parts | Connect, *, name: str | None = None, default_replicas: int | None = None,
                 fetch_batch: int = 64, ack_wait_s: float | None = None,
                 lanes_per_replica: int | None = None, queue_lifetime_s: float | None = None,
                 caller: ReplicaCaller | None = None, ports: ServingPorts | None = None,
                 fairness: FairnessPolicy | None = None) -> None:
        self.parts = parts
        self.ports = ports
        self.caller = caller
        self.name = name or f"dispatcher:{socket.gethostname()}"
        self.default_replicas = default_replicas or _env_int("NDIF_MODEL_REPLICAS_DEFAULT", 1)
        self.fetch_batch = fetch_batch
        # Calls a replica is handed at once (like Ray Serve's max_ongoing_requests): the next call
        # is already at the replica when the current one ends, so the dispatch round trip never
        # leaves it idle. The replica still runs one request at a time, and its execution timeout
        # counts from the start of the run. Measured in tools/bench/dispatch.py with batching
        # (below): 1 lane ~980-1,170 req/s, 2 ~970-1,010, 4 ~800; 2 keeps a slow model's replica busy.
        self.lanes_per_replica = lanes_per_replica or _env_int("NDIF_REPLICA_LANES", 2)
        # Short requests waiting behind each other go to a replica in one call, as many as run in
        # NDIF_BATCH_BUDGET_MS by the model's recent run times (at most NDIF_BATCH_MAX): a replica call
        # costs more CPU than a no-op request itself (measured over the NATS link: NDIF_BATCH_MAX=1
        # 1,498 req/s, 8: 2,691, docs/benchmarks.md). Slow models go one by one.
        self.batch_max = _env_int("NDIF_BATCH_MAX", 8)
        self.batch_budget_s = float(os.environ.get("NDIF_BATCH_BUDGET_MS", 2.0)) / 1000
        # How long a request held by a dead dispatcher waits before redelivery (kept alive meanwhile).
        self.ack_wait_s = ack_wait_s or float(os.environ.get("NDIF_REQUEST_ACK_WAIT_S", ACK_WAIT_S))
        # How long a request may wait in a processor's queue (never placed, no room, no replica ready).
        try:
            self.queue_lifetime_s = queue_lifetime_s or float(os.environ.get("NDIF_REQUEST_QUEUE_LIFETIME_S",
                                                                             QUEUE_LIFETIME_S))
        except ValueError:
            raise errs.InvalidCommand("NDIF_REQUEST_QUEUE_LIFETIME_S takes seconds, e.g. 600") from None
        if not self.queue_lifetime_s > 0:
            raise errs.InvalidCommand(f"NDIF_REQUEST_QUEUE_LIFETIME_S must be > 0 (got {self.queue_lifetime_s})")
        # Fair share, priority bands and limits per user within each model's queue (NDIF_FAIRNESS).
        self.fairness = fairness if fairness is not None else fairness_from_env()
        self.state = ClusterState()
        self.processors: dict[str, Processor] = {}  # model token -> processor
        self.log: EventLog | None = None
        self.nc: NatsClient | None = None
        self._close: Any = None
        self.bg = Background()
        self._tasks: list[asyncio.Task[None]] = []
        self._subs: list[Any] = []
        self._unwatch: list[Callable[[], Awaitable[None]]] = []
        # Replica calls over NATS (dataplane/serving/link.py); NDIF_REPLICA_LINK=ray makes them Ray calls.
        self.link: ReplicaLink | None = None
        link = os.environ.get("NDIF_REPLICA_LINK", "nats").strip().lower() or "nats"
        if link not in ("nats", "ray"):
            raise errs.InvalidCommand(f"NDIF_REPLICA_LINK is {link!r}: use 'nats' (the default) or 'ray'")
        self.use_link = link == "nats"
        self.statuses: StatusWriter | None = None
        self.provisioner: Provisioner | None = None
        self.intake: Intake | None = None
        self.follower: LogFollower | None = None
        self._last_figures: dict[str, tuple[int, int]] = {}  # model token -> (queued + running, finished)
        self._busy_at: dict[str, float] = {}  # model token -> when figures last saw it busy (monotonic)

    @classmethod
    def from_url(cls, url: str, *, creds: Creds | None = None, name: str | None = None, **kw: Any) -> Dispatcher:
        """A dispatcher on its own connection to `url`, as `creds` (None: the dispatcher role's local user)."""
        name = name or f"dispatcher:{socket.gethostname()}"
        return cls(connect_url(url, name=name, creds=creds, role="dispatcher"), name=name, **kw)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Dispatcher:
        log, nc, self._close = await given(self.parts)
        return await start_or_stop(lambda: self._start(log, nc), self.stop)

    async def _start(self, log: EventLog, nc: NatsClient | None) -> Dispatcher:
        ports = self.ports
        if ports is None:
            if nc is None or not isinstance(log, JetStreamEventLog):
                # Its requests and statuses live on NATS, and the deploys it sends over `nc` come
                # back only through a log on the same server.
                raise errs.InvalidCommand("the dispatcher needs a NATS connection and the JetStream event log on "
                                          "it (or its serving ports given: `ports=`)")
            ports = await open_ports(nc, log, actor=self.name, ack_wait_s=self.ack_wait_s,
                                     fetch_batch=self.fetch_batch)
        self.log, self.nc = log, nc
        if self.caller is None:
            from dataplane.runtime.ray_adapter import RayCaller  # the one module that imports ray

            self.caller = RayCaller()
        # The fold every part reads: the newest snapshot that matches the log, then the tail.
        self.state = await catch_up(log)
        self.statuses = StatusWriter(ports.publish, ports.statuses, ports.results, self.bg)
        self.provisioner = Provisioner(state=self.state, deploy=ports.deploy, statuses=self.statuses, bg=self.bg,
                                       default_replicas=self.default_replicas)
        self.intake = Intake(state=self.state, processors=self.processors, requests=ports.requests,
                             statuses=self.statuses, provisioner=self.provisioner, bg=self.bg,
                             make_processor=self._make_processor, ack_wait_s=self.ack_wait_s,
                             queue_lifetime_s=self.queue_lifetime_s)
        self.follower = LogFollower(log=log, state=self.state, processors=self.processors, intake=self.intake,
                                    bg=self.bg, name=self.name)
        if self.use_link and nc is not None:
            self.link = await ReplicaLink(nc, self.statuses.send, self.caller).start()
        # New model subjects are discovered from the publishes themselves; existing ones from the stream.
        self._unwatch.append(await ports.requests.watch(self.intake.on_subject))
        if nc is not None:
            self._subs.append(await nc.subscribe(DISPATCHER_STATE, cb=self._on_state))
            self._subs.append(await nc.subscribe(kill_subject(), cb=self.intake.on_kill))
            # A user's kill (`ndif.dispatcher.kill.<user>`, which only that user may publish): theirs only.
            self._subs.append(await nc.subscribe(kill_subject("*"), cb=self.intake.on_kill))
        await self.intake.route_stored()
        self._tasks += [asyncio.create_task(self.follower.run(), name="dispatcher-follow"),
                        asyncio.create_task(self.intake.keepalive(), name="dispatcher-keepalive"),
                        asyncio.create_task(self.intake.expire(), name="dispatcher-expire"),
                        asyncio.create_task(self.intake.sweep_loop(), name="dispatcher-sweep"),
                        asyncio.create_task(self._positions(), name="dispatcher-positions")]
        if nc is not None:
            self._tasks.append(asyncio.create_task(self._publish_figures(nc), name="dispatcher-figures"))
        logger.info("dispatcher_started", name=self.name, seq=self.state.seq, processors=len(self.processors))
        return self

    def _make_processor(self, token: str) -> Processor:
        assert self.statuses is not None and self.provisioner is not None and self.follower is not None
        assert self.caller is not None
        return Processor(token, ProcessorHooks(
            status=self.statuses.status, finish_soon=self.statuses.finish_soon,
            provision=self.provisioner.maybe_provision, drained=self.follower.report_drained, link=self.link, caller=self.caller,
            lanes_per_replica=self.lanes_per_replica, batch_max=self.batch_max, batch_budget_s=self.batch_budget_s,
            fairness=self.fairness, position_every_s=POSITIONS_EVERY_S, serve=self.follower.report_served,
            name=self.name))

    async def _positions(self) -> None:
        """Queued requests hear of their new position and wait estimate as they move (rate-limited)."""
        while True:
            await asyncio.sleep(POSITIONS_EVERY_S)
            for p in list(self.processors.values()):
                try:
                    p.positions(time.monotonic())
                except Exception as exc:  # noqa: BLE001 - one model's trouble never stops the others'
                    logger.warning("positions_failed", token=p.token, error=str(exc))

    async def stop(self) -> None:
        if self.statuses is not None:
            self.statuses.cancel_timers()
        for unwatch in self._unwatch:
            with contextlib.suppress(Exception):
                await unwatch()
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self.bg.stopped = True
        tasks = [*self._tasks, *self.bg.tasks, *(self.intake.consumers.values() if self.intake else ())]
        for p in self.processors.values():
            tasks += p.tasks()
        await cancel_and_wait(tasks, owner=self.name)
        if self.link is not None:
            await self.link.stop()
        if self._close is not None:
            await self._close()

    async def __aenter__(self) -> Dispatcher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- what operators and tests ask of it --------------------------------------------------

    async def remove_model(self, token_or_key: str, *, reason: str) -> bool:
        """Stop serving a model here (intake's `remove_model`)."""
        assert self.intake is not None
        return await self.intake.remove_model(token_or_key, reason=reason)

    async def sweep_consumers(self) -> list[str]:
        """Delete durable consumers of models the log does not know (intake's `sweep_consumers`)."""
        assert self.intake is not None
        return await self.intake.sweep_consumers()

    def figures(self, now_s: float, dt_s: float) -> list[QueueFigures]:
        """Every served model's queue figures now (`now_s`: monotonic; `dt_s`: since the last call,
        for the arrival rate: requests finished plus the growth of queued + running, per second;
        `idle_s`: since a call last saw the model's requests queued, running or finished, or since
        its first call)."""
        out = []
        stamp = utcnow()
        for gone in set(self._busy_at) - set(self.processors):  # a processor that left: its figures go too
            self._busy_at.pop(gone, None)
            self._last_figures.pop(gone, None)
        for p in self.processors.values():
            if p.model_key is None:
                continue
            queued, running, finished = len(p.queue), p.running(), p.completed + p.errors
            before = self._last_figures.get(p.token, (queued + running, finished))
            arrivals = max(0, finished - before[1] + queued + running - before[0])
            self._last_figures[p.token] = (queued + running, finished)
            if queued + running or finished != before[1] or p.token not in self._busy_at:
                self._busy_at[p.token] = now_s
            oldest = max(0.0, now_s - min(x.received for x in p.queue)) if p.queue else 0.0
            out.append(QueueFigures(model_key=p.model_key, queued=queued, running=running, oldest_wait_s=round(oldest, 3),
                                    arrival_rate=round(arrivals / dt_s, 3) if dt_s > 0 else 0.0, completions=finished,
                                    dispatcher=self.name, ts=stamp,
                                    idle_s=round(min(now_s - self._busy_at[p.token], MAX_IDLE_S), 3)))
        return out

    async def _publish_figures(self, nc: NatsClient) -> None:
        """Each model's figures on `ndif.figures.<mtok>` every FIGURES_CADENCE_S (core NATS, not stored:
        inputs of the autoscaler, whose decisions record what they saw)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(FIGURES_CADENCE_S)
            now = time.monotonic()
            for f in self.figures(now, now - last):
                with contextlib.suppress(Exception):  # a closed connection: the next tick tries again
                    await nc.publish(figures_subject(f.model_key), _figures_encoder.encode(f))
            last = now

    def get_state(self) -> list[dict[str, Any]]:
        return [p.state() for p in self.processors.values() if p.model_key is not None]

    async def _on_state(self, msg: Msg) -> None:
        if msg.reply:
            await msg.respond(msgspec.json.encode({"dispatcher": self.name, "processors": self.get_state()}))
