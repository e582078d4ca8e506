"""The bookkeeping of a node's pool of pre-started replica processes (no Ray here: the adapter does that).

A cold start through Ray spends most of its time in a new process importing torch and transformers
(docs/benchmarks.md "Loading"). The agent keeps `size` idle processes per node that have already
done so (ray_adapter.create_pooled_actor); a COLD load takes one (`take`) and hands it the replica's
identity, so it costs the weight load. `refill` says which new members to start; a member counts
as ready only once its process answered (`ready`). A pooled process holds no GPU and no replica:
it is never capacity (the agent's GPUs are declared, and placement counts replicas only).

Members are named `ModelPool:<node token>:<n>` (`member_name`), never the replica contract's
`ModelActor:` prefix, so nothing takes a pooled process for a replica before it is handed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.subjects import node_token

POOL_PREFIX = "ModelPool:"
MAX_POOL_SIZE = 16  # idle processes of ~0.5 GiB each: more is a setting mistake


def member_prefix(node_id: str) -> str:
    return f"{POOL_PREFIX}{node_token(node_id)}:"


def member_name(node_id: str, n: int) -> str:
    return f"{member_prefix(node_id)}{n}"


def check_size(size: int) -> int:
    if not 0 <= size <= MAX_POOL_SIZE:
        raise ValueError(f"the pool size must be 0..{MAX_POOL_SIZE} (0: no pool), got {size}")
    return size


@dataclass
class Pool:
    """Who is in a node's pool: members starting (process not up yet) and ready (imports done).

    Taken members leave at once (they are replicas now); failed ones too. `refill` numbers new
    members past every number ever used, so a name is never reused while Ray may still hold it."""

    node_id: str
    size: int
    starting: dict[str, Any] = field(default_factory=dict)  # name -> handle
    ready: dict[str, Any] = field(default_factory=dict)  # name -> handle, oldest first
    _next: int = 0

    def __post_init__(self) -> None:
        check_size(self.size)

    def refill(self) -> list[str]:
        """Names of the members to start now so that starting + ready reaches `size`; they are
        counted as starting once `started` is told their handles."""
        want = self.size - len(self.starting) - len(self.ready)
        names = [member_name(self.node_id, self._next + i) for i in range(max(0, want))]
        self._next += len(names)
        return names

    def started(self, name: str, handle: Any) -> None:
        self.starting[name] = handle

    def up(self, name: str) -> None:
        """Its process answered: ready to be taken (nothing when it already left the pool)."""
        if name in self.starting:
            self.ready[name] = self.starting.pop(name)

    def failed(self, name: str) -> None:
        self.starting.pop(name, None)
        self.ready.pop(name, None)

    def take(self) -> tuple[str, Any] | None:
        """The oldest ready member, out of the pool; None when none is ready."""
        if not self.ready:
            return None
        name = next(iter(self.ready))
        return name, self.ready.pop(name)

    def seen(self, numbers: list[int]) -> None:
        """Member numbers Ray already holds (a restarted agent's): new names go past them."""
        if numbers:
            self._next = max(self._next, max(numbers) + 1)

    def report(self) -> tuple[int, int]:
        """(ready, size): what `ndif status` shows as `pool ready/size`."""
        return len(self.ready), self.size


def member_number(node_id: str, name: str) -> int | None:
    """n of this node's member name `ModelPool:<ntok>:<n>`, else None."""
    prefix = member_prefix(node_id)
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None
