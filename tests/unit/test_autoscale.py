"""The autoscaler, pure: the policy in the log (`ndif autoscale`), decisions from figures and the fold,
delays and hysteresis, a manual count respected, and the laws: within [min, max], no flapping under
a steady load, a restart (re-fold, or a snapshot and its tail) decides the same."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.core.autoscale import decide_autoscale, decision_id, evaluate
from controlplane.core.context import DecisionContext
from controlplane.core.decide import decide
from controlplane.core.projections.cluster import ClusterState, decode_snapshot, encode_snapshot
from controlplane.core.reasons import event_reason
from schemas import events as E
from schemas.autoscale import AutoscalePolicy, QueueFigures, decode_figures, sum_figures
from schemas.commands import Autoscale, Limits, Scale, ScaleDown, decode_command
from schemas.errors import InvalidCommand, NotFound
from schemas.status import Level
from tests.cluster_builder import T0, Builder, ctx

M = "m"
POLICY = AutoscalePolicy(min_replicas=1, max_replicas=8, target_queue_per_replica=4, upscale_delay_s=5,
                         downscale_delay_s=60, idle_to=Level.WARM, idle_after_s=300, max_wait_s=None)


def cluster(replicas: int = 2, policy: AutoscalePolicy | None = POLICY) -> Builder:
    b = Builder().node("n0", gpus=8, cpu_gb=200).node("n1", gpus=8, cpu_gb=200)
    for rid in range(replicas):
        b.hot(M, rid, "n0", (rid,), 5)
    if not replicas:
        b.model(M, 5)
    b.target(M, replicas)
    if policy is not None:
        apply(b.state, decide(b.state, Autoscale(command_id="as", model_key=M, policy=policy), ctx("as")))
    return b


def apply(state: ClusterState, events: list[E.Event]) -> None:
    for e in events:
        state.apply(state.seq + 1, e)


def figures(queued: int = 0, running: int = 0, oldest: float = 0.0, idle: float = 0.0) -> QueueFigures:
    return QueueFigures(model_key=M, queued=queued, running=running, oldest_wait_s=oldest, idle_s=idle)


def tick(state: ClusterState, f: QueueFigures | None, now: datetime) -> list[E.Event]:
    cid = decision_id(state, M, "m")
    events = decide_autoscale(state, M, f, DecisionContext(now=now, actor="controller", command_id=cid))
    apply(state, events)
    return events


def at(s: float) -> datetime:
    return T0 + timedelta(hours=1, seconds=s)


# ---- the policy in the log --------------------------------------------------------------------


def test_the_policy_is_a_command_folded_into_the_model():
    b = cluster()
    m = b.state.models[M]
    assert m.autoscale == POLICY and not m.autoscale_manual
    off = decide(b.state, Autoscale(command_id="off", model_key=M, off=True), ctx("off"))
    assert [type(e) for e in off] == [E.CommandDecided, E.AutoscalePolicySet] and off[1].policy is None
    apply(b.state, off)
    assert b.state.models[M].autoscale is None
    again = decide(b.state, Autoscale(command_id="off2", model_key=M, off=True), ctx("off2"))
    assert [type(e) for e in again] == [E.CommandDecided] and "already off" in again[0].note


def test_a_policy_for_an_unknown_model_is_refused():
    with pytest.raises(NotFound):
        decide(ClusterState(), Autoscale(command_id="x", model_key="nope"), ctx("x"))


@pytest.mark.parametrize("bad, words", [
    ({"min_replicas": 3, "max_replicas": 2}, "above --max"),
    ({"max_replicas": 0}, "--max must be"),
    ({"max_replicas": 129}, "limit per model"),
    ({"min_replicas": -1}, "--min must be"),
    ({"target_queue_per_replica": 0}, "--target-queue-per-replica"),
    ({"upscale_delay_s": -1}, "--upscale-delay"),
    ({"downscale_delay_s": 1e9}, "--downscale-delay"),
    ({"idle_after_s": -5}, "--idle-after"),
    ({"idle_to": "HOT"}, "--idle-to"),
    ({"max_wait_s": 0}, "--max-wait"),
])
def test_policies_are_bounded_when_the_command_is_decoded(bad, words):
    body = msgspec.json.encode({"verb": "autoscale", "command_id": "c", "model_key": M, "policy": bad})
    with pytest.raises(InvalidCommand, match=words):
        decode_command(body, Limits())


def test_nan_is_no_target():
    assert "--target-queue-per-replica" in (AutoscalePolicy(target_queue_per_replica=float("nan")).problem(8) or "")


def test_off_needs_no_valid_policy_and_defaults_are_what_a_user_expects():
    cmd = decode_command(b'{"verb": "autoscale", "command_id": "c", "model_key": "m", "off": true}')
    assert isinstance(cmd, Autoscale) and cmd.off
    p = AutoscalePolicy()
    assert (p.min_replicas, p.max_replicas, p.target_queue_per_replica, p.idle_to) == (1, 8, 4.0, Level.WARM)
    assert p.problem(128) is None


# ---- decisions --------------------------------------------------------------------------------


def test_up_after_the_delay_with_the_figures_the_rule_and_the_target():
    b = cluster(2)
    first = tick(b.state, figures(queued=14, running=2), at(0))
    assert [e.rule for e in first] == ["watch"] and first[0].condition == "up"
    assert tick(b.state, figures(queued=14, running=2), at(3)) == []  # still within the delay
    up = tick(b.state, figures(queued=14, running=2), at(5.2))
    head = up[0]
    assert isinstance(head, E.AutoscaleDecided) and (head.rule, head.current, head.target) == ("queue-above-target", 2, 4)
    assert head.figures is not None and head.figures.queued == 14 and head.held_s == pytest.approx(5.2)
    assert sum(isinstance(e, E.ReplicaScheduled) for e in up) == 2
    assert b.state.replica_count(M) == 4
    assert event_reason(head) == "scaled 2 -> 4: 14 queued, 2 running, 2 replicas, target 4 per replica, above for 5.2 s"
    assert tick(b.state, figures(queued=14, running=2), at(10)) == []  # steady: nothing more


def test_a_condition_that_ends_before_its_delay_does_nothing_and_says_so():
    b = cluster(2)
    tick(b.state, figures(queued=30), at(0))
    cleared = tick(b.state, figures(queued=4), at(2))
    assert [(e.rule, e.condition) for e in cleared] == [("watch", "")]
    again = tick(b.state, figures(queued=30), at(4))
    assert again[0].since == at(4)  # a new condition: its delay counts from now
    assert tick(b.state, figures(queued=30), at(8)) == []


def test_the_oldest_wait_is_a_signal_too():
    b = cluster(2, msgspec.structs.replace(POLICY, max_wait_s=10.0, upscale_delay_s=0))
    (head, *_rest) = tick(b.state, figures(queued=2, oldest=12.0), at(0))
    assert (head.rule, head.target) == ("oldest-wait", 3)


def test_down_after_its_delay_never_below_min_and_idle_goes_warm_then_to_min():
    b = cluster(4, msgspec.structs.replace(POLICY, min_replicas=0))
    assert tick(b.state, figures(queued=0, idle=0), at(0)) == []  # idle starts: the figures count it
    part = tick(b.state, figures(queued=0, idle=60), at(60))
    assert (part[0].rule, part[0].target, part[0].condition, part[0].since) == ("queue-below-target", 1, "", at(0))
    assert b.state.replica_count(M) == 1
    assert tick(b.state, figures(queued=0, idle=200), at(200)) == []
    gone = tick(b.state, figures(queued=0, idle=300), at(300))
    assert (gone[0].rule, gone[0].target, gone[0].level, gone[0].held_s) == ("idle", 0, Level.WARM, 300)
    ev = [e for e in gone if isinstance(e, E.ReplicaEvictionRequested)]
    assert len(ev) == 1 and ev[0].target is Level.WARM and ev[0].drain
    assert b.state.replica_count(M) == 0


def test_a_sparse_models_requests_append_nothing_while_its_idle_delay_restarts():
    """Requests now and then, each resetting the dispatcher's idle clock: no event per request
    (the delay is in the figures), and the idle rule fires only after `idle_after_s` of quiet."""
    b = cluster(1, msgspec.structs.replace(POLICY, min_replicas=0))
    appended: list[E.Event] = []
    for t in range(0, 1200, 10):
        busy = t % 200 == 0  # a request every 200 s, served within the second
        appended += tick(b.state, figures(running=1) if busy else figures(idle=t % 200), at(t))
    assert appended == [] and b.state.replica_count(M) == 1
    gone = tick(b.state, figures(idle=300), at(1500))
    assert (gone[0].rule, gone[0].target, gone[0].held_s) == ("idle", 0, 300)


def test_a_down_watch_goes_on_through_idle_spells():
    """Light load, then none, then light again: the `down` watch begun under the light load is
    not restarted by the idle spells (the load only fell further), and the count goes down after
    `downscale_delay_s` from its start."""
    b = cluster(4)
    assert [e.condition for e in tick(b.state, figures(running=1), at(0))] == ["down"]
    for t in range(5, 60, 5):
        assert tick(b.state, figures(idle=1) if t % 10 else figures(running=1), at(t)) == []
    down = tick(b.state, figures(idle=1), at(60))
    assert (down[0].rule, down[0].current, down[0].target) == ("queue-below-target", 4, 1)
    # replicas scaled down go where the policy sends idle ones: a WARM copy brings them back fast
    assert [e.target for e in down if isinstance(e, E.ReplicaEvictionRequested)] == [Level.WARM] * 3


def test_a_scale_down_goes_to_the_policys_level():
    for level in (Level.WARM, Level.COLD):
        b = cluster(4, msgspec.structs.replace(POLICY, idle_to=level, downscale_delay_s=0))
        down = tick(b.state, figures(running=2), at(0))
        assert (down[0].rule, down[0].target, down[0].level) == ("queue-below-target", 1, level)
        assert [e.target for e in down if isinstance(e, E.ReplicaEvictionRequested)] == [level] * 3


def test_a_replica_brought_back_from_zero_is_not_sent_away_on_figures_from_before():
    """The dispatcher's provisioning deploys from zero on a request's arrival; the figures the
    controller holds may still be the idle ones taken before it: idle counts from the raise."""
    b = cluster(0, msgspec.structs.replace(POLICY, min_replicas=0, idle_after_s=300, downscale_delay_s=60))
    apply(b.state, decide(b.state, Scale(command_id="prov", model_key=M, replicas=1, actor="dispatcher:d"),
                          DecisionContext(now=at(0), actor="dispatcher:d", command_id="prov")))
    assert b.state.replica_count(M) == 1 and not b.state.models[M].autoscale_manual
    assert tick(b.state, figures(idle=1000), at(1)) == []  # stale: taken before the request
    assert tick(b.state, figures(idle=1000), at(299)) == []
    gone = tick(b.state, figures(idle=1000), at(300))
    assert (gone[0].rule, gone[0].target, gone[0].held_s) == ("idle", 0, 300)


def test_from_zero_at_once_on_the_first_queued_request():
    b = cluster(0, msgspec.structs.replace(POLICY, min_replicas=0))
    (head, *rest) = tick(b.state, figures(queued=1), at(0))
    assert (head.rule, head.target) == ("from-zero", 1) and any(isinstance(e, E.ReplicaScheduled) for e in rest)


def test_no_figures_no_decision_even_with_a_scale_down_due():
    b = cluster(4)
    tick(b.state, figures(queued=0), at(0))
    assert evaluate(b.state, M, None, at(1000)) is None


def test_a_manual_count_stands_until_the_policy_is_set_again():
    b = cluster(2)
    apply(b.state, decide(b.state, Scale(command_id="s", model_key=M, replicas=6), ctx("s")))
    assert b.state.models[M].autoscale_manual
    assert evaluate(b.state, M, figures(queued=0), at(10_000)) is None
    apply(b.state, decide(b.state, ScaleDown(command_id="sd", model_key=M, replicas=5), ctx("sd")))
    assert evaluate(b.state, M, figures(queued=100), at(10_000)) is None
    apply(b.state, decide(b.state, Autoscale(command_id="as2", model_key=M, policy=POLICY), ctx("as2")))
    assert not b.state.models[M].autoscale_manual
    assert tick(b.state, figures(queued=100), at(0))[0].rule == "watch"


def test_a_dispatchers_provisioning_deploy_is_not_a_manual_count():
    b = cluster(0, msgspec.structs.replace(POLICY, min_replicas=0))
    events = decide(b.state, Scale(command_id="p", model_key=M, replicas=1, actor="dispatcher:host"),
                    DecisionContext(now=at(0), actor="dispatcher:host", command_id="p"))
    apply(b.state, events)
    assert not b.state.models[M].autoscale_manual


def test_the_policy_bounds_apply_at_once():
    b = cluster(2, msgspec.structs.replace(POLICY, min_replicas=3))
    (head, *_rest) = tick(b.state, figures(queued=0), at(0))
    assert (head.rule, head.target) == ("min", 3)
    b = cluster(5, msgspec.structs.replace(POLICY, max_replicas=3))
    (head, *_rest) = tick(b.state, None, at(0))
    assert (head.rule, head.target) == ("max", 3)


def test_a_refused_scale_up_is_not_asked_again_on_every_tick():
    b = Builder().node("n0", gpus=2, gpu_gb=6)
    b.hot(M, 0, "n0", (0,), 5).hot(M, 1, "n0", (1,), 5).target(M, 2)
    apply(b.state, decide(b.state, Autoscale(command_id="as", model_key=M,
                                             policy=msgspec.structs.replace(POLICY, upscale_delay_s=0)), ctx("as")))
    first = tick(b.state, figures(queued=40), at(0))
    assert any(isinstance(e, E.PlacementRejected) for e in first)
    assert tick(b.state, figures(queued=40), at(5)) == []
    assert tick(b.state, figures(queued=40), at(31))[0].rule == "queue-above-target"


def test_a_decision_already_in_the_log_is_not_appended_again():
    b = cluster(2, msgspec.structs.replace(POLICY, upscale_delay_s=0))
    cid = decision_id(b.state, M, "m")
    first = decide_autoscale(b.state, M, figures(queued=40), DecisionContext(now=at(0), actor="a", command_id=cid))
    apply(b.state, first)
    twin = decide_autoscale(b.state, M, figures(queued=41), DecisionContext(now=at(0.1), actor="b", command_id=cid))
    assert first and twin == []


def test_figures_from_the_wire_are_bounded_and_summed():
    f = decode_figures(msgspec.json.encode(QueueFigures(model_key=M, queued=3, running=1, oldest_wait_s=2.0)))
    assert f.demand == 4
    for bad in (b"{", b'{"model_key": "m", "queued": -1}', b'{"model_key": ""}', b"x" * 5000,
                b'{"model_key": "m", "oldest_wait_s": NaN}'):
        with pytest.raises(InvalidCommand):
            decode_figures(bad)
    s = sum_figures(M, [f, msgspec.structs.replace(f, oldest_wait_s=9.0)])
    assert s is not None and (s.queued, s.running, s.oldest_wait_s, s.dispatchers) == (6, 2, 9.0, 2)
    assert sum_figures(M, []) is None


# ---- laws -------------------------------------------------------------------------------------

policies = st.builds(AutoscalePolicy, min_replicas=st.integers(0, 3), max_replicas=st.integers(3, 8),
                     target_queue_per_replica=st.sampled_from([1.0, 2.5, 4.0]),
                     upscale_delay_s=st.sampled_from([0.0, 2.0, 5.0]),
                     downscale_delay_s=st.sampled_from([0.0, 10.0, 30.0]),
                     idle_to=st.sampled_from([Level.WARM, Level.COLD]),
                     idle_after_s=st.sampled_from([0.0, 20.0, 60.0]),
                     max_wait_s=st.sampled_from([None, 5.0]))
loads = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8), st.floats(0, 20)), min_size=1, max_size=40)


def drive(policy: AutoscalePolicy, load: list[tuple[int, int, float]], *, start: int = 2,
          restart_at: int | None = None, via_snapshot: bool = False) -> list[E.Event]:
    """Tick every second over `load`; at `restart_at` the state is rebuilt from the log alone."""
    b = cluster(start, policy)
    history: list[E.Event] = []
    base = b.state.copy()
    state = b.state
    busy = 0  # the dispatcher's idle clock: since it started, or last saw a request
    for i, (q, r, oldest) in enumerate(load):
        if i == restart_at:
            state = decode_snapshot(encode_snapshot(state)) if via_snapshot else _refold(base, history)
        busy = i if q + r else busy
        history += tick(state, figures(queued=q, running=r, oldest=oldest, idle=i - busy), at(i))
    return history


def _refold(base: ClusterState, history: list[E.Event]) -> ClusterState:
    state = base.copy()
    apply(state, history)
    return state


@settings(max_examples=150, deadline=None)
@given(policies, loads, st.integers(0, 5))
def test_every_count_decided_is_within_min_and_max(policy, load, start):
    for e in drive(policy, load, start=start):
        if isinstance(e, E.AutoscaleDecided) and e.target != e.current:
            assert policy.min_replicas <= e.target <= policy.max_replicas


@settings(max_examples=150, deadline=None)
@given(policies, st.integers(0, 60), st.integers(0, 8), st.integers(0, 5))
def test_no_flapping_under_a_steady_load(policy, queued, running, start):
    decided = [e for e in drive(policy, [(queued, running, 0.0)] * 150, start=start)
               if isinstance(e, E.AutoscaleDecided) and e.target != e.current]
    moves = [e.target > e.current for e in decided]
    assert len(set(moves)) <= 1, [(e.rule, e.current, e.target) for e in decided]  # one direction only
    assert len(decided) <= 3


@settings(max_examples=100, deadline=None)
@given(policies, loads, st.integers(0, 40), st.booleans())
def test_a_restart_decides_as_an_uninterrupted_controller(policy, load, restart_at, via_snapshot):
    assert drive(policy, load, restart_at=restart_at, via_snapshot=via_snapshot) == drive(policy, load)


def test_history_reads_every_autoscale_event():
    b = cluster(2)
    watch = tick(b.state, figures(queued=30), at(0))[0]
    assert event_reason(watch) == "watching: queue above target since 01:00:00 (30 queued, 2 replicas)"
    off = E.AutoscalePolicySet(event_id="x", ts=T0, actor="cli", model_key=M, policy=None)
    assert event_reason(off) == "autoscaling off"
    on = E.AutoscalePolicySet(event_id="y", ts=T0, actor="cli", model_key=M, policy=POLICY)
    assert event_reason(on).startswith("autoscale 1..8 replicas, 4 queued per replica")


def test_turning_autoscaling_on_never_acts_on_idleness_from_before_it():
    """`ndif scale M --replicas 2`, then `ndif autoscale M --min 0 --idle-after 40s` 30 s later: the
    dispatchers' figures say idle for 223.5 s (since the last request), but idleness counts from
    the policy at the earliest, so nothing is evicted before 40 s under the policy."""
    b = cluster(1, policy=None)
    apply(b.state, decide(b.state, Scale(command_id="up2", model_key=M, replicas=2), ctx("up2", now=at(-30))))
    policy = msgspec.structs.replace(POLICY, min_replicas=0, idle_after_s=40, downscale_delay_s=60)
    apply(b.state, decide(b.state, Autoscale(command_id="on", model_key=M, policy=policy), ctx("on", now=at(0))))
    assert b.state.replica_count(M) == 2
    assert tick(b.state, figures(idle=223.5), at(5)) == []
    assert tick(b.state, figures(idle=263.4), at(39.9)) == []
    gone = tick(b.state, figures(idle=263.5), at(40))
    assert (gone[0].rule, gone[0].target, gone[0].held_s) == ("idle", 0, 40)
    # Changing the policy starts the count again, as does an operator's own change of the count.
    b = cluster(2, policy=None)
    apply(b.state, decide(b.state, Autoscale(command_id="on", model_key=M, policy=policy), ctx("on", now=at(0))))
    apply(b.state, decide(b.state, Autoscale(command_id="re", model_key=M, policy=policy), ctx("re", now=at(30))))
    assert tick(b.state, figures(idle=500), at(60)) == []
    assert tick(b.state, figures(idle=500), at(70))[0].target == 0


def test_the_reply_to_autoscale_repeats_the_whole_policy():
    from controlplane.core.decide import summarize

    on = E.AutoscalePolicySet(event_id="y", ts=T0, actor="cli", model_key=M, policy=POLICY)
    msg = summarize("c", [on], 7).message
    assert f"idle after {POLICY.idle_after_s:g} s to {POLICY.idle_to}" in msg, msg
