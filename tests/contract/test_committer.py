"""Group commit over every EventLog: one batch per turn, all or nothing, conflicts decided again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from controlplane.core.context import DecisionContext
from controlplane.core.projections import ClusterState
from controlplane.core.projections.base import afold
from controlplane.service.committer import GroupCommitter
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.errors import InfrastructureTimeout, InvalidCommand
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


class _Interrupted:
    """A memory log with JetStream's failure modes the committer meets in a cluster: reads that fail
    (a server lost while the tail is folded), and a follower that runs while the committer awaits."""

    def __init__(self) -> None:
        self.inner = MemoryEventLog()
        self.failing_reads = 0
        self.during_append: Callable[[], Awaitable[None]] | None = None
        self.during_read: Callable[[], Awaitable[None]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, events: Any, expected_last_seq: int | None) -> Any:
        res = await self.inner.append(events, expected_last_seq)
        if self.during_append is not None:
            hook, self.during_append = self.during_append, None
            await hook()
        return res

    async def read_batches(self, start_seq: int = 1, **kw: Any) -> AsyncIterator[list[Any]]:
        if self.failing_reads > 0:
            self.failing_reads -= 1
            raise InfrastructureTimeout("subscribing to NDIF_EVENTS failed: TimeoutError; retrying")
        if self.during_read is not None:
            hook, self.during_read = self.during_read, None
            await hook()
        async for batch in self.inner.read_batches(start_seq, **kw):
            yield batch


def _other_writer() -> E.DeploymentRequested:
    return E.DeploymentRequested(**_env(), model_key="m", op=DeploymentOp.SCALE, replicas=5, target_hot=5)


async def test_a_failed_catch_up_after_a_conflict_keeps_the_committer_serving() -> None:
    # A conflict, then the tail cannot be read (a cluster electing a leader): the decision is taken
    # again on the next turn. Were the exception to end the loop, the submit (and every later one)
    # would wait forever.
    lg = _Interrupted()
    async with GroupCommitter(lg, ClusterState()) as gc:
        await gc.submit(bump("m", "a"))
        await lg.inner.append([_other_writer()], 1)
        lg.failing_reads = 1
        r = await asyncio.wait_for(gc.submit(bump("m", "b")), 10)
        assert r.attempts == 3 and gc.conflicts == 2
        assert gc.state.models["m"].target_hot == 6
        assert (await asyncio.wait_for(gc.submit(bump("m", "c")), 10)).last_seq == 4  # still serving
    assert gc.state == await afold(lg.inner.read(), ClusterState())


async def test_a_grouped_turn_keeps_the_followers_fold_whole() -> None:
    # Two decisions in one turn (a working copy), while the follower applies our events and another
    # writer's to the state, and goes on applying during any read the committer makes: the state
    # after the turn equals a fresh fold, with no sequence skipped.
    lg = _Interrupted()
    gc = GroupCommitter(lg, ClusterState())
    await gc.start()
    try:
        fed = [0]

        async def follower() -> None:  # what the follow loop does: observe() in log order
            async for seq, item in lg.inner.read(fed[0] + 1):
                gc.observe(seq, item)
                fed[0] = seq

        async def follower_with_more() -> None:
            await follower()
            await lg.inner.append([_other_writer()], None)
            await follower()
            lg.during_read = more

        async def more() -> None:
            await lg.inner.append([_other_writer()], None)
            await follower()

        lg.during_append = follower_with_more
        await asyncio.gather(gc.submit(bump("m", "a")), gc.submit(bump("m", "b")))
        assert gc.turns == 1
        fresh = await afold(lg.inner.read(), ClusterState())
        assert gc.state.seq == fresh.seq and gc.state == fresh
    finally:
        await gc.stop()
