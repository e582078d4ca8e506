"""Node heartbeats (the `Heartbeats` port, controlplane/core/ports.py): the KV bucket `ndif_heartbeats`,
and an in-memory store for tests.

Agents put their key every `--heartbeat` seconds (2 by default; the value is the node id) and,
stopping cleanly, once more with an empty value (`stopped`); the bucket forgets a key
`HEARTBEAT_TTL_S` after its last put. `ndif status` shows each node's heartbeat age and marks it
stale past `STALE_S`; an agent refuses to start under a node id whose heartbeat is still live.
A value counts as a beat only if it names its key's node and is small (`beat_counts`): anything
else on a node's key (junk, another node's id, a large body) is no heartbeat.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime

import nats.js.errors
from nats.js.client import JetStreamContext

from controlplane.core.ports import Heartbeat, Heartbeats
from schemas.errors import InfrastructureError
from schemas.subjects import HEARTBEATS_BUCKET, node_token

__all__ = ["STALE_S", "Heartbeat", "JetStreamHeartbeats", "MemoryHeartbeats", "heartbeat_ages"]

STALE_S = 6.0  # three missed beats at the agents' default 2 s interval
MAX_BEAT_BYTES = 256  # a node id; a larger value is not a heartbeat


def beat_counts(key: str, value: bytes | None) -> bool:
    """Whether a put of `value` on heartbeat key `key` (a node token) is a beat of that node: the
    node's id, small, whose token is the key; or empty (the agent's goodbye)."""
    if not value:
        return True
    if len(value) > MAX_BEAT_BYTES:
        return False
    try:
        return node_token(value.decode("utf-8")) == key
    except UnicodeDecodeError:
        return False


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

    async def beat(self, node_id: str) -> None:
        await self.js.publish(heartbeat_subject(node_id), node_id.encode())

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
        return Heartbeat(at=at, seq=int(raw.seq or 0), stopped=not raw.data)


class MemoryHeartbeats:
    """`Heartbeats` in memory (no expiry: `forget` is what the bucket's TTL does)."""

    def __init__(self) -> None:
        self.kept: dict[str, Heartbeat] = {}
        self._seq = 0

    async def beat(self, node_id: str) -> None:
        self._put(node_id, stopped=False)

    async def goodbye(self, node_id: str) -> None:
        self._put(node_id, stopped=True)

    async def last(self, node_id: str) -> Heartbeat | None:
        return self.kept.get(node_id)

    def forget(self, node_id: str) -> None:
        self.kept.pop(node_id, None)

    def _put(self, node_id: str, *, stopped: bool) -> None:
        self._seq += 1
        self.kept[node_id] = Heartbeat(at=datetime.now(UTC), seq=self._seq, stopped=stopped)


async def heartbeat_ages(beats: Heartbeats, node_ids: list[str]) -> dict[str, float | None]:
    """Seconds since each node's last heartbeat (None: no heartbeat kept, i.e. none for a while)."""
    now = datetime.now(UTC)
    out: dict[str, float | None] = {}
    for node_id in node_ids:
        hb = None
        with contextlib.suppress(nats.js.errors.APIError, InfrastructureError):
            hb = await beats.last(node_id)
        out[node_id] = round(hb.age_s(now), 1) if hb is not None else None
    return out
