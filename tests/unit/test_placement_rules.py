"""Placement rules a GPU operator can trust.

Replicas of one model spread (cards, then nodes); other models still pack; the CPU cache is never
over-committed (reused WARM copies free their bytes once, replicas ordered to WARM count); the
controller's settings reach every path that decides and are recorded; evictions are fewest by an
exhaustive reference; the headroom and the GPU count are settings; relative paths never reach the
controller.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core import placement
from controlplane.core.decide import Registration, decide_failure, decide_node_lost
from controlplane.core.decide import decide as _decide
from controlplane.core.placement import Candidate, PlacementRequest, padded, plan
from controlplane.core.projections import ClusterState
from controlplane.ops.render import render_status, status_json
from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.admin import AdminClient
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.commands import Deploy, Evict, Scale
from schemas.errors import InvalidCommand
from schemas.keys import canonical_model_key, model_parts
from schemas.status import EvictionReason, Level, ReplicaState
from tests.cluster_builder import GB, T0, Builder, ctx
from tests.unit.test_placement_equivalence import clusters

NOW = (T0 + timedelta(hours=1)).timestamp()



def decide(*args, **kwargs) -> list[E.Event]:
    """decide() without the CommandDecided record each decision opens with: these tests read placements."""
    return [e for e in _decide(*args, **kwargs) if not isinstance(e, E.CommandDecided)]

def one(state, model, gb, n=1, **kw):
    gpus = kw.pop("gpus", None)
    return plan(state, [PlacementRequest(model_key=model, size_bytes=int(gb * GB), replicas=n, gpus=gpus)], now_s=NOW, **kw)


def apply(b: Builder, events) -> Builder:
    for ev in events:
        b.add(ev)
    return b


# ---- 1. spread --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_four_replicas_on_four_idle_nodes_take_four_nodes(seed):
    b = Builder()
    for i in range(4):
        b.node(f"n{i}", gpus=8)
    p = one(b.state, "m", 10, n=4, seed=seed)
    assert sorted(pl.node_id for pl in p.placed) == ["n0", "n1", "n2", "n3"]


def test_scale_keeps_spreading_over_nodes_then_cards():
    b = Builder().node("a", gpus=2).node("b", gpus=2)
    reg = Registration(checkpoint="/ckpt", size_bytes=10 * GB)
    apply(b, decide(b.state, Deploy(command_id="d", model_key="m", replicas=1), ctx("d"), registration=reg))
    for i in range(3):  # scale one at a time: every new replica takes an empty card, nodes alternate
        apply(b, decide(b.state, Scale(command_id=f"s{i}", model_key="m", replicas=1, scale_up=True), ctx(f"s{i}")))
    where = sorted((r.node_id, r.gpu_indices) for r in b.state.model_replicas("m"))
    assert where == [("a", (0,)), ("a", (1,)), ("b", (0,)), ("b", (1,))]
    # Every card holds one: a fifth replica must share a card, on either node (both hold two).
    apply(b, decide(b.state, Scale(command_id="s9", model_key="m", replicas=1, scale_up=True), ctx("s9")))
    assert len(b.state.model_replicas("m")) == 5


def test_deployed_node_no_longer_attracts_new_replicas_of_the_model():
    s = Builder().node("A").node("B").hot("m", 0, "B", (0,), 12).state
    for seed in range(5):  # whatever the tie-break: the node without the model first
        (pl,) = one(s, "m", 10, seed=seed).placed
        assert pl.node_id == "A" and pl.candidate is Candidate.FREE and pl.replica_id == 1


def test_other_models_still_pack_best_fit():
    s = Builder().node("A", gpus=2).hot("x", 0, "A", (0,), 50).state
    (pl,) = one(s, "y", 10).placed  # card 0 has 30 free, card 1 80: best fit is card 0
    assert pl.gpu_indices == (0,)


def test_a_warm_copy_is_reused_where_the_node_holds_no_replica():
    s = Builder().node("A").node("B").hot("m", 0, "A", (0,), 12).warm("m", 1, "B", (0,), 12).state
    (pl,) = one(s, "m", 10).placed
    assert (pl.node_id, pl.replica_id, pl.source) == ("B", 1, Level.WARM)


def _options(state: ClusterState, model: str, charge: int, gpus: int | None):
    """Every (replicas of the model on the node, shares a card with the model) a placement without
    evictions could take: all card subsets of every live node (brute force)."""
    out = set()
    for node in state.nodes.values():
        if not node.alive or not node.gpus:
            continue
        n, bpg = placement._shape(charge, node.max_card_bytes, gpus)
        holders = [r for r in state.model_replicas(model) if r.on_gpu and r.desired is Level.HOT
                   and r.node_id == node.node_id]
        held = {g for r in holders for g in r.gpu_indices}
        fit = [g.index for g in node.gpus if g.memory_bytes - state.card_committed(node.node_id, g.index) >= bpg]
        for cards in itertools.combinations(fit, n):
            out.add((len(holders), any(c in held for c in cards)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.sampled_from([f"m{i}" for i in range(6)]), st.sampled_from([2, 6, 10, 17, 30]),
       st.sampled_from([None, None, 1, 2]), st.integers(0, 10))
def test_spread_holds_whenever_room_allows(b, model, gb, gpus, seed):
    """A replica placed without evictions goes to a node with the fewest replicas of the model (nodes
    first: the failure domain), and among those shares a card with its model only when no fitting
    card free of it exists there: the brute-force minimum over every node and card subset."""
    charge = padded(gb * GB)
    options = _options(b.state, model, charge, gpus)
    p = plan(b.state, [PlacementRequest(model_key=model, size_bytes=gb * GB, replicas=1, gpus=gpus)], now_s=NOW, seed=seed)
    if not options:
        assert not p.placed or p.evictions or p.placed[0].candidate in (Candidate.FULL, Candidate.CACHED_AND_FULL)
        return
    (pl,) = p.placed
    assert not p.evictions
    holders = [r for r in b.state.model_replicas(model) if r.on_gpu and r.desired is Level.HOT
               and r.node_id == pl.node_id]
    shares = any(g in r.gpu_indices for r in holders for g in pl.gpu_indices)
    assert (len(holders), shares) == min(options)


def test_spread_choices_replay_identically_for_a_seed():
    b = Builder()
    for i in range(5):
        b.node(f"n{i}", gpus=2)
    plans = [one(b.state, "m", 10, n=7, seed=s) for s in range(4)]
    assert plans == [one(b.state, "m", 10, n=7, seed=s) for s in range(4)]
    assert len({tuple(pl.node_id for pl in p.placed) for p in plans}) > 1  # the seed breaks ties


# ---- 2. CPU cache accounting ------------------------------------------------------------------


def settle(b: Builder, events) -> Builder:
    """Apply a decision, then what the agents answer (Cached with the promised bytes, Unloaded, Loaded)."""
    apply(b, events)
    for ev in events:
        r = b.state.replicas.get((ev.model_key, getattr(ev, "replica_id", -1)))
        if r is None:
            continue
        rep = {"model_key": r.model_key, "replica_id": r.replica_id, "node_id": r.node_id}
        if isinstance(ev, E.ReplicaEvictionRequested) and r.state is ReplicaState.UNLOAD_REQUESTED:
            if r.desired is Level.WARM and r.on_gpu:
                b.add(E.ReplicaCached(**b._env("agent"), **rep, cpu_bytes=r.bytes_per_gpu * len(r.gpu_indices)))
            else:
                b.add(E.ReplicaUnloaded(**b._env("agent"), **rep))
        elif isinstance(ev, E.ReplicaScheduled) and r.state is ReplicaState.LOAD_REQUESTED:
            b.add(E.ReplicaLoaded(**b._env("agent"), **rep))
    return b


def test_reusing_a_warm_copy_frees_its_bytes_once():
    # Cache 10: WARM m (6) and y (4) fill it. Deploying m reuses its copy (frees 6), and pressure
    # evicts z (8) on the same node: the cache must drop y to hold z (4 + 8 > 10).
    b = Builder().node("A", gpus=1, gpu_gb=80, cpu_gb=10)
    b.warm("m", 0, "A", (0,), 6).warm("y", 0, "A", (0,), 4).hot("z", 0, "A", (0,), 8).hot("w", 0, "A", (0,), 70)
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=int(6 / 1.15 * GB), replicas=1, headroom=0.15)],
             now_s=NOW)
    (pl,) = p.placed
    assert pl.source is Level.WARM
    targets = {e.model_key: e.target for e in p.evictions}
    assert targets.get("z") is Level.WARM and targets.get("y") is Level.COLD, targets


def test_replicas_ordered_to_warm_count_before_they_are_cached():
    b = Builder().node("A", gpus=2, cpu_gb=50).hot("x", 0, "A", (0,), 40).hot("y", 0, "A", (1,), 40)
    apply(b, decide(b.state, Evict(command_id="e1", model_key="x"), ctx("e1")))
    assert b.state.replicas[("x", 0)].desired is Level.WARM
    assert b.state.cpu_committed("A") == 40 * GB and b.state.cpu_cached("A") == 0
    (ev,) = decide(b.state, Evict(command_id="e2", model_key="y"), ctx("e2"))
    assert ev.target is Level.COLD  # 40 + 40 > 50: the second eviction may not go WARM as well


def test_the_fold_flags_cpu_cache_over_commit():
    b = Builder().node("A", gpus=2, cpu_gb=50).hot("x", 0, "A", (0,), 40).hot("y", 0, "A", (1,), 40)
    for m in ("x", "y"):  # two WARM orders that a correct controller would never write
        b.add(E.ReplicaEvictionRequested(**b._env("controller"), model_key=m, replica_id=0, node_id="A",
                                         reason=EvictionReason.ADMIN, target=Level.WARM))
    assert b.state.anomaly_count == 1 and "CPU cache" in b.state.anomalies[-1].message
    b2 = Builder().node("A", gpus=1, cpu_gb=50).hot("x", 0, "A", (0,), 40)
    b2.add(E.ReplicaEvictionRequested(**b2._env("controller"), model_key="x", replica_id=0, node_id="A",
                                      reason=EvictionReason.ADMIN, target=Level.WARM))
    b2.add(E.ReplicaCached(**b2._env("agent"), model_key="x", replica_id=0, node_id="A", cpu_bytes=60 * GB))
    assert b2.state.anomaly_count == 1 and "over-committed" in b2.state.anomalies[-1].message


# ---- 3. settings reach every path and are recorded ---------------------------------------------


def _young_blocker() -> Builder:
    """m on node A (1 card) failed for good; node B's only card is held by x, loaded 100 s ago."""
    b = Builder().node("A", gpus=1).node("B", gpus=1)
    b.hot("m", 0, "A", (0,), 50)
    b.hot("x", 0, "B", (0,), 50, loaded_at=T0 + timedelta(hours=1) - timedelta(seconds=100))
    return b


