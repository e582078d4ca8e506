"""Node heartbeats (the `Heartbeats` port, controlplane/core/ports.py): the KV bucket `ndif_heartbeats`,
and an in-memory store for tests.

Agents put their key every `--heartbeat` seconds (2 by default; the value is the node id, then
`\npool R/S` for an agent keeping a replica process pool: R ready of S) and,
stopping cleanly, once more with an empty value (`stopped`); the bucket forgets a key
`HEARTBEAT_TTL_S` after its last put. `ndif status` shows each node's heartbeat age and marks it
stale past `STALE_S`; an agent refuses to start under a node id whose heartbeat is still live.
A value counts as a beat only if it names its key's node and is small (`beat_counts`): anything
else on a node's key (junk, another node's id, a large body) is no heartbeat.
"""

from __future__ import annotations

import contextlib
import re
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.client import JetStreamContext

from controlplane.core.ports import Heartbeat, Heartbeats
from schemas.errors import InfrastructureError
from schemas.guard import decode_any
from schemas.subjects import EVENTS_STREAM, HEARTBEATS_BUCKET, node_token

__all__ = ["STALE_S", "Heartbeat", "JetStreamHeartbeats", "MemoryHeartbeats", "ages", "beat_value", "heartbeat_ages",
           "last_beats", "last_heard"]

STALE_S = 6.0  # three missed beats at the agents' default 2 s interval
MAX_BEAT_BYTES = 256  # a node id; a larger value is not a heartbeat


def beat_value(node_id: str, pool: tuple[int, int] | None = None) -> bytes:
    """What a beat puts: the node id, and `\npool R/S` when the agent keeps a process pool."""
    return (node_id if pool is None else f"{node_id}\npool {pool[0]}/{pool[1]}").encode()


def _parse_pool(rest: str) -> tuple[int, int] | None:
    """(ready, size) of a beat's `pool R/S` line; None for anything else."""
    ready, sep, size = rest.removeprefix("pool ").partition("/")
    if not rest.startswith("pool ") or not sep or not (ready.isdigit() and size.isdigit()) or len(rest) > 32:
        return None
    return int(ready), int(size)


def beat_counts(key: str, value: bytes | None) -> bool:
    """Whether a put of `value` on heartbeat key `key` (a node token) is a beat of that node: the
    node's id (then at most its pool line), small, whose token is the key; or empty (the agent's goodbye)."""
    if not value:
        return True
    if len(value) > MAX_BEAT_BYTES:
        return False
    try:
        node_id, sep, rest = value.decode("utf-8").partition("\n")
    except UnicodeDecodeError:
        return False
    return node_token(node_id) == key and (not sep or _parse_pool(rest) is not None)


def heartbeat_subject(node_id: str) -> str:
    """`$KV.ndif_heartbeats.<ntok>`: where a node's agent puts its heartbeat (the bucket's key)."""
    return f"$KV.{HEARTBEATS_BUCKET}.{node_token(node_id)}"


class JetStreamHeartbeats:
    """`Heartbeats` in the KV bucket `ndif_heartbeats` (key: the node's token).

    A beat is a plain JetStream publish on the key's subject, so an agent needs no grant on the
    bucket's stream API (its info would list every node's key). `direct`: reads by a direct get that
    names the key in the API subject (what a node's agent may do, for its own key only); else by a
    stored get (the controller, the CLI)."""

    def __init__(self, js: JetStreamContext, *, direct: bool = False) -> None:
        self.js = js
        self.direct = direct

    async def beat(self, node_id: str, pool: tuple[int, int] | None = None) -> None:
        await self.js.publish(heartbeat_subject(node_id), beat_value(node_id, pool))

    async def goodbye(self, node_id: str) -> None:
        await self.js.publish(heartbeat_subject(node_id), b"")

    async def last(self, node_id: str) -> Heartbeat | None:
        try:
            raw = await self.js.get_msg(f"KV_{HEARTBEATS_BUCKET}", subject=heartbeat_subject(node_id),
                                        direct=self.direct)
        except (nats.js.errors.NotFoundError, nats.js.errors.KeyNotFoundError):
            return None
        headers = raw.headers or {}
        if headers.get("KV-Operation") in ("DEL", "PURGE") or raw.time is None:
            return None
        if not beat_counts(node_token(node_id), raw.data):
            return None  # not a beat of this node (forged, or junk): as if none were kept
        at = raw.time if raw.time.tzinfo is not None else raw.time.replace(tzinfo=UTC)
        _, _, rest = (raw.data or b"").decode(errors="replace").partition("\n")
        return Heartbeat(at=at, seq=int(raw.seq or 0), stopped=not raw.data, pool=_parse_pool(rest))


