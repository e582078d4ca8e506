"""Scale-down keeps the spread: the replicas a `scale-down` keeps cover as many nodes as they can, and
the most crowded node holds as few of them as any choice of replicas to keep allows (brute force
over every subset), through the real `decide` and its events.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.decide import decide
from schemas import events as E
from schemas.commands import ScaleDown
from tests.cluster_builder import Builder, ctx


def _build(per_node: list[int]) -> tuple[Builder, dict[int, str]]:
    """Replicas of model m on nodes n0.., `per_node[i]` on node i (ids in an interleaved order, so
    the highest ids are not all on one node)."""
    b = Builder()
    for i, count in enumerate(per_node):
        b.node(f"n{i}", gpus=max(1, count), gpu_gb=80)
    where: dict[int, str] = {}
    slots = [(k, i) for i, count in enumerate(per_node) for k in range(count)]
    for rid, (k, i) in enumerate(sorted(slots)):
        b.hot("m", rid, f"n{i}", (k,), 1.0)
        where[rid] = f"n{i}"
    return b, where


def test_the_crowded_node_gives_first() -> None:
    b, where = _build([1, 3])  # n0: one replica, n1: three
    evs = decide(b.state, ScaleDown(command_id="sd", model_key="m", replicas=2), ctx("sd"))
    gone = [e.replica_id for e in evs if isinstance(e, E.ReplicaEvictionRequested)]
    kept = set(where) - set(gone)
    assert sorted(where[r] for r in kept) == ["n0", "n1"]  # highest ids alone would have kept n1 twice


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 4), min_size=1, max_size=4).filter(lambda xs: sum(xs) >= 1), st.data())
def test_scale_down_keeps_the_best_spread(per_node: list[int], data: st.DataObject) -> None:
    b, where = _build(per_node)
    keep = data.draw(st.integers(0, sum(per_node)))
    evs = decide(b.state, ScaleDown(command_id="sd", model_key="m", replicas=keep), ctx("sd"))
    gone = {e.replica_id for e in evs if isinstance(e, E.ReplicaEvictionRequested)}
    kept = [r for r in where if r not in gone]
    assert len(kept) == keep
    nodes_before = len({n for n in where.values()})
    counts = Counter(where[r] for r in kept)
    assert len(counts) == min(keep, nodes_before)
    best = min((max(Counter(where[r] for r in subset).values(), default=0)
                for subset in itertools.combinations(sorted(where), keep)), default=0)
    assert max(counts.values(), default=0) == best