def test_failure_replacement_honours_min_deploy_s_and_records_it():
    b = _young_blocker()
    b.add(E.ReplicaFailed(**b._env("agent"), model_key="m", replica_id=0, node_id="A", error="boom"))
    r = b.state.replicas[("m", 0)]
    assert r.state is ReplicaState.FAILED
    default = decide_failure(b.state, "m", 0, ctx("f"), max_restarts=0)
    assert not [e for e in default if isinstance(e, E.ReplicaScheduled)]  # x too young at 300 s
    short = decide_failure(b.state, "m", 0, ctx("f"), max_restarts=0, min_deploy_s=60, headroom=0.1)
    (sched,) = [e for e in short if isinstance(e, E.ReplicaScheduled)]
    assert sched.node_id == "B" and sched.min_deploy_s == 60 and sched.headroom == 0.1
    assert [e.model_key for e in short if isinstance(e, E.ReplicaEvictionRequested)
            and e.reason is EvictionReason.PRESSURE] == ["x"]
    # The failed replica is ended with its own reason (not an operator's `admin`), in both outcomes.
    for events in (default, short):
        assert [(e.model_key, e.reason) for e in events if isinstance(e, E.ReplicaEvictionRequested)
                and e.model_key == "m"] == [("m", EvictionReason.FAILURE)]
    (rej,) = [e for e in default if isinstance(e, E.PlacementRejected)]
    assert rej.min_deploy_s == 300 and rej.headroom == placement.PADDING


