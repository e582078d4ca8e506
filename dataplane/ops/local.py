"""The whole service on this machine, started and stopped in one place: `LocalCluster`.

`ndif up`, `ndif up --demo` (dataplane/ops/demo.py) and tools/demo.py run the same pieces in one
process: an embedded nats-server (JetStream), the event streams and buckets, a local Ray (through
the runtime adapter, dataplane/runtime/ray_adapter.py), the controller, one node agent, and, when
asked, the dispatcher and the read-only dashboard. They differ only in the options given here.
Stopping goes in reverse order; Ray and nats-server stop even when a part failed to start.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType
from typing import Any

from controlplane.dashboard.server import Dashboard, open_dashboard
from controlplane.ops.auth import LocalAuth
from controlplane.ops.nats_server import EmbeddedNats, StoreInUse
from controlplane.service.controller import Controller
from controlplane.store.credentials import Creds, mark_open, write_nats_contexts
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.node.agent import NodeAgent
from dataplane.runtime import ray_adapter
from dataplane.serving.dispatcher import Dispatcher
from schemas.errors import InfrastructureError
from schemas.events import GpuInfo
from schemas.inventory import local_inventory


class LocalCluster:
    """nats-server + Ray + controller + agent (+ dispatcher, + dashboard) on this machine.

    `auth`: the local users per role (None: an open server). `new_history`: start an empty event
    stream where the rest of a deployment exists. `agent` and `controller`: keyword options of the
    node agent and the controller; unless `controller` names an `inventory`, the controller declares
    this machine's node with `gpus` (schemas/inventory.py), so an agent's report beyond them is
    never capacity. `dispatcher`: run one; `dashboard_port`: run the dashboard
    there (a free port if taken; None: no dashboard), behind `auth`'s operator token (without
    `auth`, a token made for this process; either way in `dashboard.url`). `die_with_parent`:
    nats-server dies with this process even on SIGKILL (`ndif up` asks it; call `start_nats()` from
    the main thread then).
    """

    def __init__(self, *, store: Path, gpus: tuple[GpuInfo, ...], node_id: str, port: int | None = None,
                 host: str = "127.0.0.1", auth: LocalAuth | None = None, new_history: bool = False,
                 agent: dict[str, Any] | None = None, controller: dict[str, Any] | None = None,
                 dispatcher: bool = True, dashboard_port: int | None = None, die_with_parent: bool = False) -> None:
        self.store = store
        self.gpus = gpus
        self.node_id = node_id
        self.auth = auth
        self.new_history = new_history
        self.agent_options = agent or {}
        self.controller_options = controller or {}
        self.with_dispatcher = dispatcher
        self.dashboard_port = dashboard_port
        self.nats = EmbeddedNats(store, port=port, host=host, config_file=auth.config_path if auth else None,
                                 die_with_parent=die_with_parent)
        self.controller: Controller | None = None
        self.agent: NodeAgent | None = None
        self.dispatcher: Dispatcher | None = None
        self.dashboard: Dashboard | None = None
        self._stack = contextlib.AsyncExitStack()
        self._nats_started = False
        self._log_ready = False

    @property
    def url(self) -> str:
        return self.nats.url

    def role(self, name: str) -> Creds | None:
        """The credentials of a role's user (None on an open server)."""
        return self.auth.users[name] if self.auth else None

    def start_nats(self) -> str:
        """Start nats-server (InfrastructureError with one clear line when it cannot); its URL."""
        try:
            self.nats.start()
        except StoreInUse:
            raise  # its message says what to do; the port is not the problem
        except Exception as exc:  # noqa: BLE001 - port taken, binary missing: one clear line
            raise InfrastructureError(f"cannot start nats-server on port {self.nats.port} "
                                      f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                                      "is another `ndif up` running? try --port") from None
        self._nats_started = True
        if self.auth is None:
            mark_open(self.url)  # no local credentials to a server without users (e.g. left by an earlier `ndif up`)
        else:
            # what the `nats` CLI (or any NATS client) connects with: docs/nats-cli.md
            write_nats_contexts(list(self.auth.users.values()), self.url, self.auth.config_path.parent / "nats-context")
        return self.url

    async def ensure_log(self) -> None:
        """Create (or check) the event streams and buckets; once."""
        if self._log_ready:
            return
        log = await JetStreamEventLog.open(self.url, ensure=False, creds=self.role("admin"))
        try:
            await log.ensure(start_new_history=self.new_history)
        finally:
            await log.close()
        self._log_ready = True

    async def start(self) -> LocalCluster:
        try:
            if not self._nats_started:
                self.start_nats()
            await self.ensure_log()
            ray_adapter.start_local(len(self.gpus))
            options = {"inventory": local_inventory(self.node_id, [(g.memory_bytes, g.name) for g in self.gpus]),
                       **self.controller_options}
            self.controller = await self._stack.enter_async_context(
                Controller.from_url(self.url, creds=self.role("controller"), **options))
            agent = await NodeAgent.open(self.url, self.node_id, gpus=self.gpus, creds=self.role(f"agent:{self.node_id}"),
                                         **self.agent_options)
            self.agent = await self._stack.enter_async_context(agent)
            if self.with_dispatcher:
                self.dispatcher = await self._stack.enter_async_context(
                    Dispatcher.from_url(self.url, creds=self.role("dispatcher")))
            if self.dashboard_port is not None:
                self.dashboard = await self._stack.enter_async_context(
                    await open_dashboard(self.url, self.dashboard_port, creds=self.role("dashboard"),
                                         token=self.auth.dashboard_token if self.auth else None))
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop the services (reverse order), then Ray, then nats-server."""
        try:
            await self._stack.aclose()
        finally:
            ray_adapter.shutdown()
            if self._nats_started:
                self.nats.stop()
                self._nats_started = False

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()


async def until_signal() -> None:
    """Wait for Ctrl-C or SIGTERM (`ndif up`, `ndif agent`, `ndif dispatcher`, `--demo --stay`)."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
