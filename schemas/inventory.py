"""The operator's inventory: which nodes may serve, with which cards (docs/architecture.md §3).

A JSON file the controller is given (`ndif controller --inventory FILE`, env NDIF_INVENTORY;
`ndif up` declares its own node from `--gpus` or the cards it finds):

    {"nodes": {"gpu-a.cluster": {"cards": [{"count": 8, "memory_bytes": 85899345920, "kind": "H100"}],
                                 "labels": {"zone": "a"}}}}

The controller records it in the log (`NodeDeclared`, one per node), and from the first declaration
on a node's capacity is what is declared for it: its agent's report (`NodeJoined`) can lower it
(a card it cannot see), never raise it, and a report beyond it is an anomaly, not capacity
(controlplane/core/inventory.py). Cards are numbered in the order declared. `kind` and `labels`
name what a card and a node are: a model's `Requirements` (`ndif deploy --require`) are met
against them.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from schemas.errors import InvalidCommand, decode_bounded

MAX_CARDS_PER_NODE: Final = 64
MAX_CARD_BYTES: Final = 512 * 2**30  # above any accelerator's memory: a report above it is not a card
MAX_CPU_CACHE_BYTES: Final = 64 * 2**40
MAX_NODES: Final = 512  # a declaration is one atomic append of a node's event each
MAX_INVENTORY_BYTES: Final = 1 << 20
_NAME = re.compile(r"[\x21-\x7e][\x20-\x7e]{0,127}")  # node ids, kinds, label keys and values: printable ASCII


class CardGroup(msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True):
    """`count` cards of `memory_bytes` each, of one `kind` (e.g. "H100")."""

    count: int
    memory_bytes: int
    kind: str = ""


class NodeInventory(msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True):
    """What one node may offer: its cards, its labels, and at most `cpu_cache_bytes` of CPU cache for
    WARM replicas (None: what its agent reports)."""

    cards: tuple[CardGroup, ...] = ()
    labels: dict[str, str] = {}
    cpu_cache_bytes: int | None = None

    def card_list(self) -> list[tuple[int, CardGroup]]:
        """Each declared card as (index, its group), indices in the order declared."""
        out: list[tuple[int, CardGroup]] = []
        for g in self.cards:
            out.extend((len(out), g) for _ in range(g.count))
        return out


class Inventory(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The operator's file: node id -> what it may offer."""

    nodes: dict[str, NodeInventory] = {}


_decoder = msgspec.json.Decoder(Inventory)


def check_node(node_id: str, node: NodeInventory) -> NodeInventory:
    """Refuse (InvalidCommand) a node declaration no real node fits; return it unchanged."""
    where = f"inventory node {node_id[:80]!r}"
    if not _NAME.fullmatch(node_id):
        raise InvalidCommand(f"{where}: a node id is 1-128 printable ASCII characters")
    total = 0
    for g in node.cards:
        if not 0 <= g.count <= MAX_CARDS_PER_NODE:
            raise InvalidCommand(f"{where}: a card count is 0 to {MAX_CARDS_PER_NODE}, got {g.count}")
        if not 0 < g.memory_bytes <= MAX_CARD_BYTES:
            raise InvalidCommand(f"{where}: a card's memory_bytes is 1 to {MAX_CARD_BYTES}, got {g.memory_bytes}")
        if g.kind and not _NAME.fullmatch(g.kind):
            raise InvalidCommand(f"{where}: a card kind is 1-128 printable ASCII characters")
        total += g.count
    if total > MAX_CARDS_PER_NODE:
        raise InvalidCommand(f"{where}: {total} cards, over {MAX_CARDS_PER_NODE} per node")
    if len(node.labels) > 32 or not all(_NAME.fullmatch(k) and _NAME.fullmatch(v) for k, v in node.labels.items()):
        raise InvalidCommand(f"{where}: at most 32 labels, keys and values of 1-128 printable ASCII characters")
    if node.cpu_cache_bytes is not None and not 0 <= node.cpu_cache_bytes <= MAX_CPU_CACHE_BYTES:
        raise InvalidCommand(f"{where}: cpu_cache_bytes is 0 to {MAX_CPU_CACHE_BYTES}, got {node.cpu_cache_bytes}")
    return node