def test_node_loss_honours_min_deploy_s():
    b = _young_blocker()
    assert not [e for e in decide_node_lost(b.state, "A", ctx("l"), "t") if isinstance(e, E.ReplicaScheduled)]
    events = decide_node_lost(b.state, "A", ctx("l"), "t", min_deploy_s=60)
    (sched,) = [e for e in events if isinstance(e, E.ReplicaScheduled)]
    assert sched.node_id == "B" and sched.min_deploy_s == 60


def test_a_decision_replays_from_its_events_alone():
    """Re-deciding with what the events recorded (time, seed, settings) gives the same events."""
    b = _young_blocker()
    events = decide_node_lost(b.state, "A", ctx("l", seed=5), "t", min_deploy_s=60, headroom=0.3)
    (sched,) = [e for e in events if isinstance(e, E.ReplicaScheduled)]
    again = decide_node_lost(b.state, "A", ctx("l", now=sched.ts, seed=sched.seed), "t",
                             min_deploy_s=sched.min_deploy_s, headroom=sched.headroom)
    assert again == events


def test_the_controller_passes_its_settings_to_every_path():
    """Commands, failure replacement and node loss all decide with the controller's own settings
    (tests/unit/test_services_memlog.py runs the controller itself over the memory log)."""
    c = Controller(Parts(MemoryEventLog(), None), min_deploy_s=12.0, headroom=0.4)
    assert (c.min_deploy_s, c.headroom) == (12.0, 0.4)
    import inspect

    src = inspect.getsource(Controller)
    for fn in ("decide(", "decide_failure(", "decide_node_lost(", "decide_unplaced("):
        call = src[src.index(f"return {fn}"):]
        call = call[:call.index(")\n")]
        assert "min_deploy_s=self.min_deploy_s" in call and "headroom=self.headroom" in call, fn


