"""Benchmark of replica loading (node agent and ModelActor): COLD -> HOT vs WARM -> HOT.

Makes a GPT-2 of about `--mb` MB of random float32 weights locally (kept in --dir between runs),
then, on this machine's device (CUDA when present, else CPU):
 (a) the plain `ModelReplica`: `load()` from disk (COLD -> HOT) vs `from_cache()` (WARM -> HOT),
     after `to_cache()`; each `--reps` times, medians reported;
 (b) through Ray, as the agent does it: create the detached `ModelActor` + `load` vs `from_cache`
     on the live actor (skipped with --no-ray, e.g. on the GPU machine, which has no Ray);
 (c) through Ray with a pooled process ready (the agent's `--pool-size`, dataplane/runtime/pool.py):
     `RayRuntime.create` takes it (no process start, imports done) + `load`: ray_cold_to_hot_pooled_s,
     beside (a)'s cold_to_hot_s of the same run (pooled_over_plain). The pool refills in the
     background while the next load runs, as it does in the agent.
COLD -> HOT is the baseline the WARM path is measured against (warm_over_cold). On a CPU machine
WARM -> HOT moves nothing (the weights already are in CPU memory), so it only measures bookkeeping.
The last line printed is one JSON object with the figures.

    python tools/bench/loading.py [--mb 300] [--reps 3] [--dir /tmp/ndif-bench-models] [--no-ray]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dataplane.node.tiny_models import make_gpt2_of_size
from dataplane.replica.model import ModelReplica


def bench_plain(ckpt: str, reps: int, devices: tuple[int, ...]) -> dict[str, float]:
    cold, warm, to_cache = [], [], []
    r = ModelReplica("bench", 0, ckpt)
    for i in range(reps):
        t0 = time.perf_counter()
        r.load(devices)
        cold.append(time.perf_counter() - t0)
        out = r({"op": "forward", "input_ids": [[1, 2, 3]]})
        t0 = time.perf_counter()
        r.to_cache()
        to_cache.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r.from_cache(devices)
        warm.append(time.perf_counter() - t0)
        assert r({"op": "forward", "input_ids": [[1, 2, 3]]}) == out, "WARM -> HOT changed the outputs"
        r.unload()
        print(f"  (a) rep {i + 1}: COLD->HOT {cold[-1]:.3f}s, HOT->WARM {to_cache[-1]:.3f}s, "
              f"WARM->HOT {warm[-1]:.3f}s", flush=True)
    return {"cold_to_hot_s": statistics.median(cold), "warm_to_hot_s": statistics.median(warm),
            "hot_to_warm_s": statistics.median(to_cache), "cold_to_hot_first_s": cold[0]}


def bench_ray(ckpt: str, reps: int, devices: tuple[int, ...]) -> dict[str, float]:
    from dataplane.runtime import ray_adapter as rt

    rt.start_local(max(1, len(devices)))
    node = rt.current_location()
    cold, warm = [], []
    try:
        for i in range(reps):
            t0 = time.perf_counter()
            a = rt.create_actor("bench", i, ckpt, ray_node_id=node, node_id="bench")
            rt.get(a.load.remote(list(devices)))
            cold.append(time.perf_counter() - t0)
            rt.get(a.to_cache.remote())
            t0 = time.perf_counter()
            rt.get(a.from_cache.remote(list(devices)))
            warm.append(time.perf_counter() - t0)
            rt.kill_actor(a)
            print(f"  (b) rep {i + 1}: actor create + COLD->HOT {cold[-1]:.3f}s, WARM->HOT {warm[-1]:.3f}s", flush=True)
    finally:
        rt.shutdown()
    return {"ray_cold_to_hot_s": statistics.median(cold), "ray_warm_to_hot_s": statistics.median(warm)}


async def _pooled(ckpt: str, reps: int, devices: tuple[int, ...]) -> list[float]:
    from dataplane.runtime.ports import ReplicaSpec
    from dataplane.runtime.ray_adapter import RayRuntime

    rt = RayRuntime(pool_size=1)
    await rt.start_pool()
    cold = []
    try:
        for i in range(reps):
            while rt.pool_report()[0] < 1:  # a pooled process ready, as between two cold starts in the agent
                await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            h = await rt.create(ReplicaSpec(model_key="bench-pooled", replica_id=i, checkpoint=ckpt, node_id="bench"))
            await rt.load(h, list(devices), 0)
            cold.append(time.perf_counter() - t0)
            await rt.kill(h)
            print(f"  (c) rep {i + 1}: pooled process taken + COLD->HOT {cold[-1]:.3f}s", flush=True)
    finally:
        await rt.stop_pool(kill=True)
    return cold


def bench_ray_pooled(ckpt: str, reps: int, devices: tuple[int, ...]) -> dict[str, float]:
    from dataplane.runtime import ray_adapter as rt

    rt.start_local(max(1, len(devices)))
    try:
        cold = asyncio.run(_pooled(ckpt, reps, devices))
    finally:
        rt.shutdown()
    return {"ray_cold_to_hot_pooled_s": statistics.median(cold)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=300)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ndif-bench-models"))
    p.add_argument("--no-ray", action="store_true")
    a = p.parse_args()
    t0 = time.perf_counter()
    ckpt = make_gpt2_of_size(a.dir / f"gpt2-{a.mb}mb", a.mb)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(f"checkpoint {ckpt}: {size / 1e6:.0f} MB of weights (ready in {time.perf_counter() - t0:.1f}s)", flush=True)
    cuda = ModelReplica.cuda_available()
    devices = (0,) if cuda else ()
    device = "cuda" if cuda else "cpu"
    if cuda:
        import torch

        print(f"device: {torch.cuda.get_device_name(0)}", flush=True)
    out: dict[str, float | str] = {"device": device, "model_mb": round(size / 1e6, 1)}
    out |= bench_plain(str(ckpt), a.reps, devices)
    if not a.no_ray:
        out |= bench_ray(str(ckpt), a.reps, devices)
        out |= bench_ray_pooled(str(ckpt), a.reps, devices)
        out["pooled_over_plain"] = float(out["ray_cold_to_hot_pooled_s"]) / float(out["cold_to_hot_s"])
    cold, warm = float(out["cold_to_hot_s"]), float(out["warm_to_hot_s"])
    out["warm_over_cold"] = warm / cold if cold else 0.0
    print(f"COLD->HOT {cold:.3f}s, WARM->HOT {warm:.3f}s on {device}: WARM is {out['warm_over_cold']:.3f}x COLD",
          flush=True)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
