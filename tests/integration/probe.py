"""A raw NATS connection as one role's user, for tests of what the server lets that user do.

`Probe` records the server's permission errors (`can_publish`, `can_subscribe`); `Spy` listens in
the system's account (as the admin) and tells what arrived there, on which subject.
"""

from __future__ import annotations

import asyncio
from typing import Any

from controlplane.store.credentials import Creds
from controlplane.store.eventstore import NdifNatsClient


async def raw_connect(url: str, **options: Any) -> Any:
    """A connection without `connect()`'s settings (one reconnect attempt, the caller's callbacks),
    on the client whose `flush()` puts what was sent before it on the server first."""
    options.setdefault("max_reconnect_attempts", 1)
    nc = NdifNatsClient()
    await nc.connect(url, **options)
    return nc


class Probe:
    """A raw connection as one user that records the server's permission errors."""

    def __init__(self, nc: Any, errors: list[str], creds: Creds) -> None:
        self.nc = nc
        self.errors = errors
        self.creds = creds

    @classmethod
    async def open(cls, url: str, creds: Creds) -> Probe:
        errors: list[str] = []

        async def error_cb(e: Exception) -> None:
            errors.append(str(e))

        nc = await raw_connect(url, error_cb=error_cb, **creds.connect_options())
        return cls(nc, errors, creds)

    @property
    def api(self) -> str:
        """The JetStream API prefix this user reaches the system's streams under."""
        return self.creds.js_api

    async def _refused(self, what: str) -> bool:
        await self.nc.flush()
        await asyncio.sleep(0.05)  # the -ERR is read before the PONG; its callback runs just after
        return any("permissions violation" in e.lower() and what.lower() in e.lower() for e in self.errors)

    async def can_publish(self, subject: str, data: bytes = b"{}", headers: dict[str, str] | None = None) -> bool:
        await self.nc.publish(subject, data, headers=headers)
        return not await self._refused(f"Publish to \"{subject}\"")

    async def can_subscribe(self, subject: str) -> bool:
        sub = await self.nc.subscribe(subject)
        ok = not await self._refused(f"Subscription to \"{subject}\"")
        await sub.unsubscribe()
        return ok

    async def close(self) -> None:
        await self.nc.close()


class Spy:
    """Core subscriptions in the system's account (as the admin): what the server delivered there."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.got: list[tuple[str, bytes]] = []
        self._subs: list[Any] = []

    @classmethod
    async def open(cls, url: str, admin: Creds, subjects: list[str]) -> Spy:
        self = cls(await raw_connect(url, **admin.connect_options()))
        for s in subjects:
            await self.watch(s)
        return self

    async def watch(self, subject: str) -> None:
        async def cb(m: Any) -> None:
            self.got.append((m.subject, m.data))

        self._subs.append(await self.nc.subscribe(subject, cb=cb))
        await self.nc.flush()

    async def saw(self, subject: str, data: bytes, timeout: float = 10.0) -> bool:
        """Whether `data` arrives on `subject` within `timeout` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (subject, data) not in self.got:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def settle(self, seconds: float = 0.3) -> list[tuple[str, bytes]]:
        """What arrived so far, after `seconds` more for anything in flight."""
        await asyncio.sleep(seconds)
        return list(self.got)

    async def close(self) -> None:
        await self.nc.close()