# ---- 4. fewest evictions -----------------------------------------------------------------------


def test_one_multi_card_victim_beats_one_victim_per_card():
    # Two 80 GB cards: a (35) + big (40/card) on card 0, b (35) + big on card 1; 5 GB free on each.
    # A 2-card replica charged 30 per card: per card the smallest sufficient victim is a / b (two
    # evictions); evicting big alone frees both cards (one).
    b = Builder().node("A", gpus=2, cpu_gb=0)
    b.hot("a", 0, "A", (0,), 35).hot("b", 0, "A", (1,), 35).hot("big", 0, "A", (0, 1), 40)
    p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=60 * GB, replicas=1, headroom=0.0, gpus=2)], now_s=NOW)
    assert [e.model_key for e in p.evictions] == ["big"]
    assert p.placed[0].gpu_indices == (0, 1)
    # The same without a GPU count: 84 GB spans two 80 GB cards at 42 each; a (33) or big (37)
    # suffices on each card, a is smaller, so a card-by-card choice evicts a and b (two, not one).
    b2 = Builder().node("A", gpus=2, cpu_gb=0)
    b2.hot("a", 0, "A", (0,), 33).hot("b", 0, "A", (1,), 33).hot("big", 0, "A", (0, 1), 37)
    p2 = plan(b2.state, [PlacementRequest(model_key="m", size_bytes=84 * GB, replicas=1, headroom=0.0)], now_s=NOW)
    assert [e.model_key for e in p2.evictions] == ["big"] and p2.placed[0].gpu_indices == (0, 1)


