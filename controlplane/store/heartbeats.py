"""Node heartbeats as the KV bucket `ndif_heartbeats` keeps them: when each node's agent last beat.

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
from typing import Any

import msgspec
import nats.js.errors

from schemas.subjects import HEARTBEATS_BUCKET, node_token

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


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime  # the server's time of the last put
    seq: int  # its stream sequence: a later beat has a higher one
    stopped: bool = False  # the agent's goodbye (an empty value): it stopped cleanly

    def age_s(self, now: datetime | None = None) -> float:
        return max(0.0, ((now or datetime.now(UTC)) - self.at).total_seconds())


async def last_heartbeat(js: Any, node_id: str) -> Heartbeat | None:
    """The last heartbeat of `node_id` still kept in KV, or None (never beat, or expired)."""
    try:
        raw = await js.get_msg(f"KV_{HEARTBEATS_BUCKET}", subject=f"$KV.{HEARTBEATS_BUCKET}.{node_token(node_id)}")
    except (nats.js.errors.NotFoundError, nats.js.errors.KeyNotFoundError):
        return None
    headers = raw.headers or {}
    if headers.get("KV-Operation") in ("DEL", "PURGE") or raw.time is None:
        return None
    if not beat_counts(node_token(node_id), raw.data):
        return None  # not a beat of this node (forged, or junk): as if none were kept
    at = raw.time if raw.time.tzinfo is not None else raw.time.replace(tzinfo=UTC)
    return Heartbeat(at=at, seq=int(raw.seq or 0), stopped=not raw.data)


async def heartbeat_ages(js: Any, node_ids: list[str]) -> dict[str, float | None]:
    """Seconds since each node's last heartbeat (None: no heartbeat kept, i.e. none for a while)."""
    now = datetime.now(UTC)
    out: dict[str, float | None] = {}
    for node_id in node_ids:
        hb = None
        with contextlib.suppress(nats.js.errors.APIError):
            hb = await last_heartbeat(js, node_id)
        out[node_id] = round(hb.age_s(now), 1) if hb is not None else None
    return out
