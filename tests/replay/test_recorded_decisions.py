"""Replay in Temporal's manner: every recorded decision, taken again over its recorded prefix, writes
byte-identical events (or is refused the same way).

`<name>.decisions.json` (written by tests/replay/record.py with `<name>.jsonl` and
`<name>.expected.json`) holds what each decision of the history was given. A change to the decider,
placement, the fold or the codec that would decide any recorded case differently fails here, naming
the decision; a deliberate change of behaviour re-records (`python -m tests.replay.record`) and adds
new files rather than editing v1 ones.
"""

from __future__ import annotations

import asyncio

import pytest

from controlplane.core.projections import ClusterState
from schemas import errors
from schemas.events import AGENT_FACTS, ReplicaDrained, decode_or_skip, encode_event
from tests.replay.record import HERE, SCENARIOS, Decision, decisions_decoder, record, run

# Every history recorded with its decisions: the scripted scenarios (record.py) and the live run of
# the real Controller over nats-server (record_live.py).
RECORDED = sorted(p.name.removesuffix(".decisions.json") for p in HERE.glob("*.decisions.json"))


def _load(name: str) -> tuple[list[bytes], list[Decision]]:
    lines = [line for line in (HERE / f"{name}.jsonl").read_bytes().splitlines() if line.strip()]
    return lines, decisions_decoder.decode((HERE / f"{name}.decisions.json").read_bytes())


def test_recorded_histories_are_long_and_cover_every_policy() -> None:
    assert set(SCENARIOS) | {"v1_live_lifecycle"} <= set(RECORDED)
    for name in RECORDED:
        lines, decisions = _load(name)
        assert len(lines) >= 250 and len(decisions) >= 50, name
    policies = {d.policy for name in RECORDED for d in _load(name)[1]}
    assert policies == {"command", "failure", "node_lost", "unplaced"}
    assert any(d.refused for name in RECORDED for d in _load(name)[1])


@pytest.mark.parametrize("name", RECORDED)
def test_every_recorded_decision_redecides_byte_identical(name: str) -> None:
    lines, decisions = _load(name)
    state = ClusterState()
    checked = 0
    for i, d in enumerate(decisions):
        assert d.at_seq >= state.seq, f"decision {i} ({d.ctx.command_id}) is out of order"
        for seq in range(state.seq + 1, d.at_seq + 1):
            state.apply(seq, decode_or_skip(lines[seq - 1]))
        where = f"decision {i} ({d.policy} {d.ctx.command_id}) over seq 1..{d.at_seq}"
        if d.refused is not None:
            with pytest.raises(getattr(errors, d.refused)):
                run(d, state.copy())
            continue
        before = state.copy()
        got = [encode_event(e) for e in run(d, state)]
        assert state == before, f"{where}: deciding changed the state it was given"
        want = lines[d.at_seq:d.at_seq + d.events]
        assert len(got) == len(want), f"{where}: {len(got)} events, recorded {len(want)}"
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{where}: event {k} (seq {d.at_seq + k + 1}) differs\n got {g!r}\nwant {w!r}"
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("name", RECORDED)
def test_every_event_is_a_recorded_decision_or_an_observed_fact(name: str) -> None:
    """No event of the history escapes the replay: what no decision wrote is a node's or the
    dispatcher's observed fact."""
    lines, decisions = _load(name)
    decided: set[int] = set()
    for d in decisions:
        span = set(range(d.at_seq + 1, d.at_seq + d.events + 1))
        assert not span & decided, f"{d.ctx.command_id}: overlaps another decision"
        decided |= span
    for seq, line in enumerate(lines, 1):
        if seq not in decided:
            ev = decode_or_skip(line)
            assert type(ev) in AGENT_FACTS or type(ev) is ReplicaDrained, f"seq {seq}: {line[:120]!r}"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_recording_is_deterministic(name: str) -> None:
    """Two recordings of a scenario write the same bytes: nothing on the path reads a clock, an id
    source or an unordered container (what would make a recorded history irreproducible)."""
    (a, da, _), (b, db, _) = (asyncio.run(record(name)) for _ in range(2))
    assert a == b and da == db
