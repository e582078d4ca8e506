"""A simulated day for a fleet: the autoscaler against a fixed replica count, on the same requests.

    python tools/sim/day.py [--models 500] [--nodes 1000] [--hours 24] [--seed 0] [--mean-rate 20]
                            [--policy FILE] [--fixed N] [--log PATH]

The fixed fleet gives each model the replicas its peak needs (its highest 5-minute expected rate
at 80% utilisation, at least 1, at most the policy's max), or `--fixed N` for every model. The
autoscaler starts each model at max(min, 1) replicas under `--policy` (a JSON object of
AutoscalePolicy fields; default: tools/sim/fleet.py SIM_POLICY). `--log PATH` writes the
autoscaler's day as JSON lines of events (and PATH.day.json, the spec that regenerates its
requests) for `tools/sim/whatif.py`. Progress is printed as it goes; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
from fleet import SIM_POLICY, Result, Sim
from workload import DaySpec, Workload, generate, peak_counts

from schemas.autoscale import AutoscalePolicy
from schemas.commands import MAX_REPLICAS_PER_MODEL


def load_policy(path: str | None) -> AutoscalePolicy:
    """A policy file: one JSON object of AutoscalePolicy fields (the rest default), validated."""
    if path is None:
        return SIM_POLICY
    p = msgspec.json.decode(Path(path).read_bytes(), type=AutoscalePolicy)
    return p.check(MAX_REPLICAS_PER_MODEL)


def run_autoscaler(w: Workload, policy: AutoscalePolicy, *, log_path: str | None = None, quiet: bool = False) -> Result:
    n = len(w.model_keys)
    say = None if quiet else (lambda s: print(s, flush=True))
    start = [max(policy.min_replicas, 1)] * n
    if log_path is None:
        return Sim(w, mode="autoscaler", start=start, policies=dict.fromkeys(range(n), policy), progress=say).run()
    with open(log_path, "wb") as log:
        r = Sim(w, mode="autoscaler", start=start, policies=dict.fromkeys(range(n), policy), log=log,
                progress=say).run()
    Path(f"{log_path}.day.json").write_text(json.dumps(w.spec.to_json()))
    return r


def run_fixed(w: Workload, counts: list[int], *, quiet: bool = False) -> Result:
    say = None if quiet else (lambda s: print(s, flush=True))
    return Sim(w, mode="fixed", start=counts, progress=say).run()


def compare(auto: Result, fixed: Result) -> dict[str, object]:
    return {
        "gpu_hours_ratio": round(auto.gpu_hours / fixed.gpu_hours, 3) if fixed.gpu_hours else None,
        "wait_p50_s_autoscaler": round(auto.wait_p50_s, 2), "wait_p50_s_fixed": round(fixed.wait_p50_s, 2),
        "wait_p99_s_autoscaler": round(auto.wait_p99_s, 2), "wait_p99_s_fixed": round(fixed.wait_p99_s, 2),
        "cold_starts_per_h": round(auto.cold_starts / auto.hours, 1),
        "warm_starts_per_h": round(auto.warm_starts / auto.hours, 1),
        "evictions_per_h": round(auto.evictions / auto.hours, 1),
        "gpu_hours_autoscaler": round(auto.gpu_hours, 1), "gpu_hours_fixed": round(fixed.gpu_hours, 1),
        "card_hours_ratio": round(auto.card_hours / fixed.card_hours, 3) if fixed.card_hours else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=500)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-rate", type=float, default=20.0, help="requests/s over the fleet, the day's mean")
    ap.add_argument("--policy", help="JSON file of AutoscalePolicy fields")
    ap.add_argument("--fixed", type=int, help="every model's fixed count (default: sized for its peak)")
    ap.add_argument("--log", help="write the autoscaler's day here (JSON lines of events)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    policy = load_policy(a.policy)
    spec = DaySpec(models=a.models, nodes=a.nodes, day_s=int(a.hours * 3600), seed=a.seed, mean_rate=a.mean_rate)
    w = generate(spec)
    t_gen = time.perf_counter() - t0
    if not a.quiet:
        print(f"workload: {w.requests} requests for {spec.models} models on {spec.nodes} nodes x "
              f"{spec.gpus_per_node} GPUs over {a.hours:g} h, generated in {t_gen:.1f} s", flush=True)
    counts = [a.fixed] * spec.models if a.fixed else peak_counts(w, cap=policy.max_replicas)
    # The two days are independent: the fixed one in a forked process (it inherits the workload)
    # while this one runs the autoscaler's.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        fixed_day = pool.submit(run_fixed, w, counts, quiet=a.quiet)
        auto = run_autoscaler(w, policy, log_path=a.log, quiet=a.quiet)
        fixed = fixed_day.result()
    total = time.perf_counter() - t0
    if not a.quiet:
        print("fixed:      " + json.dumps(fixed.summary()), flush=True)
        print("autoscaler: " + json.dumps(auto.summary()), flush=True)
    out: dict[str, object] = {"sim_day_s": round(total, 2), **compare(auto, fixed),
                              "models": spec.models, "nodes": spec.nodes, "hours": a.hours,
                              "requests": w.requests, "workload_s": round(t_gen, 2),
                              "fixed_s": round(fixed.wall_s, 2), "autoscaler_s": round(auto.wall_s, 2),
                              "anomalies": auto.anomalies + fixed.anomalies,
                              "autoscaler_evaluations": auto.evaluations, "autoscaler_decisions": auto.decisions}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
