"""Where time, ids and seeds enter: the pure core gets them through a `DecisionContext`.

Adapters (agents, CLI, controller loop) build one from the real clock; tests build one by hand.
Event ids inside a decision are `<command_id>.<n>`, so a resent decision carries the same ids and
JetStream's dedup (and our read-back) recognise it.
"""

from __future__ import annotations

import itertools
from datetime import datetime
from typing import Any, TypeVar

from schemas.events import Event

E = TypeVar("E", bound=Event)


class DecisionContext:
    """Deterministic inputs of one decision: `now`, `actor`, `command_id`, `seed`, and id minting."""

    def __init__(self, *, now: datetime, actor: str, command_id: str, seed: int = 0,
                 correlation_id: str | None = None) -> None:
        self.now = now
        self.actor = actor
        self.command_id = command_id
        self.correlation_id = correlation_id or command_id
        self.seed = seed
        self._n = itertools.count()

    def event(self, cls: type[E], **fields: Any) -> E:
        return cls(event_id=f"{self.command_id}.{next(self._n)}", ts=self.now, actor=self.actor,
                   command_id=self.command_id, correlation_id=self.correlation_id, **fields)
