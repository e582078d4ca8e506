"""Random operator command sequences through decide + evolve, with an agent that carries them out.

Laws: no card is ever over-committed; pressure never evicts a dedicated replica; a replica id is
never reused for a different replica (new replicas take fresh ids; only a WARM copy comes back
under its own id); a duplicate command id decides nothing.
"""

from __future__ import annotations

from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core import placement
from controlplane.core.decide import Registration, decide, decide_failure, decide_node_lost
from controlplane.core.projections import ClusterState
from schemas import events as E
from schemas.commands import Deploy, Evict, Restart, Scale, ScaleDown
from schemas.errors import NdifError
from schemas.status import EvictionReason, Level, ReplicaState
from tests.cluster_builder import GB, T0, Builder, ctx

MODELS = ["m-small", "m-mid", "m-big"]
SIZES = {"m-small": 8 * GB, "m-mid": 30 * GB, "m-big": 100 * GB}
NODES = ["n0", "n1", "n2"]

commands = st.one_of(
    st.builds(lambda m, n, d, h, g: ("deploy", m, n, d, h, g), st.sampled_from(MODELS), st.integers(1, 3),
              st.booleans(), st.sampled_from([None, None, 0.0, 0.5]), st.sampled_from([None, None, 1, 2])),
    st.builds(lambda m, n, up, d: ("scale", m, n, up, d), st.sampled_from(MODELS), st.integers(1, 4), st.booleans(),
              st.booleans()),
    st.builds(lambda m, n: ("scale-down", m, n), st.sampled_from(MODELS), st.integers(0, 2)),
    st.builds(lambda m, r, c: ("evict", m, r, c), st.sampled_from(MODELS), st.one_of(st.none(), st.integers(0, 5)),
              st.booleans()),
    st.builds(lambda c: ("evict-all", c), st.booleans()),
    st.builds(lambda m, r: ("restart", m, r), st.sampled_from(MODELS), st.one_of(st.none(), st.integers(0, 5))),
    st.builds(lambda m, r: ("fail", m, r), st.sampled_from(MODELS), st.integers(0, 5)),
    st.builds(lambda n: ("node-lost", n), st.sampled_from(NODES)),
    st.just(("dup",)),
)


def to_command(c, i):
    cid = f"c{i}"
    match c:
        case ("deploy", m, n, d, h, g):
            return Deploy(command_id=cid, model_key=m, replicas=n, dedicated=d, headroom=h, gpus=g)
        case ("scale", m, n, up, d):
            return Scale(command_id=cid, model_key=m, replicas=n, scale_up=up, dedicated=d)
        case ("scale-down", m, n):
            return ScaleDown(command_id=cid, model_key=m, replicas=n)
        case ("evict", m, r, cold):
            return Evict(command_id=cid, model_key=m, replica_id=r, cold=cold)
        case ("evict-all", cold):
            return Evict(command_id=cid, all=True, cold=cold)
        case ("restart", m, r):
            return Restart(command_id=cid, model_key=m, replica_id=r)
    return None


class Agent:
    """Carries out what the controller asked, at once (the scripted node agents)."""

    def __init__(self, b: Builder) -> None:
        self.b = b

    def react(self, ev: E.Event) -> None:
        s = self.b.state
        env = self.b._env
        if isinstance(ev, E.ReplicaEvent):
            r = s.replicas.get((ev.model_key, ev.replica_id))
            if r is None or not s.nodes.get(r.node_id, None) or not s.nodes[r.node_id].alive:
                return
            rep = {"model_key": r.model_key, "replica_id": r.replica_id, "node_id": r.node_id}
            if isinstance(ev, E.ReplicaScheduled) and r.state is ReplicaState.LOAD_REQUESTED:
                self.b.add(E.ReplicaLoaded(**env("agent", T0), **rep))
            elif isinstance(ev, E.ReplicaEvictionRequested) and r.state in (ReplicaState.UNLOAD_REQUESTED,
                                                                           ReplicaState.DRAINING):
                if r.state is ReplicaState.DRAINING:
                    self.b.add(E.ReplicaDrained(**env("dispatcher"), **rep))
                if ev.target is Level.WARM and r.on_gpu:
                    self.b.add(E.ReplicaCached(**env("agent"), **rep, cpu_bytes=r.bytes_per_gpu * len(r.gpu_indices)))
                else:
                    self.b.add(E.ReplicaUnloaded(**env("agent"), **rep))
            elif isinstance(ev, E.ReplicaRestartRequested) and r.state is ReplicaState.RESTARTING:
                self.b.add(E.ReplicaRestarted(**env("agent"), **rep))


