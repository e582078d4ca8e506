"""A node's capacity is what the operator declared for it (schemas/inventory.py, controlplane/core/inventory.py).

The agent's `NodeJoined` can lower the declaration, never raise it: a report beyond it (8 cards of
1 TB on a node declared with 2 of 80 GB) is an anomaly, not capacity, and attracts no replica.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.context import DecisionContext
from controlplane.core.decide import decide, decide_inventory
from controlplane.core.inventory import admit
from controlplane.core.projections import ClusterState, decode_snapshot, encode_snapshot
from controlplane.core.projections.cluster import Registration
from schemas import events as E
from schemas.commands import Deploy
from schemas.errors import InvalidCommand
from schemas.inventory import CardGroup, Inventory, NodeInventory, decode_inventory, local_inventory
from schemas.subjects import node_subject

GB = 10**9
TB = 10**12
T0 = datetime(2026, 1, 1, tzinfo=UTC)
M = 'nnsight.modeling.language.LanguageModel:{"repo_id": "/models/big", "revision": null}'


def joined(node: str, n: int, mem: int, seq: int = 0) -> E.NodeJoined:
    return E.NodeJoined(event_id=f"join-{node}-{seq}", ts=T0, actor=f"agent:{node}", node_id=node,
                        cpu_cache_bytes=100 * GB, gpus=tuple(E.GpuInfo(index=i, memory_bytes=mem) for i in range(n)))


def inventory(**nodes: NodeInventory) -> Inventory:
    return Inventory(nodes={k.replace("_", "-"): v for k, v in nodes.items()})


def two_80() -> NodeInventory:
    return NodeInventory(cards=(CardGroup(count=2, memory_bytes=80 * GB, kind="H100"),), labels={"zone": "a"})


def fold(*events: E.Event) -> ClusterState:
    s = ClusterState()
    for i, ev in enumerate(events, 1):
        s.apply(i, ev)
    return s


def declared(state: ClusterState, inv: Inventory, n: int = 0) -> list[E.Event]:
    ctx = DecisionContext(now=T0, actor="controller:test", command_id=f"inventory-{n}")
    return decide_inventory(state, inv, ctx)


@pytest.mark.parametrize("mem", [TB, 100 * GB])
def test_a_node_announcing_8_big_cards_gets_no_more_than_was_declared(mem: int) -> None:
    s = ClusterState()
    evs = declared(s, inventory(node_a=two_80()))
    s = fold(*evs, joined("node-a", 8, mem))
    node = s.nodes["node-a"]
    if mem == TB:  # no card holds 1 TB: not a card at all
        assert node.gpus == ()
    else:  # the declared cards, at the declared memory
        assert [(g.index, g.memory_bytes, g.kind) for g in node.gpus] == [(0, 80 * GB, "H100"), (1, 80 * GB, "H100")]
    assert node.labels == {"zone": "a"} and node.reported is not None and len(node.reported) == 8
    (a,) = s.anomalies
    assert a.message.startswith("inventory of 'node-a'")
    assert ("not 1 to" in a.message) if mem == TB else ("card 0 reports" in a.message and "[2, 3, 4, 5, 6, 7]" in a.message)
    # It attracts no replica beyond what was declared: 500 GB does not fit 2 x 80 GB.
    ctx = DecisionContext(now=T0, actor="cli:test", command_id="d-1", seed=1)
    reg = Registration(checkpoint="/models/big", size_bytes=500 * GB)
    out = decide(s, Deploy(command_id="d-1", model_key=M, size_bytes=500 * GB), ctx, registration=reg)
    assert not [e for e in out if isinstance(e, E.ReplicaScheduled)]
    assert [e for e in out if isinstance(e, E.PlacementRejected)]


def test_without_any_declaration_the_report_stands_but_bounded() -> None:
    s = fold(joined("node-a", 2, 80 * GB))
    assert len(s.nodes["node-a"].gpus) == 2 and not s.anomalies and s.nodes["node-a"].reported is None
    s = fold(joined("node-b", 8, TB))
    assert s.nodes["node-b"].gpus == () and "not 1 to" in s.anomalies[0].message


def test_an_undeclared_node_offers_nothing_once_an_inventory_is_in_force() -> None:
    s = ClusterState()
    s = fold(*declared(s, inventory(node_a=two_80())), joined("node-a", 2, 80 * GB), joined("ghost", 4, 80 * GB))
    assert len(s.nodes["node-a"].gpus) == 2 and s.nodes["ghost"].gpus == ()
    assert s.nodes["ghost"].cpu_cache_bytes == 0
    (a,) = s.anomalies
    assert "'ghost' is not in the operator's inventory" in a.message


def test_a_report_below_the_declaration_lowers_it_quietly() -> None:
    s = ClusterState()
    s = fold(*declared(s, inventory(node_a=two_80())), joined("node-a", 1, 79 * GB))
    assert [(g.index, g.memory_bytes) for g in s.nodes["node-a"].gpus] == [(0, 79 * GB)] and not s.anomalies


def test_a_declaration_after_the_join_is_checked_against_the_report_kept() -> None:
    s = fold(joined("node-a", 8, 80 * GB), joined("node-b", 2, 80 * GB))  # no inventory yet: as reported
    assert len(s.nodes["node-a"].gpus) == 8
    first = declared(s, inventory(node_a=two_80()))
    for i, ev in enumerate(first, s.seq + 1):
        s.apply(i, ev)
    assert len(s.nodes["node-a"].gpus) == 2  # the first declaration: every node under the inventory
    assert s.nodes["node-b"].gpus == ()  # not declared
    more = NodeInventory(cards=(CardGroup(count=8, memory_bytes=80 * GB),))
    again = declared(s, inventory(node_a=more, node_b=two_80()), 1)
    assert [e.node_id for e in again] == ["node-a", "node-b"]  # type: ignore[attr-defined]
    for i, ev in enumerate(again, s.seq + 1):
        s.apply(i, ev)
    assert len(s.nodes["node-a"].gpus) == 8 and len(s.nodes["node-b"].gpus) == 2  # from the report kept


def test_declaring_the_same_inventory_again_decides_nothing_and_a_node_left_out_offers_nothing() -> None:
    s = ClusterState()
    s = fold(*declared(s, inventory(node_a=two_80(), node_b=two_80())))
    assert declared(s, inventory(node_a=two_80(), node_b=two_80())) == []
    out = declared(s, inventory(node_a=two_80()))
    assert [(e.node_id, e.node) for e in out] == [("node-b", NodeInventory())]  # type: ignore[attr-defined]


def test_a_declaration_is_refused_off_the_controllers_subject() -> None:
    ev = declared(ClusterState(), inventory(node_a=two_80()))[0]
    assert E.event_subject(ev).startswith("ndif.evt.cmd.")
    body = E.encode_event(ev)
    forged = E.stored_item(node_subject("node-a"), body)  # what an agent may write: its node's subject
    assert isinstance(forged, E.Skipped) and "NodeDeclared" in forged.reason
    assert isinstance(E.stored_item(E.event_subject(ev), body), E.NodeDeclared)


def test_the_inventory_survives_a_snapshot() -> None:
    s = ClusterState()
    s = fold(*declared(s, inventory(node_a=two_80())), joined("node-a", 8, TB))
    back = decode_snapshot(encode_snapshot(s))
    assert back == s and back.declared == s.declared and back.nodes["node-a"].labels == {"zone": "a"}


def test_the_operators_file() -> None:
    raw = (b'{"nodes": {"gpu-a.cluster": {"cards": [{"count": 8, "memory_bytes": 85899345920, "kind": "H100"}],'
           b' "labels": {"zone": "a"}}, "gpu-b.cluster": {"cards": [{"count": 1, "memory_bytes": 80000000000}]}}}')
    inv = decode_inventory(raw)
    assert len(inv.nodes["gpu-a.cluster"].card_list()) == 8 and inv.nodes["gpu-b.cluster"].labels == {}
    for bad in (b'{"nodes": {"a": {"cards": [{"count": 8, "memory_bytes": 1000000000000}]}}}',  # 1 TB cards
                b'{"nodes": {"a": {"cards": [{"count": 65, "memory_bytes": 1}]}}}',
                b'{"nodes": {"a": {"cards": [{"count": 1, "memory_bytes": 0}]}}}',
                b'{"nodes": {"a": {"gpus": 2}}}', b'{"nodes": {"": {}}}', b"[" * 5000, b'{"nodes": {"\xff": {}}}'):
        with pytest.raises(InvalidCommand):
            decode_inventory(bad)
    assert local_inventory("n", [(80 * GB, "H100"), (80 * GB, "H100"), (40 * GB, "A100")]).nodes["n"].cards == (
        CardGroup(count=2, memory_bytes=80 * GB, kind="H100"), CardGroup(count=1, memory_bytes=40 * GB, kind="A100"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 70), st.integers(-1, 2 * TB)), max_size=12),
       st.lists(st.tuples(st.integers(0, 4), st.integers(1, 100 * GB)), max_size=3), st.booleans())
def test_admitted_capacity_never_exceeds_the_declaration(report: list[tuple[int, int]], groups: list[tuple[int, int]],
                                                         is_declared: bool) -> None:
    gpus = tuple(E.GpuInfo(index=i, memory_bytes=m) for i, m in report)
    decl = NodeInventory(cards=tuple(CardGroup(count=c, memory_bytes=m) for c, m in groups)) if is_declared else None
    got = admit("n", gpus, 10 * GB, decl, True)
    declared_cards = dict(decl.card_list()) if decl is not None else {}
    assert len({g.index for g in got.gpus}) == len(got.gpus)
    for g in got.gpus:
        assert g.index in declared_cards and g.memory_bytes <= declared_cards[g.index].memory_bytes
    claimed_more = any(i not in declared_cards or m > declared_cards[i].memory_bytes for i, m in report)
    assert bool(got.problems) >= claimed_more  # every claim beyond the declaration is said
    msgspec.json.encode(got.gpus)
