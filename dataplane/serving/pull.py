"""A continuous pull consumer: requests arrive as soon as they are stored, without a round trip each.

nats-py has no `Consume` (nats.go's continuous pull): its `fetch()` sends a pull request per
batch, waits for the server's answer before it returns (one round trip per batch, which at one
request in flight is one per request), and starts a task per message (`next_msg`). Here one
subscription on a private inbox receives every message of the durable consumer; a pull request for
`batch` messages is kept outstanding and topped up when half of it has arrived, so the server
pushes each request to us the moment it is stored. The server's status messages keep the count
honest: 408 (the pull expired) and 409 (e.g. leadership change) say how many of it were never
sent; idle heartbeats (status 100) show the pull is alive, and a pull silent for two heartbeats, or
a reconnect, is sent again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg

logger = structlog.get_logger("ndif.pull")

_STATUS = "Status"
_PENDING_MSGS = "Nats-Pending-Messages"


class ConsumerGone(Exception):
    """The durable consumer was deleted under us: the owner makes it again."""


class PullConsumer:
    def __init__(self, nc: Any, stream: str, durable: str, on_msg: Callable[[Msg], Awaitable[None]], *,
                 batch: int = 64, expires_s: float = 30.0, heartbeat_s: float = 2.0,
                 hold: Callable[[], bool] = lambda: False) -> None:
        self.nc = nc
        self.on_msg = on_msg
        self.batch = batch
        self.expires_s = expires_s
        self.heartbeat_s = heartbeat_s
        self.hold = hold  # True while the owner holds enough: no new pull until it is False again
        self.api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.pending = 0  # messages asked for and not yet delivered or given back by a status
        self.pulls = 0
        self._seen = time.monotonic()
        self._wake = asyncio.Event()
        self._gone: str | None = None

    def wake(self) -> None:
        """Look again at whether to pull (the owner calls it when it stops holding)."""
        self._wake.set()

    async def run(self) -> None:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=self._cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
        reconnects = self.nc.stats["reconnects"]
        try:
            while True:
                if self._gone is not None:
                    raise ConsumerGone(self._gone)
                now = time.monotonic()
                if self.nc.stats["reconnects"] != reconnects or now - self._seen > 2 * self.heartbeat_s:
                    # Our pull died with the old connection (or the server forgot it): ask again.
                    reconnects = self.nc.stats["reconnects"]
                    self.pending, self._seen = 0, now
                if self.pending <= self.batch // 2 and not self.hold():
                    want = self.batch - self.pending
                    body = {"batch": want, "expires": int(self.expires_s * 1e9),
                            "idle_heartbeat": int(self.heartbeat_s * 1e9)}
                    await self.nc.publish(self.api, json.dumps(body).encode(), reply=inbox)
                    self.pending += want
                    self.pulls += 1
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except TimeoutError:
                    pass
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closed connection: nothing to take back
                pass

    async def _cb(self, msg: Msg) -> None:
        self._seen = time.monotonic()
        # The server's statuses come with no payload and no reply; a delivered request always has
        # its ack subject as reply, whatever its headers say.
        status = msg.headers.get(_STATUS) if msg.headers and not msg.data and not msg.reply else None
        if status is None:
            self.pending = max(0, self.pending - 1)
            if self.pending <= self.batch // 2:
                self._wake.set()
            await self.on_msg(msg)
            return
        if status == "100":
            return  # idle heartbeat: the pull is alive
        desc = (msg.headers or {}).get("Description", "")
        if status == "409" and "Consumer Deleted" in desc:
            self._gone = desc
        left = (msg.headers or {}).get(_PENDING_MSGS)
        # A pull that ended (expired, or a 409) gives back what it never sent; without a count, all.
        self.pending = max(0, self.pending - int(left)) if left is not None else 0
        if status not in ("408", "404"):
            logger.info("pull_status", status=status, description=desc, pending=self.pending)
        self._wake.set()