def reference_choose(w, nodes, pos, req, size, spread, now_s, min_deploy_s):
    """Placement's node choice by exhaustive ranking of every node (no early exit, no index, no pruning)."""
    warm_by_node = placement._warm_copies(w, req.model_key)
    best = None
    for i, node in enumerate(nodes):  # what fits as is: (most of the model on a chosen card, its replicas there, no WARM, order)
        n, bpg = placement._shape(size, node.max_card_bytes, req.gpus)
        crowd = spread.cards.get(node.node_id, {})
        fitting = sorted((crowd.get(g.index, 0), placement._vacating(w, node.node_id, g.index), f, g.index)
                         for g in node.gpus if (f := w.free(node.node_id, g.index, g.memory_bytes)) >= bpg)
        if len(fitting) < n:
            continue
        chosen = fitting[:n]
        warm = warm_by_node.get(node.node_id)
        count = spread.count.get(node.node_id, 0)
        rank = (count, max(c[0] for c in chosen), warm is None, i)
        level = (placement.Candidate.CACHED_AND_FREE if warm else placement.Candidate.DEPLOYED if count
                 else placement.Candidate.FREE)
        if best is None or rank < best[0]:
            best = (rank, (level, node.node_id, tuple(sorted(c[3] for c in chosen)), bpg, (), warm))
    if best is not None:
        return best[1]
    for node in nodes:  # then evictions: (level, how many, how many bytes, order)
        warm = warm_by_node.get(node.node_id)
        level, gpus, bpg, keys = placement._assess_evict(w, node.node_id, req, size, warm, now_s, min_deploy_s)
        if level is placement.Candidate.CANT_ACCOMMODATE:
            continue
        evicted = sum(w.state.replicas[k].bytes_per_gpu * len(w.state.replicas[k].gpu_indices) for k in keys)
        rank = (level, len(keys), evicted)
        if best is None or rank < best[0]:
            best = (rank, (level, node.node_id, gpus, bpg, keys, warm))
    return best[1] if best is not None else None


def decide_by_reference(*args, **kw):
    fast = placement._choose
    placement._choose = reference_choose
    try:
        return decide(*args, **kw)
    finally:
        placement._choose = fast


def check_invariants(s: ClusterState) -> None:
    for node_id, node in s.nodes.items():
        for g in node.gpus:
            assert s.card_committed(node_id, g.index) <= g.memory_bytes, (node_id, g.index)
        # The per-node free index placement reads (cached, invalidated on change) is never stale.
        fresh = sorted((g.memory_bytes - s.card_committed(node_id, g.index) for g in node.gpus), reverse=True)
        assert s.node_free(node_id).free == tuple(fresh), node_id
        # The CPU cache never holds (or is promised) more than its budget.
        assert s.cpu_committed(node_id) <= node.cpu_cache_bytes, (node_id, s.cpu_committed(node_id))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(commands, min_size=1, max_size=25), st.integers(0, 3))
def test_random_command_sequences_keep_the_laws(cmds, seed):
    b = Builder()
    for n in NODES:
        b.node(n, gpus=2, gpu_gb=80, cpu_gb=60)
    agent = Agent(b)
    seen_ids: dict[tuple[str, int], int] = {}  # (model, id) -> seq of its first scheduling
    last_cmd = None
    for i, c in enumerate(cmds):
        s = b.state
        now = T0 + timedelta(hours=1 + i)
        if c[0] == "dup":
            if last_cmd is None:
                continue
            assert decide(s, last_cmd, ctx(last_cmd.command_id, now=now, seed=seed)) == []
            continue
        try:
            if c[0] == "fail":
                r = s.replicas.get((c[1], c[2]))
                if r is None or r.state is not ReplicaState.AVAILABLE:
                    continue
                b.add(E.ReplicaFailed(**b._env("agent"), model_key=r.model_key, replica_id=r.replica_id,
                                      node_id=r.node_id, error="boom"))
                events = decide_failure(b.state, r.model_key, r.replica_id, ctx(f"f{i}", now=now, seed=seed))
            elif c[0] == "node-lost":
                events = decide_node_lost(s, c[1], ctx(f"l{i}", now=now, seed=seed), "test")
            else:
                cmd = to_command(c, i)
                reg = Registration(checkpoint="/ckpt", size_bytes=SIZES[cmd.model_key]) \
                    if getattr(cmd, "model_key", None) else None
                events = decide(s, cmd, ctx(cmd.command_id, now=now, seed=seed), registration=reg)
                # The fast scan (early exit, per-node index, pruning) decides exactly as exhaustive ranking.
                assert events == decide_by_reference(s, cmd, ctx(cmd.command_id, now=now, seed=seed),
                                                     registration=reg)
                last_cmd = cmd
        except NdifError:
            continue
        before = b.state
        for ev in events:
            if isinstance(ev, E.ReplicaEvictionRequested) and ev.reason is EvictionReason.PRESSURE:
                victim = before.replicas[(ev.model_key, ev.replica_id)]
                assert not victim.dedicated, "pressure evicted a dedicated replica"
            if isinstance(ev, E.ReplicaScheduled):
                key = (ev.model_key, ev.replica_id)
                prior = b.state.replicas.get(key)
                if ev.source is Level.WARM:
                    assert prior is not None and prior.state is ReplicaState.CACHED
                else:
                    m = b.state.models.get(ev.model_key)
                    assert key not in seen_ids and (m is None or ev.replica_id >= m.next_replica_id), \
                        f"replica id {key} reused"
                seen_ids.setdefault(key, b.state.seq + 1)
            b.add(ev)
            check_invariants(b.state)
        for ev in events:
            agent.react(ev)
            check_invariants(b.state)
        assert b.state.anomaly_count == 0, b.state.anomalies