def check_inventory(inv: Inventory) -> Inventory:
    if len(inv.nodes) > MAX_NODES:
        raise InvalidCommand(f"the inventory declares {len(inv.nodes)} nodes, over the limit of {MAX_NODES}")
    for node_id, node in inv.nodes.items():
        check_node(node_id, node)
    return inv


def decode_inventory(data: bytes) -> Inventory:
    """The operator's inventory file, checked: the inventory, or InvalidCommand with the reason."""
    return check_inventory(decode_bounded(_decoder, data, limit=MAX_INVENTORY_BYTES, what="inventory"))


def local_inventory(node_id: str, cards: list[tuple[int, str]]) -> Inventory:
    """One node's inventory from its cards as (memory_bytes, kind), consecutive equal cards in one group
    (what `ndif up` declares for its own node)."""
    groups: list[CardGroup] = []
    for mem, name in cards:
        kind = name if _NAME.fullmatch(name) else ""
        if groups and (groups[-1].memory_bytes, groups[-1].kind) == (mem, kind):
            groups[-1] = CardGroup(count=groups[-1].count + 1, memory_bytes=mem, kind=kind)
        else:
            groups.append(CardGroup(count=1, memory_bytes=mem, kind=kind))
    return check_inventory(Inventory(nodes={node_id: NodeInventory(cards=tuple(groups))}))


MAX_REQUIREMENTS: Final = 16


class Requirements(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True,
                   forbid_unknown_fields=True):
    """What a node must offer to hold a model's replicas (`ndif deploy --require`), as Seldon's
    scheduler filters servers by their capabilities: every card of the kind `gpu`, every card at
    least `min_card_bytes`, and each of `labels` (the operator's inventory says all three)."""

    gpu: str = ""
    min_card_bytes: int = 0
    labels: dict[str, str] = {}

    def terms(self) -> list[str]:
        """Each requirement as the operator types it (`gpu=H100`, `gpu-memory-gib=40`, `pool=research`)."""
        out = [f"gpu={self.gpu}"] if self.gpu else []
        if self.min_card_bytes:
            out.append(f"gpu-memory-gib={self.min_card_bytes / 2**30:g}")
        return out + [f"{k}={v}" for k, v in sorted(self.labels.items())]


def parse_requirements(items: list[str]) -> Requirements | None:
    """`--require KEY=VALUE` items: `gpu=KIND`, `gpu-memory-gib=N` (the least memory per card, GiB),
    any other key a label the node must carry with that value. None for no items; InvalidCommand for
    a malformed item."""
    if not items:
        return None
    gpu, min_bytes, labels = "", 0, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidCommand(f"--require takes KEY=VALUE (gpu=H100, gpu-memory-gib=40, pool=research), got {item!r}")
        if key == "gpu":
            gpu = value
        elif key == "gpu-memory-gib":
            try:
                gib = float(value)
            except ValueError:
                raise InvalidCommand(f"--require gpu-memory-gib takes a number of GiB, got {value!r}") from None
            min_bytes = int(gib * 2**30) if 0 < gib * 2**30 <= MAX_CARD_BYTES else -1
        else:
            labels[key] = value
    return check_requirements(Requirements(gpu=gpu, min_card_bytes=min_bytes, labels=labels))


def check_requirements(req: Requirements) -> Requirements:
    """Refuse (InvalidCommand) requirements no node could be declared to meet; return them unchanged."""
    if len(req.labels) > MAX_REQUIREMENTS:
        raise InvalidCommand(f"at most {MAX_REQUIREMENTS} label requirements, got {len(req.labels)}")
    if req.gpu and not _NAME.fullmatch(req.gpu):
        raise InvalidCommand("--require gpu=KIND: a card kind is 1-128 printable ASCII characters")
    if not 0 <= req.min_card_bytes <= MAX_CARD_BYTES:
        raise InvalidCommand(f"--require gpu-memory-gib is above 0 and at most {MAX_CARD_BYTES // 2**30}")
    if not all(_NAME.fullmatch(k) and _NAME.fullmatch(v) for k, v in req.labels.items()):
        raise InvalidCommand("--require KEY=VALUE: keys and values are 1-128 printable ASCII characters")
    return req
