"""Golden histories, folded in CI forever. v1 histories never change; a new event schema adds new files.

`<name>.jsonl`: one stored event body a line (seq = line number), as `nats stream view` shows it.
`<name>.expected.json`: the cluster view that history must fold to, in the fold's snapshot form
(`ClusterSnapshot`; schema 2 keeps the event-id window in fold order, and the id and time of the last event).
`*bad*`: known-bad histories that `replay --strict` must refuse.
"""

from __future__ import annotations

import pathlib

import msgspec
import pytest

from controlplane.core.projections import ClusterSnapshot, replay
from schemas.errors import ReplayAnomalyError
from schemas.events import decode_or_skip
from schemas.status import Level, ModelStatus, ReplicaState

HERE = pathlib.Path(__file__).parent / "histories"
GOOD = sorted(p for p in HERE.glob("*.jsonl") if "bad" not in p.name)
BAD = sorted(p for p in HERE.glob("*.jsonl") if "bad" in p.name)


def stored(path: pathlib.Path):
    return [(i, decode_or_skip(line)) for i, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_golden_history_folds_to_its_recorded_state(path):
    state = replay(stored(path), strict=True)
    expected = msgspec.json.decode((path.with_suffix(".expected.json")).read_bytes(), type=ClusterSnapshot)
    assert state.to_snapshot() == expected


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_known_bad_history_fails_strict(path):
    with pytest.raises(ReplayAnomalyError) as exc:
        replay(stored(path), strict=True)
    assert "anomalies" in str(exc.value) and len(exc.value.anomalies) >= 4
    replay(stored(path))  # without --strict it folds, recording the anomalies


def test_v1_lifecycle_says_what_happened():
    """The recorded state, read as an operator would (guards the expected file against a careless regen)."""
    path = HERE / "v1_lifecycle.jsonl"
    s = replay(stored(path), strict=True)
    gpt2 = 'nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}'
    llama = 'nnsight.modeling.language.LanguageModel:{"repo_id": "/models/tiny-llama", "revision": null}'
    r0, r1, r2 = (s.replicas[(gpt2, i)] for i in range(3))
    assert (r0.state, r0.restarts, r0.level) == (ReplicaState.AVAILABLE, 1, Level.HOT)
    assert r1.state is ReplicaState.UNLOADED and r2.state is ReplicaState.UNLOADED  # down before node b was lost
    assert r1.desired is Level.COLD and r2.error == "OSError: config.json is corrupt"
    assert s.replicas[(llama, 0)].gpu_indices == (0, 1) and s.replicas[(llama, 0)].dedicated
    assert s.models[gpt2].next_replica_id == 3 and s.replica_count(gpt2) == 1
    assert s.model_status(gpt2) is ModelStatus.AVAILABLE
    assert not s.nodes["gpu-b.ndif.internal"].alive
    a0 = {c.index: c for c in s.node_cards("gpu-a.ndif.internal")}
    assert a0[0].reserved_bytes == int(0.575 * 2**30) + int(57.5 * 2**30)
    assert s.commands["cmd-scale-down-gpt2"].events == 3


def test_model_keys_as_fields_fold_like_model_keys_as_strings():
    """v1_lifecycle_keyfields is v1_lifecycle written by the codec that stores model keys as fields
    (`{"repo_id": ...}`); a log holding both forms (written before and after that codec) folds the same."""
    old, new = HERE / "v1_lifecycle.jsonl", HERE / "v1_lifecycle_keyfields.jsonl"
    new_lines = [line for line in new.read_bytes().splitlines() if line.strip()]
    assert all(b'"model_key":{"repo_id":' in line or b'"model_key":null' in line for line in new_lines)
    assert not any(b'"model_key":"' in line for line in new_lines)
    old_state, new_state = replay(stored(old), strict=True), replay(stored(new), strict=True)
    assert new_state.to_snapshot() == old_state.to_snapshot()
    mixed = [(i, a if i % 2 else b) for (i, a), (_, b) in zip(stored(old), stored(new), strict=True)]
    assert replay(mixed, strict=True).to_snapshot() == old_state.to_snapshot()
    assert [ev for _, ev in stored(old)] == [ev for _, ev in stored(new)]


def test_v1_commands_undeploy_says_what_happened():
    """Made through decide() and a scripted agent: deploy 2, a no-op scale (recorded alone), evict one to
    WARM, undeploy (both forgotten), deploy again (ids start over). Guards CommandDecided/ModelUndeployed."""
    s = replay(stored(HERE / "v1_commands_undeploy.jsonl"), strict=True)
    gpt2 = 'nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}'
    noop = s.commands["cmd-noop"]
    assert (noop.events, noop.verb) == (1, "scale") and noop.fingerprint
    assert s.commands["cmd-undeploy"].events == 4  # decided, two evictions, ModelUndeployed
    assert sorted(rid for _, rid in s.replicas) == [0] and s.replicas[(gpt2, 0)].state is ReplicaState.AVAILABLE
    assert s.models[gpt2].next_replica_id == 1 and not s.undeployed
    assert s.cpu_cached("gpu-a.ndif.internal") == 0
