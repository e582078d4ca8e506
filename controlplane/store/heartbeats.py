"""Node heartbeats as the KV bucket `ndif_heartbeats` keeps them: when each node's agent last beat.

Agents put their key every `--heartbeat` seconds (2 by default; the value is the node id) and,
stopping cleanly, once more with an empty value (`stopped`); the bucket forgets a key
`HEARTBEAT_TTL_S` after its last put. `ndif status` shows each node's heartbeat age and marks it
stale past `STALE_S`; an agent refuses to start under a node id whose heartbeat is still live.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.js.errors

from schemas.subjects import HEARTBEATS_BUCKET, node_token

STALE_S = 6.0  # three missed beats at the agents' default 2 s interval


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    at: datetime  # the server's time of the last put
    seq: int  # its stream sequence: a later beat has a higher one
    stopped: bool = False  # the agent's goodbye (an empty value): it stopped cleanly

    def age_s(self, now: datetime | None = None) -> float:
        return max(0.0, ((now or datetime.now(UTC)) - self.at).total_seconds())


def heartbeat_subject(node_id: str) -> str:
    """`$KV.ndif_heartbeats.<ntok>`: where a node's agent puts its heartbeat (the bucket's key)."""
    return f"$KV.{HEARTBEATS_BUCKET}.{node_token(node_id)}"


async def beat(js: Any, node_id: str, *, stopped: bool = False) -> None:
    """Put a node's heartbeat (its node id; empty: it stopped cleanly). A plain JetStream publish on
    the key's subject, so an agent needs no grant on the bucket's stream API (its info would list
    every node's key)."""
    await js.publish(heartbeat_subject(node_id), b"" if stopped else node_id.encode())


async def last_heartbeat(js: Any, node_id: str, *, direct: bool = False) -> Heartbeat | None:
    """The last heartbeat of `node_id` still kept in KV, or None (never beat, or expired).

    `direct`: by a direct get that names the key in the API subject (what a node's agent may do for
    its own key only); else by a stored get."""
    try:
        raw = await js.get_msg(f"KV_{HEARTBEATS_BUCKET}", subject=heartbeat_subject(node_id), direct=direct)
    except (nats.js.errors.NotFoundError, nats.js.errors.KeyNotFoundError):
        return None
    headers = raw.headers or {}
    if headers.get("KV-Operation") in ("DEL", "PURGE") or raw.time is None:
        return None
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
