"""Heterogeneous nodes: a model's requirements (`ndif deploy --require`) against what the operator's
inventory declares of each node (card kind and memory, labels). Placement considers only the nodes
that meet them, on every path (deploy, scale, replacement after a node is lost); a deploy no live
node can meet is refused before anything is appended, naming what the closest node lacks.
"""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.decide import decide, decide_node_lost
from controlplane.core.placement import PlacementRequest, plan
from controlplane.core.requirements import meets, requirements_refusal, unmet
from schemas import events as E
from schemas.commands import Deploy, Scale, ScaleDown, decode_command, fingerprint
from schemas.errors import InvalidCommand
from schemas.inventory import Requirements, parse_requirements
from tests.cluster_builder import GB, Builder, ctx

GiB = 2**30
KINDS = ("A100", "H100", "L4")
POOLS = ("research", "general")


def test_parse_requirements() -> None:
    got = parse_requirements(["gpu=H100", "gpu-memory-gib=40", "pool=research", "zone=a"])
    assert got == Requirements(gpu="H100", min_card_bytes=40 * GiB, labels={"pool": "research", "zone": "a"})
    assert got.terms() == ["gpu=H100", "gpu-memory-gib=40", "pool=research", "zone=a"]
    assert parse_requirements([]) is None
    for bad in (["gpu"], ["=x"], ["pool="], ["gpu-memory-gib=lots"], ["gpu-memory-gib=0"], ["gpu-memory-gib=9999"],
                ["k=\u00e9"], [f"l{i}=v" for i in range(17)]):
        with pytest.raises(InvalidCommand):
            parse_requirements(bad)


def test_a_deploy_without_requirements_keeps_its_fingerprint() -> None:
    """`requires` is a later field: a command without it fingerprints as it always did."""
    cmd = Deploy(command_id="c", model_key="m", replicas=2)
    before = {k: v for k, v in msgspec.to_builtins(msgspec.structs.replace(cmd, command_id="", actor="")).items()
              if k not in ("requires", "for_request", "for_user")}  # what a deploy was made of before the fields
    assert fingerprint(cmd) == hashlib.blake2b(msgspec.json.encode(before), digest_size=12).hexdigest()
    sent = Deploy(command_id="c", model_key="m", replicas=1, requires=Requirements(gpu="H100", labels={"p": "r"}))
    got = decode_command(msgspec.json.encode(sent), verb="deploy")
    assert isinstance(got, Deploy) and got.requires == Requirements(gpu="H100", labels={"p": "r"})
    assert fingerprint(got) != fingerprint(Deploy(command_id="c", model_key="m", replicas=1))


def _cluster() -> Builder:
    return (Builder()
            .declared("a", 2, 40, kind="A100", labels={"pool": "research"})
            .declared("b", 2, 80, kind="H100", labels={"pool": "general"})
            .declared("c", 1, 80, kind="H100", labels={"pool": "research"}))


def test_only_nodes_meeting_the_requirements_hold_replicas() -> None:
    b = _cluster()
    req = Requirements(gpu="H100", labels={"pool": "research"})
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=10 * GB, replicas=3, requires=req)], now_s=0)
    assert {pl.node_id for pl in p.placed} == {"c"}
    req = Requirements(min_card_bytes=50 * GiB)
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=10 * GB, replicas=2, requires=req)], now_s=0)
    assert sorted(pl.node_id for pl in p.placed) == ["b", "c"]  # spread, a's 40 GB cards left out


def test_a_refusal_names_what_the_closest_node_lacks() -> None:
    s = _cluster().state
    why = requirements_refusal(s, Requirements(gpu="H100", labels={"pool": "gpu-lab"}))
    assert why is not None and "pool=gpu-lab needed" in why and "has pool=" in why
    why = requirements_refusal(s, Requirements(gpu="L4", labels={"pool": "research"}))
    assert why is not None and "closest, c" in why and "gpu=L4 needed, has cards of kind H100" in why  # larger cards: closer
    why = requirements_refusal(s, Requirements(min_card_bytes=100 * GiB))
    assert why is not None and "per card needed" in why
    assert requirements_refusal(s, Requirements(gpu="A100")) is None


