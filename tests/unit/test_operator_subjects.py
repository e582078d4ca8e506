"""The subject filters docs/nats-cli.md tells an operator to type match what the store writes."""

from __future__ import annotations

import subprocess
import sys

from schemas import events as E
from schemas.events import event_subject
from schemas.keys import canonical_model_key
from schemas.status import EvictionReason, Level
from schemas.subjects import node_subject, operator_filters, request_subject, subject_matches
from tests.strategies import T0

GPT2 = canonical_model_key("openai-community/gpt2")


def matches(pattern: str, subject: str) -> bool:
    return subject_matches(subject, pattern)


def test_filters_select_exactly_the_events_of_their_model_replica_and_node():
    f = operator_filters(GPT2, node_id="gpu-a.cluster")
    other = canonical_model_key("openai-community/gpt2@v2")
    # an observed fact (stored one token deeper, on its node's token) and a decision
    loaded = E.ReplicaLoaded(event_id="e", ts=T0, actor="agent:gpu-a.cluster", model_key=GPT2, replica_id=3,
                             node_id="gpu-a.cluster")
    asked = E.ReplicaEvictionRequested(event_id="d", ts=T0, actor="controller:h", model_key=GPT2, replica_id=3,
                                       target=Level.WARM, reason=EvictionReason.ADMIN)
    reg = E.ModelRegistered(event_id="r", ts=T0, actor="cli", model_key=GPT2, checkpoint="c", size_bytes=1)
    assert matches(f["replica events"], event_subject(loaded)) and matches(f["replica events"], event_subject(asked))
    assert matches(f["model events"], event_subject(reg))
    assert not matches(f["replica events"], event_subject(E.ReplicaLoaded(
        event_id="e", ts=T0, actor="agent:gpu-a.cluster", model_key=other, replica_id=3, node_id="gpu-a.cluster")))
    assert matches("ndif.evt.replica.*.3.*", event_subject(loaded))  # facts of replica 3 of every model
    assert matches("ndif.evt.replica.*.3", event_subject(asked))  # decisions about replica 3 of every model
    assert f["node events"] == node_subject("gpu-a.cluster") and f["requests"] == request_subject(GPT2)
    one = operator_filters(GPT2, replica_id=3)
    assert matches(one["replica facts"], event_subject(loaded)) and matches(one["replica decisions"],
                                                                            event_subject(asked))
    assert not any(matches(p, event_subject(E.ReplicaLoaded(
        event_id="e", ts=T0, actor="agent:gpu-a.cluster", model_key=GPT2, replica_id=4, node_id="gpu-a.cluster")))
        for p in (one["replica facts"], one["replica decisions"]))

def test_the_module_prints_them():
    ran = subprocess.run([sys.executable, "-m", "controlplane.ops.subjects", "openai-community/gpt2", "--node", "n1"],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "ndif.evt.replica.openai-community_gpt2-" in ran.stdout
    assert "ndif.evt.node.n1-" in ran.stdout
