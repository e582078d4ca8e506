"""The page's node and model views as typed structs, encoded as the JSON objects the page reads.

`/api/state` builds one of these per node, card, replica block and model replica row (about 20,000
for 1,000 nodes x 8 cards and 5,000 replicas), live and at every timeline position. As msgspec
structs they are made, encoded and freed faster than dicts with the same keys, and with `gc=False`
the cyclic collector does not track them (they hold strings, numbers and lists of each other: no
cycles). Field order is the JSON's key order; the builders are in model.py.
"""

from __future__ import annotations

import msgspec


class Block(msgspec.Struct, gc=False):
    """A replica's bytes on one card."""

    model_key: str
    name: str
    replica_id: int
    bytes: int
    level: str
    state: str


class Card(msgspec.Struct, gc=False):
    index: int
    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    replicas: list[Block]


class Held(msgspec.Struct, gc=False):
    """A replica's weights held in a node's CPU cache (WARM)."""

    model_key: str
    name: str
    replica_id: int
    bytes: int


class Node(msgspec.Struct, gc=False):
    node_id: str
    alive: bool
    hostname: str
    since_seq: int
    cpu_cache_bytes: int
    cpu_cached_bytes: int
    warm: list[Held]
    gpus: list[Card]


class ReplicaRow(msgspec.Struct, gc=False):
    """One replica in its model's row."""

    replica_id: int
    state: str
    level: str
    desired: str
    node_id: str
    gpu_indices: list[int]  # the cards it holds now (none when COLD or WARM), as `ndif status` prints them
    since_seq: int
    restarts: int
    error: str | None
    where: str = "-"  # `ndif status`'s cards column: the cards, `cpu` (WARM) or `-` (nothing held)
