"""The real clock and fresh ids, for the adapters (controller loop, agents, dispatcher) that stamp
what they observe. The pure core never calls these: it gets time and ids through a
`DecisionContext` (controlplane/core/context.py).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, TypeVar

from schemas.events import Event

E = TypeVar("E", bound=Event)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def observed(cls: type[E], *, actor: str, **fields: Any) -> E:
    """An observed fact stamped now with a fresh id (agents, dispatcher: adapters only)."""
    return cls(event_id=new_id(), ts=utcnow(), actor=actor, **fields)
