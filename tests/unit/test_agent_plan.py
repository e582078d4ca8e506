"""The node agent's pure decision (controlplane/core/nodeplan.py): unit cases and Hypothesis properties over
random folds, without Ray, NATS or a clock; then the real `NodeAgent` over the in-memory log and the
in-memory runtime (tests/fake_runtime.py): it loads what is scheduled and adopts after a restart."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from controlplane.core.nodeplan import LIVE, Do, current_marks, plan_actions, plan_adoption
from controlplane.core.projections import ClusterState, fold
from controlplane.store.heartbeats import MemoryHeartbeats
from controlplane.store.memlog import MemoryEventLog
from dataplane.node.agent import NodeAgent
from dataplane.runtime.ports import ReplicaSpec
from schemas import events as E
from schemas.errors import InfrastructureError
from schemas.status import DrainReason, EvictionReason, Level, ReplicaState
from tests.fake_runtime import FakeRuntime
from tests.strategies import MODELS, NODES, _env, histories, node_joined, numbered
from tests.waiting import until

S = ReplicaState
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NODE = NODES[0]
M = MODELS[0]


def state_of(events: list[E.Event]) -> ClusterState:
    return fold(numbered(events), ClusterState())


def rep(rid: int, node: str = NODE) -> dict[str, Any]:
    return {"model_key": M, "replica_id": rid, "node_id": node}


def start(*, gpus: tuple[int, ...] = (0,)) -> list[E.Event]:
    return [node_joined(NODE), E.ModelRegistered(**_env("controller"), model_key=M, checkpoint="/ckpt", size_bytes=2**30)]


def scheduled(rid: int, gpus: tuple[int, ...], source: Level = Level.COLD) -> E.ReplicaScheduled:
    return E.ReplicaScheduled(**_env("controller"), **rep(rid), gpu_indices=gpus, bytes_per_gpu=2**30, source=source)


def hot(rid: int, gpus: tuple[int, ...]) -> list[E.Event]:
    return [scheduled(rid, gpus), E.ReplicaLoading(**_env("agent"), **rep(rid)),
            E.ReplicaLoaded(**_env("agent"), **rep(rid), load_seconds=1.0)]


def evict(rid: int, target: Level = Level.WARM, drain: bool = False) -> E.ReplicaEvictionRequested:
    return E.ReplicaEvictionRequested(**_env("controller"), **rep(rid), reason=EvictionReason.ADMIN, target=target,
                                      drain=drain)


def kinds(actions: list[Any]) -> list[tuple[int, Do]]:
    return [(a.replica.replica_id, a.do) for a in actions]


# ---- unit cases ------------------------------------------------------------------------------


def served(rid: int, by: str) -> E.ReplicaServed:
    return E.ReplicaServed(**_env(by), **rep(rid))


def test_each_state_asks_its_action() -> None:
    events = start() + [scheduled(0, (0,))] + hot(1, (1,)) + [served(1, "dispatcher:a"), evict(1, drain=True)]
    st_ = state_of(events)
    assert st_.replicas[(M, 1)].state is S.DRAINING
    assert kinds(plan_actions(st_, NODE, set(), set())) == [(0, Do.LOAD), (1, Do.DRAIN_TIMER)]
    st_ = state_of(events + [E.ReplicaDrained(**_env("dispatcher:a"), **rep(1))])
    assert kinds(plan_actions(st_, NODE, {(M, 1)}, set())) == [(0, Do.LOAD), (1, Do.UNLOAD)]
    assert plan_actions(st_, NODES[1], set(), set()) == []  # another node's replicas are not ours


def test_a_drain_no_dispatcher_serves_is_over_at_once_and_one_served_waits_for_every_server() -> None:
    base = start() + hot(0, (0,))
    # Never served: nothing can be in flight, the agent reports the drain now.
    st_ = state_of(base + [evict(0, drain=True)])
    assert st_.replicas[(M, 0)].state is S.DRAINING
    assert kinds(plan_actions(st_, NODE, {(M, 0)}, set())) == [(0, Do.DRAINED)]
    # Served by two dispatchers: one saying idle is not enough; both are.
    two = base + [served(0, "dispatcher:a"), served(0, "dispatcher:b"), evict(0, drain=True)]
    a_idle = E.ReplicaDrained(**_env("dispatcher:a"), **rep(0))
    st_ = state_of(two + [a_idle])
    assert st_.replicas[(M, 0)].state is S.DRAINING and st_.replicas[(M, 0)].drained_by == ("dispatcher:a",)
    assert kinds(plan_actions(st_, NODE, {(M, 0)}, set())) == [(0, Do.DRAIN_TIMER)]
    # The agent's "unserved" landing while b still serves it changes nothing; b's report ends it.
    unserved = E.ReplicaDrained(**_env(f"agent:{NODE}"), **rep(0), reason=DrainReason.UNSERVED)
    assert state_of(two + [a_idle, unserved]).replicas[(M, 0)].state is S.DRAINING
    b_idle = E.ReplicaDrained(**_env("dispatcher:b"), **rep(0))
    assert state_of(two + [a_idle, b_idle]).replicas[(M, 0)].state is S.UNLOAD_REQUESTED
    # A timeout lets it go whoever has not answered.
    timeout = E.ReplicaDrained(**_env(f"agent:{NODE}"), **rep(0), reason=DrainReason.TIMEOUT)
    assert state_of(two + [a_idle, timeout]).replicas[(M, 0)].state is S.UNLOAD_REQUESTED
    # A claim on a replica already draining is not a caller (its dispatcher sees it draining there).
    late = base + [evict(0, drain=True), served(0, "dispatcher:a")]
    assert state_of(late).replicas[(M, 0)].served_by == ()
    # Scheduled anew: the old callers are forgotten.
    again = two + [unserved, b_idle, a_idle, E.ReplicaUnloaded(**_env(f"agent:{NODE}"), **rep(0)), scheduled(0, (0,))]
    assert state_of(again).replicas[(M, 0)].served_by == ()


def test_only_a_dispatcher_may_say_it_serves_a_replica() -> None:
    forged = E.ReplicaServed(**_env(f"agent:{NODE}"), **rep(0))
    st_ = state_of(start() + hot(0, (0,)) + [forged])
    assert st_.replicas[(M, 0)].served_by == () and st_.anomalies


def test_a_load_waits_for_the_leaving_replica_on_its_card() -> None:
    events = start() + hot(0, (0,)) + [evict(0, Level.WARM), scheduled(1, (0,)), scheduled(2, (1,))]
    st_ = state_of(events)
    assert st_.replicas[(M, 0)].state is S.UNLOAD_REQUESTED
    # Replica 1 shares card 0 with the leaving replica 0: not yet; replica 2 on card 1 goes.
    assert kinds(plan_actions(st_, NODE, {(M, 0)}, set())) == [(0, Do.UNLOAD), (2, Do.LOAD)]
    assert kinds(plan_actions(st_, NODE, {(M, 0)}, {(M, 0)})) == [(2, Do.LOAD)]  # in flight: still waits
    st_ = state_of(events + [E.ReplicaCached(**_env("agent"), **rep(0), cpu_bytes=2**30)])
    assert kinds(plan_actions(st_, NODE, {(M, 0)}, set())) == [(1, Do.LOAD), (2, Do.LOAD)]


def test_a_load_is_taken_once_per_scheduling() -> None:
    events = start() + [scheduled(0, (0,))]
    first = plan_actions(state_of(events), NODE, set(), set())
    assert kinds(first) == [(0, Do.LOAD)]
    done = {a.mark for a in first}
    # Its own ReplicaLoading does not ask for a second load...
    assert plan_actions(state_of(events + [E.ReplicaLoading(**_env("agent"), **rep(0))]), NODE, set(), set(), done) == []
    # ...a new scheduling (after a failed load) does.
    again = events + [E.ReplicaLoadFailed(**_env("agent"), **rep(0), error="x"), scheduled(0, (0,))]
    assert kinds(plan_actions(state_of(again), NODE, set(), set(), done)) == [(0, Do.LOAD)]


def test_warm_without_a_process_is_checked_and_leftovers_are_reaped() -> None:
    events = start() + hot(0, (0,)) + [evict(0, Level.WARM), E.ReplicaCached(**_env("agent"), **rep(0), cpu_bytes=1)]
    events += hot(1, (1,)) + [evict(1, Level.COLD), E.ReplicaUnloaded(**_env("agent"), **rep(1))]
    st_ = state_of(events)
    assert kinds(plan_actions(st_, NODE, set(), set())) == [(0, Do.CHECK_WARM)]
    assert kinds(plan_actions(st_, NODE, {(M, 0), (M, 1)}, set())) == [(1, Do.REAP)]


def test_adoption_keeps_what_the_log_wants_here_and_kills_the_rest() -> None:
    events = start() + hot(0, (0,)) + hot(1, (1,)) + [evict(1, Level.COLD), E.ReplicaUnloaded(**_env("agent"), **rep(1))]
    keep, kill = plan_adoption(state_of(events), NODE, [(M, 0), (M, 1), (M, 7)])
    assert keep == [(M, 0)] and kill == [(M, 1), (M, 7)]


# ---- properties over random folds -------------------------------------------------------------


@st.composite
def situations(draw: st.DrawFn) -> tuple[ClusterState, str, set[tuple[str, int]], set[tuple[str, int]]]:
    """A fold of a random history prefix (so replicas are caught mid-transition), a node, and which
    replicas have a live process there and which are being acted on."""
    events = draw(histories())
    st_ = state_of(events[: draw(st.integers(0, len(events)))])
    keys = sorted(st_.replicas)
    actors = set(draw(st.lists(st.sampled_from(keys), unique=True))) if keys else set()
    busy = set(draw(st.lists(st.sampled_from(keys), unique=True, max_size=2))) if keys else set()
    return st_, draw(st.sampled_from(NODES)), actors, busy


@SETTINGS
@given(situations())
def test_never_two_actions_for_one_replica_nor_one_for_a_busy_replica(sit: Any) -> None:
    st_, node, actors, busy = sit
    actions = plan_actions(st_, node, actors, busy)
    keys = [a.key for a in actions]
    assert len(keys) == len(set(keys))
    assert not set(keys) & busy
    assert all(st_.replicas[k].node_id == node for k in keys)
    # What was started is not started again: the same fold with those actions taken (or running) plans nothing.
    assert plan_actions(st_, node, actors, busy | set(keys)) == []
    assert [a for a in plan_actions(st_, node, actors, busy, {a.mark for a in actions}) if a.do is not Do.REAP] == []


@SETTINGS
@given(situations())
def test_never_a_load_onto_cards_a_leaving_replica_holds(sit: Any) -> None:
    st_, node, actors, busy = sit
    leaving = [r for r in st_.replicas.values() if r.node_id == node and r.on_gpu and r.desired is not Level.HOT]
    for a in plan_actions(st_, node, actors, busy):
        if a.do is Do.LOAD:
            for other in leaving:
                assert other.key == a.key or not set(other.gpu_indices) & set(a.replica.gpu_indices), (a, other)


@SETTINGS
@given(situations())
def test_the_plan_is_a_function_of_its_inputs(sit: Any) -> None:
    st_, node, actors, busy = sit
    before = state_of([])  # a plan never changes the fold it reads
    first = plan_actions(st_, node, actors, busy)
    assert plan_actions(st_, node, set(actors), set(busy)) == first
    assert before == state_of([])


@SETTINGS
@given(situations())
def test_after_a_restart_running_processes_are_adopted_not_duplicated(sit: Any) -> None:
    """An agent restarted with no memory (`done` empty) adopts the live processes the log wants on its
    node; it plans no load for a replica already serving, and reaps only processes the log does not want."""
    st_, node, found, _ = sit
    keep, kill = plan_adoption(st_, node, sorted(found))
    assert sorted(keep + kill) == sorted(found)
    for k in keep:
        assert st_.replicas[k].node_id == node and st_.replicas[k].state in LIVE
    for k in kill:
        r = st_.replicas.get(k)
        assert r is None or r.node_id != node or r.state not in LIVE
    for a in plan_actions(st_, node, set(keep), set()):
        assert a.do is not Do.REAP  # an adopted process is wanted
        assert a.replica.state is not S.AVAILABLE  # a serving replica is left alone


@settings(SETTINGS, max_examples=100)
@given(histories(), st.sampled_from(NODES))
def test_forgetting_the_marks_of_past_states_changes_no_plan(events: list[E.Event], node: str) -> None:
    """An agent that takes every planned action, event after event: planning with only
    `current_marks` of what it did gives the same actions as planning with everything it did."""
    st_ = ClusterState()
    done: set[Any] = set()
    for seq, ev in numbered(events):
        st_.apply(seq, ev)
        actors = {k for k, r in st_.replicas.items() if r.node_id == node and r.state in LIVE}
        actions = plan_actions(st_, node, actors, set(), done)
        kept = current_marks(st_, node, done)
        assert kept <= done and plan_actions(st_, node, actors, set(), kept) == actions
        done |= {a.mark for a in actions}


# ---- the real agent over the in-memory log and runtime --------------------------------------


def _agent(log: MemoryEventLog, runtime: FakeRuntime) -> NodeAgent:
    return NodeAgent(log, MemoryHeartbeats(), runtime, NODE, gpus=node_joined(NODE).gpus, cpu_cache_bytes=2**34,
                     heartbeat_s=0.05, drain_timeout_s=0.0, health_interval_s=0.05)


@pytest.mark.timeout(30)
async def test_the_agent_loads_and_after_a_restart_adopts_without_a_second_process() -> None:
    log = MemoryEventLog()
    runtime = FakeRuntime("sim:a")
    await log.append(start() + [scheduled(0, (0,)), scheduled(1, (1,))], None)
    agent = await _agent(log, runtime).start()
    try:
        await until(lambda: all(agent.state.replicas[(M, r)].state is S.AVAILABLE for r in (0, 1)))
    finally:
        await agent.stop()
    assert runtime.created == 2 and {p.level for p in runtime.processes.values()} == {"HOT"}
    # While it was away: replica 1 was evicted COLD in the log, and a stray process appeared.
    await log.append([evict(1, Level.COLD), E.ReplicaUnloaded(**_env("agent"), **rep(1))], None)
    await runtime.create(ReplicaSpec(model_key=M, replica_id=9, checkpoint="/ckpt"))
    agent = await _agent(log, runtime).start()
    try:
        assert set(agent.actors) == {(M, 0)}  # adopted; replica 1's leftover and the stray are killed
        assert set(runtime.processes) == {(M, 0)} and runtime.created == 3
        await asyncio.sleep(0.3)  # health checks run: the adopted replica is alive, nothing is reported
        ours = [e for e in log.events() if isinstance(e, E.ReplicaFailed | E.ReplicaLoading)]
        assert len(ours) == 2  # the two first loads' ReplicaLoading; no failure, no second load
    finally:
        await agent.stop()


@pytest.mark.timeout(30)
async def test_a_restart_loads_with_the_same_per_card_share_as_the_fresh_load() -> None:
    """The replica's layout over its cards is the share placement charged each card: a restarted
    replica must be loaded with it too, not with 0 (which would let the model spread as it likes)."""
    log = MemoryEventLog()
    runtime = FakeRuntime("sim:a")
    share = 3 * 2**30
    await log.append(start() + [E.ReplicaScheduled(**_env("controller"), **rep(0), gpu_indices=(0, 1),
                                                   bytes_per_gpu=share, source=Level.COLD)], None)
    agent = await _agent(log, runtime).start()
    try:
        await until(lambda: agent.state.replicas[(M, 0)].state is S.AVAILABLE)
        await log.append([E.ReplicaRestartRequested(**_env("controller"), **rep(0))], None)
        await until(lambda: agent.state.replicas[(M, 0)].restarts == 1
                    and agent.state.replicas[(M, 0)].state is S.AVAILABLE)
    finally:
        await agent.stop()
    fresh, restarted = runtime.loads
    assert fresh.how == restarted.how == "load"
    assert fresh.devices == restarted.devices == (0, 1)
    assert fresh.bytes_per_gpu == restarted.bytes_per_gpu == share


@pytest.mark.timeout(60)
async def test_what_the_agent_remembers_of_its_actions_stays_bounded() -> None:
    """Replica after replica loaded and unloaded: the agent keeps only the marks of actions the plan
    can still be asked about (those of replicas' current states), not one per action ever taken."""
    log = MemoryEventLog()
    await log.append(start(), None)
    agent = await _agent(log, FakeRuntime("sim:a")).start()
    sizes = []

    def now(rid: int) -> S | None:
        r = agent.state.replicas.get((M, rid))
        return r.state if r is not None else None

    try:
        for rid in range(40):
            await log.append([scheduled(rid, (0,))], None)
            await until(lambda rid=rid: now(rid) is S.AVAILABLE)
            await log.append([evict(rid, Level.COLD)], None)
            await until(lambda rid=rid: now(rid) is S.UNLOADED and not agent._busy)
            agent.reconcile()
            sizes.append(len(agent._done))
    finally:
        await agent.stop()
    assert max(sizes) <= 2, sizes


class _FlakyLog(MemoryEventLog):
    """The in-memory log whose next `fail` appends raise InfrastructureError (a leader election)."""

    def __init__(self, fail: int) -> None:
        super().__init__()
        self.fail = fail

    async def append(self, events: Any, expected_last_seq: int | None) -> Any:
        if self.fail > 0 and expected_last_seq is None:
            self.fail -= 1
            raise InfrastructureError("no stream answers on ndif.evt.>")
        return await super().append(events, expected_last_seq)


@pytest.mark.timeout(30)
async def test_an_append_the_log_refuses_for_a_while_is_retried() -> None:
    """Regression: the retry's log line named a field `event` (structlog's own argument), so the
    first refused append raised TypeError and the action was dropped (seen in the R3 fault test)."""
    log = _FlakyLog(fail=0)
    await log.append(start() + [scheduled(0, (0,))], None)
    log.fail = 2  # the agent's NodeJoined and next appends are refused twice, then stored
    with capture_logs() as logs:
        agent = await _agent(log, FakeRuntime("sim:a")).start()
        try:
            await until(lambda: agent.state.replicas[(M, 0)].state is S.AVAILABLE)
        finally:
            await agent.stop()
    retries = [e for e in logs if e["event"] == "append_retry"]
    assert len(retries) == 2 and retries[0]["event_type"] == "NodeJoined", retries


@pytest.mark.timeout(30)
async def test_a_drain_that_timed_out_says_so_in_the_log_in_history_and_on_the_dashboard() -> None:
    """A dispatcher that serves the replica never answers (it died): the agent ends the drain after
    its timeout with reason `timeout`, which history and the dashboard show as such."""
    from controlplane.core.reasons import event_reason
    from controlplane.dashboard.model import event_row

    log = MemoryEventLog()
    await log.append(start() + hot(0, (0,)) + [served(0, "dispatcher:gone"), evict(0, Level.COLD, drain=True)], None)
    agent = await _agent(log, FakeRuntime("sim:a")).start()
    try:
        await until(lambda: agent.state.replicas[(M, 0)].state is S.UNLOADED)
    finally:
        await agent.stop()
    (drained,) = [e for e in log.events() if isinstance(e, E.ReplicaDrained)]
    assert drained.reason is DrainReason.TIMEOUT and drained.actor == f"agent:{NODE}"
    assert event_reason(drained).startswith("timed out")
    assert event_row(9, drained)["drain"] == "timeout"
    idle = E.ReplicaDrained(**_env("dispatcher:a"), **rep(0))
    assert not event_reason(idle).startswith("timed out") and event_row(9, idle)["drain"] == "idle"