def test_deploy_refused_appends_nothing_and_scale_keeps_the_requirements() -> None:
    b = _cluster().model("m", 10)
    cmd = Deploy(command_id="d1", model_key="m", replicas=1, requires=Requirements(gpu="TPU"))
    with pytest.raises(InvalidCommand, match="gpu=TPU needed"):
        decide(b.state, cmd, ctx("d1"))
    evs = decide(b.state, Deploy(command_id="d2", model_key="m", replicas=1,
                                 requires=Requirements(labels={"pool": "research"})), ctx("d2"))
    (dr,) = [e for e in evs if isinstance(e, E.DeploymentRequested)]
    assert dr.requires == Requirements(labels={"pool": "research"})
    for e in evs:
        b.add(e)
    assert b.state.models["m"].requires == dr.requires
    evs = decide(b.state, Scale(command_id="s1", model_key="m", replicas=3), ctx("s1", seed=1))
    nodes = {e.node_id for e in evs if isinstance(e, E.ReplicaScheduled)}
    assert nodes and nodes <= {"a", "c"}


def test_a_lost_nodes_replicas_go_only_to_nodes_meeting_the_requirements() -> None:
    b = (Builder()
         .declared("a", 1, 80, kind="H100", labels={"pool": "research"})
         .declared("b", 1, 80, kind="H100", labels={"pool": "research"})
         .declared("c", 4, 80, kind="H100", labels={"pool": "general"}).model("m", 10))
    for e in decide(b.state, Deploy(command_id="d", model_key="m", replicas=1,
                                    requires=Requirements(labels={"pool": "research"})), ctx("d")):
        b.add(e)
    (r,) = b.state.model_replicas("m")
    evs = decide_node_lost(b.state, r.node_id, ctx("lost"), "heartbeat expired")
    (placed,) = [e for e in evs if isinstance(e, E.ReplicaScheduled)]
    assert placed.node_id in {"a", "b"} - {r.node_id}


node_specs = st.tuples(st.integers(1, 4), st.sampled_from([24, 40, 80]), st.sampled_from(KINDS),
                       st.sampled_from(POOLS))
reqs = st.builds(Requirements, gpu=st.sampled_from(("", *KINDS)),
                 min_card_bytes=st.sampled_from([0, 30 * GiB, 60 * GiB]),
                 labels=st.sampled_from([{}, {"pool": "research"}, {"pool": "general"}]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node_specs, min_size=1, max_size=6), reqs, st.integers(1, 6), st.integers(0, 10))
def test_placement_never_uses_a_node_that_does_not_meet_them(specs, req, n, seed) -> None:
    b = Builder()
    for i, (cards, gb, kind, pool) in enumerate(specs):
        b.declared(f"n{i}", cards, gb, kind=kind, labels={"pool": pool})
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=5 * GB, replicas=n, requires=req)],
             now_s=0, seed=seed)
    for pl in p.placed:
        assert meets(b.state.nodes[pl.node_id], req)
    ok = [node for node in b.state.nodes.values() if meets(node, req)]
    # Something is placed exactly when some node meets them (5 GB fits any card here), and spread holds:
    # no node gets a second replica while a meeting node holds none.
    assert bool(p.placed) == bool(ok)
    per = {node.node_id: sum(1 for pl in p.placed if pl.node_id == node.node_id) for node in ok}
    if per and max(per.values()) > 1:
        assert min(per.values()) >= 1
    why = requirements_refusal(b.state, req)
    assert (why is None) == bool(ok)
    if why is not None:
        assert all(unmet(node, req) for node in b.state.nodes.values())


def test_a_deploy_from_zero_keeps_the_requirements_and_card_count_the_model_was_deployed_with() -> None:
    """The dispatcher's deploy of a model at zero (its first request) names no requirements: the
    model's own still hold (on every later decision, as `--require` promises)."""
    b = (Builder()
         .declared("a", 2, 80, kind="H100", labels={"pool": "research"})
         .declared("b", 4, 80, kind="H100", labels={"pool": "general"})
         .declared("c", 4, 80, kind="H100", labels={"pool": "general"}).model("m", 10))
    for e in decide(b.state, Deploy(command_id="d", model_key="m", replicas=1, gpus=2,
                                    requires=Requirements(labels={"pool": "research"})), ctx("d")):
        b.add(e)
    for e in decide(b.state, ScaleDown(command_id="s", model_key="m", replicas=0), ctx("s")):
        b.add(e)
    assert b.state.replica_count("m") == 0 and b.state.models["m"].requires is not None
    for seed in range(6):
        evs = decide(b.state, Deploy(command_id=f"p{seed}", model_key="m", replicas=1, for_request=True,
                                     actor="dispatcher:x"), ctx(f"p{seed}", seed=seed))
        placed = [e for e in evs if isinstance(e, E.ReplicaScheduled)]
        assert [(e.node_id, len(e.gpu_indices)) for e in placed] == [("a", 2)], placed
