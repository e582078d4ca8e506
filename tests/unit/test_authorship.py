"""Observed facts name their author: only the agent of the node a fact is about may state it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.projections import ClusterState, fold
from schemas import events as E
from schemas.events import author_problem, event_subject, subject_problem
from schemas.status import Level
from schemas.status import ReplicaState as S
from schemas.subjects import node_token, replica_subject
from tests.strategies import MODELS, envelope, node_joined, numbered

M = MODELS[0]
A, B = "node-a.cluster", "node-b.cluster"
GB = 2**30


def sched() -> E.ReplicaScheduled:
    return E.ReplicaScheduled(**envelope("controller:c"), model_key=M, replica_id=0, node_id=A, gpu_indices=(0,),
                              bytes_per_gpu=10 * GB, source=Level.COLD)


def loaded(actor: str = f"agent:{A}") -> E.ReplicaLoaded:
    return E.ReplicaLoaded(**envelope(actor), model_key=M, replica_id=0, node_id=A)


def run(*events: E.Event) -> ClusterState:
    return fold(numbered([node_joined(A), node_joined(B), *events]), ClusterState())


def test_a_fact_from_its_own_agent_folds() -> None:
    s = run(sched(), loaded())
    assert s.replicas[(M, 0)].state is S.AVAILABLE and s.anomaly_count == 0


@pytest.mark.parametrize("actor", [f"agent:{B}", "cli:mallory", "controller:c", "dispatcher:d"])
def test_a_fact_from_anyone_else_is_refused_and_flagged(actor: str) -> None:
    s = run(sched(), loaded(), E.ReplicaFailed(**envelope(actor), model_key=M, replica_id=0, node_id=A, error="forged"))
    assert s.replicas[(M, 0)].state is S.AVAILABLE  # the healthy replica is untouched
    assert s.anomaly_count == 1 and "only that node's agent" in s.anomalies[-1].message


def test_a_ghost_node_joined_by_another_agent_is_refused() -> None:
    ghost = E.NodeJoined(**envelope(f"agent:{A}"), node_id="ghost", gpus=(E.GpuInfo(index=0, memory_bytes=GB),),
                         cpu_cache_bytes=0)
    s = run(ghost)
    assert "ghost" not in s.nodes and s.anomaly_count == 1


def test_the_dispatcher_may_report_a_drain_but_nothing_else() -> None:
    drained = E.ReplicaDrained(**envelope("dispatcher:d"), model_key=M, replica_id=0, node_id=A)
    assert author_problem(drained) is None
    assert author_problem(E.ReplicaUnloaded(**envelope("dispatcher:d"), model_key=M, replica_id=0, node_id=A))


def test_facts_without_an_authors_kind_still_fold() -> None:
    """Events written before authors were checked (and test fixtures) say `agent`, not `agent:<node>`."""
    s = run(sched(), loaded(actor="agent"))
    assert s.replicas[(M, 0)].state is S.AVAILABLE and s.anomaly_count == 0


def test_observed_facts_are_stored_on_their_sources_subject() -> None:
    base = replica_subject(M, 0)
    assert event_subject(loaded()) == f"{base}.{node_token(A)}"
    assert event_subject(E.ReplicaDrained(**envelope("dispatcher:d"), model_key=M, replica_id=0, node_id=A)) == \
        f"{base}.dispatcher"
    assert event_subject(sched()) == base  # decisions keep their subject
    assert event_subject(loaded(actor="agent")) == base  # unattributed: the old subject


@given(st.sampled_from([A, B, "x.y", "gpu-7"]), st.sampled_from([A, B, "x.y", "gpu-7"]))
def test_a_fact_on_another_nodes_subject_is_caught(subject_node: str, body_node: str) -> None:
    """The server vouches for the subject (per-node permissions); a body about another node is refused."""
    ev = E.ReplicaLoaded(**envelope(f"agent:{body_node}"), model_key=M, replica_id=0, node_id=body_node)
    subject = f"{replica_subject(M, 0)}.{node_token(subject_node)}"
    assert (subject_problem(subject, ev) is None) == (subject_node == body_node)
    assert subject_problem(replica_subject(M, 0), ev) is None  # stored before subjects named their source


def test_requests_and_statuses_carry_their_owner() -> None:
    from schemas.subjects import model_token, request_subject, request_subject_parts, status_key, status_subject

    tok = model_token(M)
    assert request_subject(M, "alice") == f"ndif.req.{tok}.alice"
    assert request_subject_parts(request_subject(M, "alice")) == (tok, "alice")
    assert request_subject_parts(request_subject(M)) == (tok, "")  # an open server's form
    assert status_key("r1", "alice") == "alice.r1" and status_key("r1") == "r1"
    # KV's republish ($KV.<bucket>.<key> -> ndif.status.<key>) lands where the owner listens.
    assert status_subject("r1", "alice") == "ndif.status.alice.r1" and status_subject("r1") == "ndif.status.r1"