@st.composite
def small_full_clusters(draw, max_nodes=2):
    b = Builder()
    for n in range(draw(st.integers(1, max_nodes))):
        cards = draw(st.integers(1, 3))
        b.node(f"n{n}", gpus=cards, gpu_gb=40, cpu_gb=0)
        free = [40.0] * cards
        for i in range(draw(st.integers(1, 5))):
            span = draw(st.integers(1, cards))
            gb = draw(st.sampled_from([5.0, 10.0, 15.0, 20.0]))
            start = draw(st.integers(0, cards - span))
            gpus = tuple(range(start, start + span))
            if any(free[g] < gb for g in gpus):
                continue
            for g in gpus:
                free[g] -= gb
            b.hot(f"v{n}{i}", 0, f"n{n}", gpus, gb, dedicated=draw(st.integers(0, 5)) == 0)
    return b


def reference_evictions(state: ClusterState, charge: int, gpus: int | None):
    """The fewest, then smallest, evictions over every node and every subset of its evictable replicas."""
    best = None
    for node in state.nodes.values():
        n, bpg = placement._shape(charge, node.max_card_bytes, gpus)
        victims = sorted({k for g in node.gpus for k in state.card_replicas(node.node_id, g.index)
                          if not state.replicas[k].dedicated})
        for size in range(len(victims) + 1):
            for combo in itertools.combinations(victims, size):
                ok = 0
                for g in node.gpus:
                    free = g.memory_bytes - state.card_committed(node.node_id, g.index)
                    free += sum(state.card_replicas(node.node_id, g.index).get(k, 0) for k in combo)
                    ok += free >= bpg
                if ok >= n:
                    cost = (size, sum(state.replicas[k].bytes_per_gpu * len(state.replicas[k].gpu_indices)
                                      for k in combo))
                    best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_full_clusters(), st.sampled_from([5, 10, 20, 30, 40, 60]), st.sampled_from([None, 1, 2]))
def test_evictions_are_minimal_by_exhaustive_reference(b, gb, gpus):
    check_minimal(b, gb, gpus)


def check_minimal(b, gb, gpus):
    charge = gb * GB
    if gpus is not None and not any(len(n.gpus) >= gpus for n in b.state.nodes.values()):
        return
    want = reference_evictions(b.state, charge, gpus)
    p = plan(b.state, [PlacementRequest(model_key="new", size_bytes=charge, replicas=1, headroom=0.0, gpus=gpus)],
             now_s=NOW + 10**6)
    if want is None:
        assert not p.placed
        return
    assert len(p.placed) == 1
    got = [b.state.replicas[(e.model_key, e.replica_id)] for e in p.evictions]
    assert (len(got), sum(r.bytes_per_gpu * len(r.gpu_indices) for r in got)) == want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_full_clusters(max_nodes=placement.EXACT_NODES), st.sampled_from([5, 10, 20, 30, 40, 60]),
       st.sampled_from([None, 1, 2]))
def test_evictions_are_minimal_on_clusters_up_to_exact_nodes(b, gb, gpus):
    # Best first (nodes by their lower bound, stopping once none can beat the best) loses nothing.
    check_minimal(b, gb, gpus)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_full_clusters(max_nodes=6), st.sampled_from([5, 10, 20, 30, 40, 60]), st.sampled_from([None, 1, 2]))
def test_the_decision_budget_keeps_the_search_exact_while_it_lasts(b, gb, gpus):
    # The budget applied to every cluster size, large enough never to run out here: still minimal.
    saved = placement.EXACT_NODES, placement.DECISION_EVICTION_SETS
    placement.EXACT_NODES, placement.DECISION_EVICTION_SETS = 0, 10**6
    try:
        check_minimal(b, gb, gpus)
    finally:
        placement.EXACT_NODES, placement.DECISION_EVICTION_SETS = saved


