"""A replica's endpoint: the actor's side of the replica call over NATS (dataplane/serving/link.py
is the dispatcher's side, and says why the call goes over NATS first, Ray second; the messages are
dataplane/replica/wire.py's).

Runs inside the replica's process, on a thread and connection of its own.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from controlplane.store.credentials import Creds
from controlplane.store.eventstore import connect
from dataplane.replica.wire import HEADROOM_BYTES, Answer, Answers, Parked, decode_call, encode_reply
from schemas.guard import Refused

logger = structlog.get_logger("ndif.replica_endpoint")

# The call's id, as the dispatcher knows it (its reply subject). The endpoint's own view of the reply
# subject is not it: a call that crosses from the system's account into a node agent's (its
# export, controlplane/ops/auth.py) arrives with a reply subject the server made up for the way back.
# Parked answers and "is this call still active" go by this id.
CALL_HEADER = "Ndif-Call"
RETRY_S = 5.0  # an endpoint that could not connect tries again this much later (Ray serves meanwhile)
PARKED_MAX = 16  # answers an actor keeps for the dispatchers to take through Ray (oldest dropped) ...
PARKED_TTL_S = 60.0  # ... and for how long (a dispatcher takes one at once; one that died never will)
# Calls served at once: each waits in the replica's turns (dataplane/replica/turns.py), where the
# next request is chosen fairly, so the pool holds every call the dispatchers keep at a replica
# (dispatchers x NDIF_REPLICA_LANES, 2 by default); a call beyond it waits in arrival order.
CALL_THREADS = 16
_PARKED = encode_reply(Parked())


class ReplicaEndpoint:
    """Serves `run_batch` on a replica's subject, from a thread (and connection) of its own.

    The batches run in a small pool, not on the endpoint's loop, so a long generation never holds
    up the connection (pings, other lanes' calls). Connecting never blocks the actor: until it is
    connected the dispatchers get "no responders" and use Ray.
    """

    def __init__(self, url: str, subject: str, run_batch: Callable[[list[dict[str, Any]], list[str]], list[Answer]], *,
                 name: str = "ndif-replica", max_answer_bytes: int | None = None,
                 creds: Creds | None = None, **log_fields: Any) -> None:
        self.url = url
        self.creds = creds  # the node agent's user: it may serve its own node's `ndif.run.<ntok>.>`
        self.logger = logger.bind(subject=subject, **log_fields)
        self.subject = subject
        self.name = name
        self.max_answer_bytes = max_answer_bytes
        self._run_batch = run_batch
        self._pool = concurrent.futures.ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="ndif-endpoint-run")
        self._loop = asyncio.new_event_loop()
        self._active: set[str] = set()  # ids of the calls being answered (CALL_HEADER)
        self._parked: collections.OrderedDict[str, tuple[float, list[Answer]]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.nc: Any = None
        self.started = time.monotonic()

    def start(self) -> ReplicaEndpoint:
        self.started = time.monotonic()
        threading.Thread(target=self._loop.run_forever, name="ndif-endpoint", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
        return self

    async def _connect(self) -> None:
        while True:
            try:
                self.nc = await connect(self.url, name=self.name, creds=self.creds)
                await self.nc.subscribe(self.subject, cb=self._on_call)
                await self.nc.flush()
                self._subscribed.set()
                self.logger.info("replica_endpoint_ready")
                return
            except Exception as exc:  # noqa: BLE001 - NATS not reachable yet: Ray serves meanwhile
                self.logger.warning("replica_endpoint_unavailable", error=str(exc), retry_s=RETRY_S)
                if self.nc is not None:
                    with contextlib.suppress(Exception):
                        await self.nc.close()
                await asyncio.sleep(RETRY_S)

    def ready(self, timeout: float = 10.0) -> bool:
        """Wait (at most `timeout` s) until the endpoint is subscribed."""
        deadline = time.monotonic() + timeout
        while not (self._subscribed.is_set() and self.nc.is_connected):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))
        return True

    async def _on_call(self, msg: Msg) -> None:
        if not msg.reply:
            return
        call = (msg.headers or {}).get(CALL_HEADER) or msg.reply
        self._active.add(call)
        t = asyncio.ensure_future(self._serve(msg, call))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg, call: str) -> None:
        try:
            batch = decode_call(msg.data)
            if isinstance(batch, Refused):  # unanswered: the dispatcher's check finds it lost
                self.logger.warning("replica_endpoint_call_refused", reason=batch.reason[:300])
                return
            answers = await self._loop.run_in_executor(self._pool, self._run_batch, batch.payloads, batch.users)
            try:
                body = encode_reply(Answers(answers=answers))
            except (TypeError, msgspec.EncodeError):
                body = b""  # not msgpack-able: through Ray (pickle)
            limit = self.max_answer_bytes or (self.nc.max_payload - HEADROOM_BYTES)
            if not body or len(body) > limit:
                with self._lock:
                    now = time.monotonic()
                    self._parked[call] = (now, answers)
                    while len(self._parked) > PARKED_MAX or next(iter(self._parked.values()))[0] < now - PARKED_TTL_S:
                        self._parked.popitem(last=False)
                body = _PARKED
            await self.nc.publish(msg.reply, body)
        except Exception as exc:  # noqa: BLE001 - unanswered: the dispatcher's check finds it lost
            self.logger.error("replica_endpoint_call_failed", error=str(exc))
        finally:
            self._active.discard(call)

    def calls_active(self, replies: list[str]) -> list[bool]:
        """Which of these calls (by id: the dispatcher's reply subject) this replica still works on
        (or keeps a parked answer of)."""
        return [r in self._active or r in self._parked for r in replies]

    def take_answer(self, reply: str) -> list[Answer] | None:
        with self._lock:
            kept = self._parked.pop(reply, None)
        return None if kept is None else kept[1]

    def close(self) -> None:
        async def _close() -> None:
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await self.nc.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pool.shutdown(wait=False)
