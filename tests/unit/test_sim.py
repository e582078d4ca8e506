"""The fleet simulator (tools/sim/) on a short day of a few models: its invariants hold at every
tick (no negative count, GPU-seconds that add up, every autoscaled model within its policy's
min..max, a fold without anomalies), and the same spec gives the same day."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

from schemas.autoscale import AutoscalePolicy
from schemas.status import Level

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "sim"))  # the sim's modules, as its scripts see them

from fleet import Sim, charged_on_gpu, replica_bounds_problem
from workload import DaySpec, generate, peak_counts

SPEC = DaySpec(models=6, nodes=3, day_s=1800, seed=3, mean_rate=1.0, bursts_per_model=3.0, burst_mean_s=300)
POLICY = AutoscalePolicy(min_replicas=0, max_replicas=3, target_queue_per_replica=2, upscale_delay_s=2,
                         downscale_delay_s=20, idle_to=Level.WARM, idle_after_s=60, max_wait_s=10)


def invariants(sim: Sim, tick: int) -> None:
    assert all(len(q) >= 0 for q in sim.queue) and all(b >= 0 for b in sim.mem_on_gpu)
    assert all(v > 0 for v in sim.card_refs.values())
    assert sim.mem_total == sum(sim.mem_on_gpu) == charged_on_gpu(sim)
    for i, lanes in enumerate(sim.free):
        ready = sum(1 for r in sim.state.model_replicas(sim.w.model_keys[i]) if r.state.value == "Available")
        assert len(lanes) == ready
    problem = replica_bounds_problem(sim)
    assert problem is None, problem
    assert sim.state.anomaly_count == 0, sim.state.anomalies


def test_a_short_day_keeps_the_invariants_and_adds_up():
    w = generate(SPEC)
    assert w.requests > 100
    n = len(w.model_keys)
    auto = Sim(w, mode="autoscaler", start=[1] * n, policies=dict.fromkeys(range(n), POLICY), check=invariants).run()
    fixed = Sim(w, mode="fixed", start=peak_counts(w, cap=3), check=invariants).run()
    for r in (auto, fixed):
        assert r.served + r.still_queued == w.requests  # every request served or still waiting
        assert abs(sum(r.gpu_hours_by_model) - r.gpu_hours) < 1e-6 * max(1.0, r.gpu_hours)
        assert 0 <= r.wait_p50_s <= r.wait_p99_s <= r.wait_max_s
        assert r.anomalies == 0 and min(r.cold_starts, r.warm_starts, r.evictions) >= 0
    assert fixed.decisions == fixed.evictions == 0
    assert auto.decisions > 0 and auto.evictions > 0  # the bursts came and went: it scaled both ways


def test_the_same_spec_is_the_same_day():
    a, b = generate(SPEC), generate(SPEC)
    assert a.requests == b.requests and (a.counts == b.counts).all() and a.sizes_gb == b.sizes_gb
    other = generate(dataclasses.replace(SPEC, seed=4))
    assert other.requests != a.requests or other.sizes_gb != a.sizes_gb


def test_skipping_unchanged_models_changes_no_decision():
    """The sim evaluates a model only when its inputs, its fold or a running delay could change
    the answer; evaluating every model on every tick must log the very same day."""
    w = generate(SPEC)
    n = len(w.model_keys)
    logs = []
    for exhaustive in (False, True):
        buf = io.BytesIO()
        r = Sim(w, mode="autoscaler", start=[1] * n, policies=dict.fromkeys(range(n), POLICY), log=buf,
                exhaustive=exhaustive).run()
        logs.append((buf.getvalue(), r.evaluations))
    (skipping, few), (every, many) = logs
    assert skipping == every and skipping.count(b"AutoscaleDecided") > 10
    assert few < many / 5
