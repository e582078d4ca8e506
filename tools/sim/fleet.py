"""The fleet in virtual time: the product's pure decide, placement and autoscaler on a simulated day.

No Ray, no NATS, no clock: a `ClusterState` folds every event as the controller's would; the
controller's decisions come from `decide` (the day's deploys and policies) and `decide_autoscale`
(every tick, for each model whose figures or watched condition could change its answer); a
simulated agent answers each placement and eviction after a load time proportional to the model's
size (COLD from disk, faster from a WARM copy); a simulated dispatcher queues each model's requests
FIFO over its Available replicas (each serves one request at a time for the model's service time)
and publishes the queue figures a real one would. What it measures: GPU-hours (the GPU memory
replicas hold, charged as placement charges it, in cards), wait before service, cold starts and
evictions.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import IO

from workload import GB, Workload

from controlplane.core.autoscale import DOWN, IDLE, REFUSED_RETRY_S, classify, decide_autoscale, decision_id, evaluate
from controlplane.core.context import DecisionContext
from controlplane.core.decide import decide
from controlplane.core.placement import PADDING
from controlplane.core.projections.cluster import ClusterState, Registration
from controlplane.core.projections.replica import ReplicaView
from schemas import events as E
from schemas.autoscale import AutoscalePolicy, QueueFigures
from schemas.commands import Autoscale, Deploy
from schemas.status import Level, ReplicaState

S = ReplicaState
T0 = datetime(2026, 1, 1, tzinfo=UTC)
# The simulated fleet's policy: scale up once more than 1.5 requests wait or run per replica
# (held 2 s) or the oldest has waited 5 s; down after 2 minutes below, to WARM copies; to zero after
# 15 minutes idle. A model with requests every few minutes keeps a replica; one idle for longer
# gives its GPU back and its next request waits for a load from the WARM copy.
SIM_POLICY = AutoscalePolicy(min_replicas=0, max_replicas=8, target_queue_per_replica=1.5, upscale_delay_s=2.0,
                             downscale_delay_s=120.0, idle_to=Level.WARM, idle_after_s=900.0, max_wait_s=5.0)
DISPATCHER = "dispatcher:sim"
CONTROLLER = "controller:sim"


def load_s(size_gb: float, source: Level) -> float:
    """Seconds a replica takes to load: from disk at 2 GB/s plus 5 s of start-up; from a WARM
    copy in the node's CPU memory at 20 GB/s plus 1 s."""
    return 1.0 + size_gb / 20.0 if source is Level.WARM else 5.0 + size_gb / 2.0


@dataclass
class Result:
    """One simulated run's figures (times in seconds, rates per hour of the simulated day)."""

    mode: str
    hours: float
    requests: int
    served: int
    still_queued: int
    gpu_hours: float  # charged GPU memory x time, in cards
    card_hours: float  # cards holding any replica x time
    wait_p50_s: float
    wait_p99_s: float
    wait_max_s: float
    cold_starts: int
    warm_starts: int
    evictions: int
    evictions_by_reason: dict[str, int]
    decisions: int  # AutoscaleDecided that changed a count
    watches: int  # AutoscaleDecided that only started or stopped watching a condition
    rejected: int  # PlacementRejected
    events: int
    anomalies: int
    evaluations: int  # calls of the autoscaler
    wall_s: float = 0.0
    gpu_hours_by_model: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        h = max(self.hours, 1e-9)
        return {
            "mode": self.mode, "hours": round(self.hours, 3), "requests": self.requests, "served": self.served,
            "still_queued": self.still_queued, "gpu_hours": round(self.gpu_hours, 1),
            "card_hours": round(self.card_hours, 1), "wait_p50_s": round(self.wait_p50_s, 2),
            "wait_p99_s": round(self.wait_p99_s, 2), "wait_max_s": round(self.wait_max_s, 1),
            "cold_starts_per_h": round(self.cold_starts / h, 1), "warm_starts_per_h": round(self.warm_starts / h, 1),
            "evictions_per_h": round(self.evictions / h, 1), "evictions_by_reason": self.evictions_by_reason,
            "decisions": self.decisions, "watches": self.watches, "rejected": self.rejected, "events": self.events,
            "anomalies": self.anomalies, "evaluations": self.evaluations, "wall_s": round(self.wall_s, 2),
        }