def test_a_spent_decision_budget_keeps_the_best_found_so_far():
    # Two nodes, each freeing the card with one eviction; a budget of one victim set searches only
    # the node with the best bound (the smaller victim) and still places, with that one eviction.
    b = Builder().node("A", gpus=1, gpu_gb=40, cpu_gb=0).node("B", gpus=1, gpu_gb=40, cpu_gb=0)
    b.hot("a", 0, "A", (0,), 30).hot("b", 0, "B", (0,), 20)
    saved = placement.EXACT_NODES, placement.DECISION_EVICTION_SETS
    placement.EXACT_NODES, placement.DECISION_EVICTION_SETS = 0, 1
    try:
        p = plan(b.state, [PlacementRequest(model_key="m", size_bytes=25 * GB, replicas=1, headroom=0.0)], now_s=NOW + 10**6)
    finally:
        placement.EXACT_NODES, placement.DECISION_EVICTION_SETS = saved
    assert [(e.model_key, e.node_id) for e in p.evictions] == [("b", "B")] and p.placed[0].node_id == "B"


# ---- 5. relative checkpoint paths --------------------------------------------------------------


def test_relative_paths_are_canonicalised_by_the_client_and_refused_by_the_controller(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = AdminClient(log=None)._cmd(Deploy, None, model_key="./tiny")  # type: ignore[arg-type]
    assert model_parts(cmd.model_key)[1] == os.path.join(str(tmp_path), "tiny")
    ctl = Controller(Parts(MemoryEventLog(), None))
    for rel in ("./tiny", "../tiny", "~/tiny", ".", 'nnsight.modeling.language.LanguageModel:{"repo_id": "./tiny", "revision": null}'):
        with pytest.raises(InvalidCommand, match="relative"):
            ctl._canonical(Deploy(command_id="c", model_key=rel))
    with pytest.raises(InvalidCommand, match="relative"):
        canonical_model_key("./tiny", relative=False)
    absolute = canonical_model_key("/ckpt/tiny", relative=False)  # absolute paths and repo ids pass
    assert model_parts(absolute)[1] == "/ckpt/tiny"
    assert canonical_model_key("org/name", relative=False) == canonical_model_key("org/name")


# ---- 6. headroom and GPU count -----------------------------------------------------------------


def test_headroom_is_a_setting_recorded_in_the_models_events():
    b = Builder().node("A", gpus=4)
    reg = Registration(checkpoint="/ckpt", size_bytes=100 * GB)
    events = decide(b.state, Deploy(command_id="d", model_key="m", headroom=0.0), ctx("d"), registration=reg,
                    headroom=0.5)
    (req,) = [e for e in events if isinstance(e, E.DeploymentRequested)]
    (sched,) = [e for e in events if isinstance(e, E.ReplicaScheduled)]
    assert req.headroom == 0.0 and sched.headroom == 0.0 and sched.bytes_per_gpu * len(sched.gpu_indices) < 101 * GB
    apply(b, events)
    assert b.state.models["m"].headroom == 0.0
    # Scale charges with the model's own headroom, not the controller's default.
    more = decide(b.state, Scale(command_id="s", model_key="m", replicas=2), ctx("s"), headroom=0.5)
    (s2,) = [e for e in more if isinstance(e, E.ReplicaScheduled)]
    assert s2.headroom == 0.0 and s2.bytes_per_gpu == sched.bytes_per_gpu
    # Without a per-model headroom the controller's default is charged and recorded.
    b2 = Builder().node("A", gpus=4)
    ev2 = decide(b2.state, Deploy(command_id="d", model_key="m"), ctx("d"), registration=reg, headroom=0.5)
    (s3,) = [e for e in ev2 if isinstance(e, E.ReplicaScheduled)]
    assert s3.headroom == 0.5 and s3.bytes_per_gpu * len(s3.gpu_indices) >= 150 * GB


def test_status_shows_charge_and_headroom():
    b = Builder().node("A", gpus=4)
    reg = Registration(checkpoint="/ckpt", size_bytes=100 * GB)
    apply(b, decide(b.state, Deploy(command_id="d", model_key="m", headroom=0.2, gpus=2), ctx("d"),
                    registration=reg))
    (row,) = status_json(b.state)["models"]
    assert row["headroom"] == 0.2 and row["charge_bytes"] == padded(100 * GB, 0.2) and row["gpus"] == 2
    text = render_status(b.state)
    assert "charge" in text and "headroom" in text and "20%" in text


def test_gpus_places_each_replica_on_exactly_n_cards_charged_an_even_share():
    b = Builder().node("A", gpus=8).node("B", gpus=8)
    reg = Registration(checkpoint="/ckpt", size_bytes=30 * GB)
    events = decide(b.state, Deploy(command_id="d", model_key="m", replicas=3, gpus=4, headroom=0.0), ctx("d"),
                    registration=reg)
    scheds = [e for e in events if isinstance(e, E.ReplicaScheduled)]
    assert len(scheds) == 3
    for e in scheds:
        assert len(e.gpu_indices) == 4 and e.bytes_per_gpu == -(-30 * GB // 4)
    apply(b, events)
    assert b.state.models["m"].gpus == 4
    more = decide(b.state, Scale(command_id="s", model_key="m", replicas=1, scale_up=True), ctx("s"))
    (e4,) = [e for e in more if isinstance(e, E.ReplicaScheduled)]
    assert len(e4.gpu_indices) == 4  # the model keeps its GPU count
    one_card = decide(b.state, Scale(command_id="s1", model_key="m", replicas=1, scale_up=True, gpus=1), ctx("s1"))
    (e5,) = [e for e in one_card if isinstance(e, E.ReplicaScheduled)]
    assert len(e5.gpu_indices) == 1 and e5.bytes_per_gpu == 30 * GB


def test_gpus_refused_before_anything_is_reserved_when_a_card_cannot_hold_its_share():
    b = Builder().node("A", gpus=4, gpu_gb=24)
    reg = Registration(checkpoint="/ckpt", size_bytes=90 * GB)
    with pytest.raises(InvalidCommand, match="--gpus 3"):  # 90 GB / 3 = 30 GB per card > 24
        decide(b.state, Deploy(command_id="d", model_key="m", gpus=3, headroom=0.0), ctx("d"), registration=reg)
    with pytest.raises(InvalidCommand, match="no live node has 8 GPU cards"):
        decide(b.state, Deploy(command_id="d", model_key="m", gpus=8), ctx("d"), registration=reg)
    ok = decide(b.state, Deploy(command_id="d", model_key="m", gpus=4, headroom=0.0), ctx("d"), registration=reg)
    assert [len(e.gpu_indices) for e in ok if isinstance(e, E.ReplicaScheduled)] == [4]


def test_headroom_and_gpus_are_bounded():
    from schemas.commands import validate

    for bad in (Deploy(command_id="c", model_key="m", headroom=-0.1), Deploy(command_id="c", model_key="m", headroom=9),
                Deploy(command_id="c", model_key="m", gpus=0), Scale(command_id="c", model_key="m", replicas=1,
                                                                     gpus=65)):
        with pytest.raises(InvalidCommand):
            validate(bad)


async def test_a_key_an_earlier_version_took_is_still_the_operators_to_manage():
    from controlplane.core.projections.cluster import ModelView
    from schemas.commands import Undeploy

    ctl = await Controller(Parts(MemoryEventLog(), None)).start()
    legacy = 'pkg.mod.Other:{"repo_id": "/m/x", "revision": null}'  # another class: refused as new input
    ctl.state.models[legacy] = ModelView(model_key=legacy)
    assert ctl._canonical(Undeploy(command_id="u", model_key=legacy)).model_key == legacy
    with pytest.raises(InvalidCommand, match="not served"):
        ctl._canonical(Undeploy(command_id="u", model_key=legacy.replace("/m/x", "/m/y")))
    await ctl.stop()
