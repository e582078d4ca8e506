"""Group commit over every EventLog: one batch per turn, all or nothing, conflicts decided again."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.committer import GroupCommitter, afold
from controlplane.context import DecisionContext
from controlplane.projections import ClusterState
from schemas import events as E
from schemas.errors import InvalidCommand
from schemas.status import DeploymentOp
from tests.contract.test_eventlog_contract import log  # noqa: F401 - the parametrised fixture
from tests.strategies import T0, _env


def bump(model: str, cmd: str, extra: int = 0):
    """A decision that depends on the state: target_hot = current + 1 (so lost updates show)."""

    def decide(state: ClusterState):
        m = state.models.get(model)
        cur = m.target_hot if m else 0
        ctx = DecisionContext(now=T0, actor="test", command_id=cmd)
        return [ctx.event(E.DeploymentRequested, model_key=model, op=DeploymentOp.SCALE, replicas=cur + 1,
                          target_hot=cur + 1) for _ in range(1 + extra)]

    return decide


async def test_concurrent_decisions_group_into_batches_and_lose_no_update(log):  # noqa: F811
    async with GroupCommitter(log, ClusterState()) as gc:
        results = await asyncio.gather(*(gc.submit(bump("m", f"c{i}", extra=i % 3)) for i in range(40)))
        assert gc.turns < 40  # grouped
    fresh = await afold(log.read(), ClusterState())
    assert fresh.models["m"].target_hot == 40  # each decision saw the ones before it
    assert fresh == gc.state
    spans = sorted((r.first_seq, r.last_seq) for r in results)
    assert spans[0][0] == 1 and all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:], strict=False))


async def test_conflict_with_another_writer_is_decided_again(log):  # noqa: F811
    async with GroupCommitter(log, ClusterState()) as gc:
        await gc.submit(bump("m", "a"))
        # Another writer appends behind the committer's back.
        await log.append([E.DeploymentRequested(**_env(), model_key="m", op=DeploymentOp.SCALE, replicas=5,
                                                target_hot=5)], 1)
        r = await gc.submit(bump("m", "b"))
        assert r.attempts == 2 and gc.conflicts == 1
        assert gc.state.models["m"].target_hot == 6
    assert (await afold(log.read(), ClusterState())).models["m"].target_hot == 6


async def test_a_refused_decision_appends_nothing_and_spares_the_others(log):  # noqa: F811
    def refuse(state):
        raise InvalidCommand("no such thing")

    async with GroupCommitter(log, ClusterState()) as gc:
        ok, bad = await asyncio.gather(gc.submit(bump("m", "a")), gc.submit(refuse), return_exceptions=True)
        assert isinstance(bad, InvalidCommand) and ok.last_seq == 1
        empty = await gc.submit(lambda s: [])
        assert (empty.first_seq, empty.last_seq) == (0, 0)
    assert await log.last_seq() == 1


async def test_batches_respect_the_limit(log):  # noqa: F811
    async with GroupCommitter(log, ClusterState(), max_events=10) as gc:
        await asyncio.gather(*(gc.submit(bump("m", f"c{i}", extra=3)) for i in range(10)))
    assert await log.last_seq() == 40
    assert gc.turns >= 4


@pytest.mark.parametrize("n", [1])
async def test_observe_keeps_the_state_current(log, n):  # noqa: F811
    gc = GroupCommitter(log, ClusterState())
    await log.append([E.DeploymentRequested(**_env(), model_key="x", op=DeploymentOp.DEPLOY, replicas=n,
                                            target_hot=n)], 0)
    async for seq, item in log.read():
        gc.observe(seq, item)
    assert gc.state.models["x"].target_hot == n and gc.state.seq == 1