def _pct(hist: Counter[int], p: float, unit: float) -> float:
    total = sum(hist.values())
    if not total:
        return 0.0
    want = p / 100 * total
    seen = 0
    for k in sorted(hist):
        seen += hist[k]
        if seen >= want:
            return k * unit
    return max(hist) * unit


class Sim:
    """One simulated day of one fleet under one way of counting replicas.

    `policies`: model index -> the autoscaler's policy (every model starts at `start[i]` replicas);
    `fixed`: model index -> a count that never changes. `log`: every event appended, as JSON lines.
    `check`: called after every tick (tests hold invariants there).
    """

    WAIT_UNIT = 0.01  # waits are kept in a histogram of 10 ms buckets

    def __init__(self, w: Workload, *, mode: str, start: list[int], policies: dict[int, AutoscalePolicy] | None = None,
                 log: IO[bytes] | None = None, check: Callable[[Sim, int], None] | None = None,
                 progress: Callable[[str], None] | None = None, exhaustive: bool = False) -> None:
        self.w, self.mode, self.policies = w, mode, policies or {}
        self.exhaustive = exhaustive
        self.log, self.check, self.progress = log, check, progress
        self.state = ClusterState()
        n = len(w.model_keys)
        self.index = {k: i for i, k in enumerate(w.model_keys)}
        self.card_bytes = int(w.spec.card_gb * GB)
        # Per model: FIFO of arrival times, a heap of each Available replica's next free time, figures.
        self.queue: list[deque[float]] = [deque() for _ in range(n)]
        self.free: list[list[float]] = [[] for _ in range(n)]
        self.done = [0] * n
        self.arrived_now = [0] * n
        self.dirty: set[int] = set(range(n))
        self.count = [0] * n  # each model's replica count (desired HOT), kept in step with the fold
        self.last_busy = [0.0] * n  # when the dispatcher's figures last saw the model busy (its idle clock)
        # The figures `classify` reads at the model's last look (count, queued, running, oldest
        # over its max wait): the same again, an unchanged fold, no delay run out: the same answer.
        self.last_raw: list[tuple[int, int, int, bool] | None] = [None] * n
        # When the autoscaler's answer for an unchanged model can next change (a delay running out).
        self.due = [math.inf] * n
        self.wake: list[tuple[float, int]] = []
        self.mem_on_gpu = [0] * n  # bytes charged on GPUs by the model's replicas (all its cards)
        self.mem_total = 0
        self.mem_since = [0.0] * n  # when mem_on_gpu[i] last changed (its GPU-seconds are added then)
        self.gpu_s_by_model = [0.0] * n
        self.card_refs: dict[tuple[str, int], int] = {}
        self.waits: Counter[int] = Counter()
        self.served = 0
        self.timers: list[tuple[float, int, tuple[str, int], int]] = []
        self._tseq = 0
        self.now_s = 0.0
        self.gpu_s = 0.0
        self.card_s = 0.0
        self.cold = self.warm = self.evictions = self.decisions = self.watches = self.rejected = 0
        self.events = self.evaluations = 0
        self._now_s, self._now_dt = 0.0, T0
        self.by_reason: Counter[str] = Counter()
        self._setup(start)

    # ---- the log ------------------------------------------------------------------------------

    def now(self) -> datetime:
        if self._now_s != self.now_s:
            self._now_s, self._now_dt = self.now_s, T0 + timedelta(seconds=self.now_s)
        return self._now_dt

    def apply(self, events: list[E.Event]) -> None:
        """Fold events as the controller's follow loop would, keeping the sim's own indexes in step."""
        st = self.state
        for ev in events:
            rkey: tuple[str, int] | None = None
            old = None
            if isinstance(ev, E.ReplicaEvent):
                rkey = (ev.model_key, ev.replica_id)
                old = st.replicas.get(rkey)
            st.apply(st.seq + 1, ev)
            self.events += 1
            if self.log is not None:
                self.log.write(E.encode_event(ev) + b"\n")
            cls = ev.__class__
            if cls is E.AutoscaleDecided:
                if ev.target != ev.current:  # type: ignore[attr-defined]
                    self.decisions += 1
                else:
                    self.watches += 1
            elif cls is E.PlacementRejected:
                self.rejected += 1
            if rkey is None:
                continue
            i = self.index[rkey[0]]
            self.dirty.add(i)
            self.count[i] = st.replica_count(rkey[0])
            new = st.replicas.get(rkey)
            if cls is E.ReplicaScheduled:
                if ev.source is Level.WARM:  # type: ignore[attr-defined]
                    self.warm += 1
                else:
                    self.cold += 1
            elif cls is E.ReplicaEvictionRequested:
                self.evictions += 1
                self.by_reason[str(ev.reason)] += 1  # type: ignore[attr-defined]
            self._footprint(i, old, new)
            if new is not None:
                self._agent_timer(new)
            self._sync_ready(i)

    def _footprint(self, i: int, old: ReplicaView | None, new: ReplicaView | None) -> None:
        self.gpu_s_by_model[i] += self.mem_on_gpu[i] / self.card_bytes * (self.now_s - self.mem_since[i])
        self.mem_since[i] = self.now_s
        for r, sign in ((old, -1), (new, 1)):
            if r is not None and r.on_gpu:
                b = sign * r.bytes_per_gpu * len(r.gpu_indices)
                self.mem_on_gpu[i] += b
                self.mem_total += b
                for g in r.gpu_indices:
                    k = (r.node_id, g)
                    c = self.card_refs.get(k, 0) + sign
                    if c:
                        self.card_refs[k] = c
                    else:
                        self.card_refs.pop(k, None)

    # ---- the simulated agent and dispatcher ------------------------------------------------------

    def _agent_timer(self, r: ReplicaView) -> None:
        if r.state is S.LOAD_REQUESTED and r.since_seq == self.state.seq:
            i = self.index[r.model_key]
            source = Level.WARM if r.cpu_bytes else Level.COLD
            self._at(self.now_s + load_s(self.w.sizes_gb[i], source), r.key, r.since_seq)
        elif r.state in (S.DRAINING, S.UNLOAD_REQUESTED) and r.since_seq == self.state.seq:
            self._at(self.now_s + 1.0, r.key, r.since_seq)

    def _at(self, t: float, key: tuple[str, int], since: int) -> None:
        self._tseq += 1
        heapq.heappush(self.timers, (t, self._tseq, key, since))

    def _fire_timers(self) -> None:
        while self.timers and self.timers[0][0] <= self.now_s:
            _, _, key, since = heapq.heappop(self.timers)
            r = self.state.replicas.get(key)
            if r is None or r.since_seq != since:
                continue  # the replica moved on since: this answer is stale
            mk, rid, node, ts = r.model_key, r.replica_id, r.node_id, self.now()
            agent, eid = f"agent:{node}", f"sim-{self._tseq}"
            ev: E.Event
            if r.state is S.LOAD_REQUESTED:
                took = load_s(self.w.sizes_gb[self.index[mk]], Level.WARM if r.cpu_bytes else Level.COLD)
                ev = E.ReplicaLoaded(event_id=eid, ts=ts, actor=agent, model_key=mk, replica_id=rid, node_id=node,
                                     load_seconds=took)
            elif r.state is S.DRAINING:
                ev = E.ReplicaDrained(event_id=eid, ts=ts, actor=DISPATCHER, model_key=mk, replica_id=rid, node_id=node)
            elif r.state is S.UNLOAD_REQUESTED and r.desired is Level.WARM:
                ev = E.ReplicaCached(event_id=eid, ts=ts, actor=agent, model_key=mk, replica_id=rid, node_id=node,
                                     cpu_bytes=r.bytes_per_gpu * len(r.gpu_indices))
            elif r.state is S.UNLOAD_REQUESTED:
                ev = E.ReplicaUnloaded(event_id=eid, ts=ts, actor=agent, model_key=mk, replica_id=rid, node_id=node)
            else:
                continue
            self._tseq += 1
            self.apply([ev])

    def _sync_ready(self, i: int) -> None:
        """The dispatcher's lanes follow the fold: one per Available replica. A replica leaving
        takes no new request (the busiest lane goes: its request in flight still finishes)."""
        mk = self.w.model_keys[i]
        ready = sum(1 for r in self.state.model_replicas(mk) if r.state is S.AVAILABLE)
        lanes = self.free[i]
        while len(lanes) < ready:
            heapq.heappush(lanes, self.now_s)
        if len(lanes) > ready:
            lanes.sort()
            del lanes[ready:]

    def _serve(self, i: int, t_end: float) -> None:
        """Start queued requests on free lanes up to `t_end`, FIFO; record each one's wait."""
        q, lanes = self.queue[i], self.free[i]
        if not lanes:
            return
        s = self.w.service_s[i]
        unit = self.WAIT_UNIT
        waits = self.waits
        while q:
            f = lanes[0]
            a = q[0]
            start = f if f > a else a
            if start >= t_end:
                break
            q.popleft()
            heapq.heapreplace(lanes, start + s)
            waits[int((start - a) / unit)] += 1
            self.done[i] += 1
            self.served += 1

    def figures(self, i: int) -> QueueFigures:
        q, lanes = self.queue[i], self.free[i]
        t = self.now_s
        running = sum(1 for f in lanes if f > t)
        return QueueFigures(model_key=self.w.model_keys[i], queued=len(q), running=running,
                            oldest_wait_s=round(t - q[0], 3) if q else 0.0,
                            arrival_rate=self.arrived_now[i] / self.w.spec.tick_s, completions=self.done[i],
                            dispatcher=DISPATCHER, ts=self.now(), idle_s=t - self.last_busy[i])

    # ---- the day -----------------------------------------------------------------------------

    def _setup(self, start: list[int]) -> None:
        spec = self.w.spec
        gpus = tuple(E.GpuInfo(index=g, memory_bytes=self.card_bytes) for g in range(spec.gpus_per_node))
        joined: list[E.Event] = [
            E.NodeJoined(event_id=f"join-{k}", ts=T0, actor=f"agent:node-{k:04d}", node_id=f"node-{k:04d}", gpus=gpus,
                         cpu_cache_bytes=int(spec.cpu_cache_gb * GB))
            for k in range(spec.nodes)]
        self.apply(joined)
        for i, mk in enumerate(self.w.model_keys):
            size = int(self.w.sizes_gb[i] * GB)
            reg = Registration(checkpoint=f"/models/{mk}", size_bytes=size)
            cid = f"deploy-{i}"
            if start[i]:
                ctx = DecisionContext(now=T0, actor=CONTROLLER, command_id=cid, seed=i)
                self.apply(decide(self.state, Deploy(command_id=cid, model_key=mk, replicas=start[i]), ctx,
                                  registration=reg))
            else:  # registered, no replica yet (a model at zero)
                self.apply([E.ModelRegistered(event_id=f"{cid}.0", ts=T0, actor=CONTROLLER, model_key=mk,
                                              checkpoint=reg.checkpoint, size_bytes=size)])
            p = self.policies.get(i)
            if p is not None:
                cid = f"policy-{i}"
                self.apply(decide(self.state, Autoscale(command_id=cid, model_key=mk, policy=p),
                                  DecisionContext(now=T0, actor=CONTROLLER, command_id=cid)))
        # The day starts with the starting replicas loaded (both ways of counting alike).
        while self.timers:
            self.now_s = self.timers[0][0]
            self._fire_timers()
        self.now_s = 0.0

    def run(self) -> Result:
        import time
        t_wall = time.perf_counter()
        w, tick = self.w, self.w.spec.tick_s
        active: set[int] = set()
        autoscaled = bool(self.policies)
        report_every = max(1, int(3600 / tick))
        for t in range(w.ticks):
            self.now_s = t * tick
            self._fire_timers()
            models, counts = w.arrivals(t)
            queue, arrived, now_s = self.queue, self.arrived_now, self.now_s
            for m, c in zip(models.tolist(), counts.tolist(), strict=True):
                if c == 1:
                    queue[m].append(now_s + tick / 2)
                else:
                    step = tick / c
                    base = now_s + step / 2
                    queue[m].extend([base + j * step for j in range(c)])
                arrived[m] = c
                active.add(m)
            t_end = self.now_s + tick
            touched = list(active)
            busy = self.last_busy
            free = self.free
            for m in touched:
                busy[m] = t_end  # queued, running or finishing in this tick: the figures at its end say busy
                if queue[m]:
                    self._serve(m, t_end)
                if not queue[m] and max(free[m], default=0.0) <= t_end:
                    active.discard(m)
            # GPU accounting for this tick, then the figures at its end go to the autoscaler: for
            # the models whose figures moved, whose replicas changed, or whose delay ran out.
            self.gpu_s += self.mem_total / self.card_bytes * tick
            self.card_s += len(self.card_refs) * tick
            self.now_s = t_end
            if autoscaled:
                todo = set(self.policies) if self.exhaustive else set(touched)
                todo |= self.dirty
                while self.wake and self.wake[0][0] <= t_end:
                    todo.add(heapq.heappop(self.wake)[1])
                for i in sorted(todo):
                    if i in self.policies:
                        self._autoscale(i)
            for m in models.tolist():
                self.arrived_now[m] = 0
            if self.check is not None:
                self.check(self, t)
            if self.progress is not None and (t + 1) % report_every == 0:
                self.progress(f"{self.mode}: hour {(t + 1) // report_every:>2}: {self.served} served, "
                              f"{self.decisions} decisions, {self.cold} cold / {self.warm} warm starts, "
                              f"{self.evictions} evictions, {time.perf_counter() - t_wall:.1f} s")
        # Requests still queued at the end count with the wait they had so far.
        still = 0
        for q in self.queue:
            for a in q:
                self.waits[int((self.now_s - a) / self.WAIT_UNIT)] += 1
                still += 1
        for i in range(len(self.mem_on_gpu)):
            self._footprint(i, None, None)  # close each model's GPU-seconds at the end of the day
        hours = w.ticks * tick / 3600
        return Result(
            mode=self.mode, hours=hours, requests=w.requests, served=self.served, still_queued=still,
            gpu_hours=self.gpu_s / 3600, card_hours=self.card_s / 3600,
            wait_p50_s=_pct(self.waits, 50, self.WAIT_UNIT), wait_p99_s=_pct(self.waits, 99, self.WAIT_UNIT),
            wait_max_s=max(self.waits, default=0) * self.WAIT_UNIT, cold_starts=self.cold, warm_starts=self.warm,
            evictions=self.evictions, evictions_by_reason=dict(self.by_reason), decisions=self.decisions,
            watches=self.watches, rejected=self.rejected, events=self.events, anomalies=self.state.anomaly_count,
            evaluations=self.evaluations, wall_s=time.perf_counter() - t_wall,
            gpu_hours_by_model=[g / 3600 for g in self.gpu_s_by_model],
        )

    def _autoscale(self, i: int) -> None:
        """The controller's tick for one model, skipped when its answer cannot have changed: the
        same inputs of `classify` (or the same classification), the same fold, and no delay run
        out since the last evaluation (which then decided nothing). `exhaustive` evaluates anyway
        (the check that skipping changes no decision)."""
        q = self.queue[i]
        t = self.now_s
        n = self.count[i]
        p = self.policies[i]
        queued = len(q)
        lanes = self.free[i]
        running = sum(1 for f in lanes if f > t) if lanes and max(lanes) > t else 0
        fresh = i not in self.dirty and t < self.due[i] and not self.exhaustive
        raw = (n, queued, running, bool(q) and p.max_wait_s is not None and t - q[0] > p.max_wait_s)
        if fresh and raw == self.last_raw[i]:
            return
        self.last_raw[i] = raw
        seen = QueueFigures(queued=queued, running=running, oldest_wait_s=t - q[0] if q else 0.0)
        key = classify(p, n, seen)
        if fresh and not (n == 0 and queued) and self._same(i, key[0]):
            return
        self.dirty.discard(i)
        self.evaluations += 1
        mk = self.w.model_keys[i]
        now = self.now()
        f = self.figures(i)
        if evaluate(self.state, mk, f, now) is not None:
            cid = decision_id(self.state, mk, str(i))
            ctx = DecisionContext(now=now, actor=CONTROLLER, command_id=cid, seed=self.state.seq)
            events = decide_autoscale(self.state, mk, f, ctx, headroom=PADDING)
            if events:
                self.apply(events)
                self.dirty.add(i)
                return
        due = self._next_due(i, t)
        self.due[i] = due
        if due < math.inf:
            heapq.heappush(self.wake, (due, i))

    def _same(self, i: int, condition: str) -> bool:
        """The condition the figures show is the one the log watches (idle: within a `down` or
        nothing watched, its delay in the figures): before a delay runs out, `evaluate` answers
        nothing, whatever count the condition asks for."""
        logged = self.state.models[self.w.model_keys[i]].autoscale_condition
        return condition == logged or (condition == IDLE and logged in ("", DOWN))

    def _next_due(self, i: int, t: float) -> float:
        """The first time after `t` at which `evaluate` could answer otherwise on the same figures
        and fold: a delay of the watched condition, of idle, or one counted from the last change,
        running out."""
        m = self.state.models[self.w.model_keys[i]]
        p = m.autoscale
        if p is None:
            return math.inf
        idle = self.last_busy[i]
        marks = [idle + p.downscale_delay_s, idle + p.idle_after_s]
        if m.autoscale_since is not None:
            since = (m.autoscale_since - T0).total_seconds()
            marks += [since + p.upscale_delay_s, since + p.downscale_delay_s]
        if m.autoscale_idle_from is not None:
            raised = (m.autoscale_idle_from - T0).total_seconds()
            marks += [raised + p.downscale_delay_s, raised + p.idle_after_s]
        if m.autoscale_last_at is not None:
            last = (m.autoscale_last_at - T0).total_seconds()
            marks += [last + p.downscale_delay_s, last + max(REFUSED_RETRY_S, p.upscale_delay_s)]
        later = [x for x in marks if x > t]
        # whole ticks: the controller's tick after the mark
        return math.ceil(min(later)) if later else math.inf


def replica_bounds_problem(sim: Sim) -> str | None:
    """An autoscaled model outside its policy's min..max (None: all within)."""
    for i, p in sim.policies.items():
        n = sim.state.replica_count(sim.w.model_keys[i])
        if not p.min_replicas <= n <= p.max_replicas:
            return f"{sim.w.model_keys[i]} has {n} replicas, policy {p.min_replicas}..{p.max_replicas}"
    return None


def charged_on_gpu(sim: Sim) -> int:
    """GPU bytes held by replicas, read from the fold (what the sim's running total must equal)."""
    return sum(r.bytes_per_gpu * len(r.gpu_indices) for r in sim.state.replicas.values() if r.on_gpu)
