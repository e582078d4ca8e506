"""What a long-running service is given: its event log and a NATS connection, or a way to open both.

Services (controller, dispatcher, dashboard) take `Parts` (or a `Connect` that makes them on
start) instead of a URL, so the same service runs over the in-memory log in unit tests.
`connect_url` is the usual `Connect`: a JetStream event log on its own connection, closed on stop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

from nats.aio.client import Client as NatsClient

from controlplane.core.ports import EventLog
from controlplane.store.credentials import Creds
from controlplane.store.eventstore import JetStreamEventLog


class Parts(NamedTuple):
    log: EventLog
    nc: NatsClient | None  # None: no NATS at all (a service that then serves nothing over NATS)
    close: Callable[[], Awaitable[None]] | None = None  # what stopping the service calls (None: borrowed)


Connect = Callable[[], Awaitable[Parts]]
T = TypeVar("T")


async def given(parts: Parts | Connect) -> Parts:
    """The parts themselves, or the ones a `Connect` opens now."""
    if isinstance(parts, Parts):
        return parts
    if not callable(parts):  # e.g. a URL: say which constructor takes one
        raise TypeError(f"a service takes Parts or a Connect, not {type(parts).__name__}: "
                        "for a URL use Controller.from_url / Dispatcher.from_url / Dashboard.from_url")
    return await parts()


async def start_or_stop(start: Callable[[], Awaitable[T]], stop: Callable[[], Awaitable[None]]) -> T:
    """Run a service's `start`; if it fails, `stop` what it had started (and the parts it opened)."""
    try:
        return await start()
    except BaseException:
        await stop()
        raise


def connect_url(url: str, *, name: str, role: str, creds: Creds | None = None, replicas: int | None = None,
                ensure: bool = True) -> Connect:
    """Open a JetStream event log at `url` as `creds` (or the local user of `role`); it owns its connection."""

    async def connect() -> Parts:
        log = await JetStreamEventLog.open(url, name=name, creds=creds, role=role, replicas=replicas, ensure=ensure)
        return Parts(log, log.nc, log.close)

    return connect