class MemoryHeartbeats:
    """`Heartbeats` in memory (no expiry: `forget` is what the bucket's TTL does)."""

    def __init__(self) -> None:
        self.kept: dict[str, Heartbeat] = {}
        self._seq = 0

    async def beat(self, node_id: str, pool: tuple[int, int] | None = None) -> None:
        self._put(node_id, stopped=False, pool=pool)

    async def goodbye(self, node_id: str) -> None:
        self._put(node_id, stopped=True)

    async def last(self, node_id: str) -> Heartbeat | None:
        return self.kept.get(node_id)

    def forget(self, node_id: str) -> None:
        self.kept.pop(node_id, None)

    def _put(self, node_id: str, *, stopped: bool, pool: tuple[int, int] | None = None) -> None:
        self._seq += 1
        self.kept[node_id] = Heartbeat(at=datetime.now(UTC), seq=self._seq, stopped=stopped, pool=pool)


async def last_beats(beats: Heartbeats, node_ids: list[str]) -> dict[str, Heartbeat | None]:
    """Each node's last heartbeat kept (None: none kept, i.e. none for a while, or unreadable)."""
    out: dict[str, Heartbeat | None] = {}
    for node_id in node_ids:
        out[node_id] = None
        with contextlib.suppress(nats.js.errors.APIError, InfrastructureError):
            out[node_id] = await beats.last(node_id)
    return out


def ages(seen: dict[str, Heartbeat | None]) -> dict[str, float | None]:
    now = datetime.now(UTC)
    return {n: round(hb.age_s(now), 1) if hb is not None else None for n, hb in seen.items()}


async def heartbeat_ages(beats: Heartbeats, node_ids: list[str]) -> dict[str, float | None]:
    """Seconds since each node's last heartbeat (None: no heartbeat kept, i.e. none for a while)."""
    return ages(await last_beats(beats, node_ids))


async def last_heard(nc: NatsClient, *, api: str, timeout: float = 5.0) -> datetime | None:
    """When the server last stored a heartbeat of any node or an event (None: neither, or
    unreadable): the times the server stamped, never a time a client wrote into a body. The beats
    themselves expire, but a stream keeps the time of its last message (`last_ts`) through their
    expiry and a restart of the server: the last moment anything of the cluster was heard."""
    times = [t for stream in (f"KV_{HEARTBEATS_BUCKET}", EVENTS_STREAM)
             if (t := await _last_stored(nc, api, stream, timeout)) is not None]
    return max(times, default=None)


async def _last_stored(nc: NatsClient, api: str, stream: str, timeout: float) -> datetime | None:
    try:
        msg = await nc.request(f"{api}.STREAM.INFO.{stream}", b"", timeout=timeout)
    except nats.errors.Error:
        return None
    body = decode_any(msg.data, limit=1 << 20, what="JetStream answer")  # a dict, or Refused
    state = body.get("state") if isinstance(body, dict) else None
    if not isinstance(state, dict) or not state.get("last_seq") or not isinstance(state.get("last_ts"), str):
        return None
    return parse_server_time(state["last_ts"])


def parse_server_time(ts: str) -> datetime | None:
    """nats-server's RFC 3339 times carry nanoseconds (`...:43.36884743Z`); Python reads microseconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", ts.strip())
    if m is None:
        return None
    frac = (m.group(2) or "0")[:6].ljust(6, "0")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    try:
        return datetime.fromisoformat(f"{m.group(1)}.{frac}{zone}").astimezone(UTC)
    except (ValueError, OverflowError):
        return None
