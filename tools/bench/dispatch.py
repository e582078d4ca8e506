"""Benchmark of the request path: dispatcher, processors, durable requests, SDK.

One run, one machine, 2 no-op replicas (real ModelActors of a tiny checkpoint answering `echo`):
 (a) 1 request in flight: our path (SDK -> NDIF_REQUESTS -> dispatcher -> replica -> terminal
     status, exactly once) vs a raw Ray actor call on the same actors, in alternating blocks of 10:
     added latency p50/p99. The SDK runs in a process of its own (`--client`), as a researcher's
     does: not inside this Ray driver, whose threads slow every other thing of its process (the
     same SDK inside it is measured too, as the extra `in_driver_*` figures);
 (b) 16 in flight: requests/s through our path vs Ray Serve (`serve.run` of a 2-replica no-op
     deployment, handle calls) vs raw pipelined Ray actor calls, in paired rounds (medians);
 (c) event-to-lanes: `ReplicaLoaded` appended -> the processor's lanes for it taking requests
     (a replica evicted to WARM and scaled back, repeatedly);
 (a') (a) again with the dispatcher's replica calls made through Ray instead of the replicas' NATS
     endpoints (NDIF_REPLICA_LINK=ray): what the endpoint saves, as extra `ray_link_*` figures.
With `--sync both` the whole run is made twice, on a server of each sync setting (`2m` second); figures
under `2m` get keys ending in `_nosync`.
The last line printed is one JSON object with the figures.

The dispatcher runs in its own process (`ndif dispatcher`), as deployed; the controller and agent
in this one, the SDK in both (see (a)). With `--auth` the server has the users and accounts `ndif up` configures
(controlplane/ops/auth.py `ensure_local`): the SDK connects as a client user, the dispatcher, the
agent (and its replicas' endpoints), the controller and the admin as their roles.

    python tools/bench/dispatch.py [--requests 2000] [--rounds 5] [--single 400] [--cycles 20] [--in-process] [--auth]
                                   [--sync always|2m|both]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controlplane.service.logs import configure

configure("ERROR")
logging.getLogger("ray").setLevel(logging.ERROR)

from benchkit import SYNC_CHOICES, Child, add_sync_option, answer, commands, in_flight, pct, sync_suffix  # noqa: E402

from controlplane.ops.auth import LocalAuth, ensure_local  # noqa: E402
from controlplane.ops.nats_server import EmbeddedNats  # noqa: E402
from controlplane.service.controller import Controller  # noqa: E402
from controlplane.store.admin import AdminClient  # noqa: E402
from controlplane.store.credentials import Creds, creds_file, load_creds  # noqa: E402
from controlplane.store.eventstore import JetStreamEventLog  # noqa: E402
from dataplane.client import Client  # noqa: E402
from dataplane.node.agent import NodeAgent, declared_gpus  # noqa: E402
from dataplane.node.tiny_models import make_tiny_gpt2  # noqa: E402
from dataplane.runtime import ray_adapter  # noqa: E402
from dataplane.runtime.ray_adapter import get_actor  # noqa: E402
from dataplane.serving.dispatcher import Dispatcher  # noqa: E402
from schemas import events as E  # noqa: E402
from schemas.keys import canonical_model_key  # noqa: E402
from schemas.status import ReplicaState  # noqa: E402

NOOP = {"op": "echo", "data": 1}


async def single(ours_block: Callable[[int], Awaitable[list[float]]], actors: list[Any], n: int,
                 block: int = 10) -> tuple[list[float], list[float]]:
    """1 in flight, our path and a raw Ray call in alternating blocks of `block` (paired: drift hits both
    alike). Not strictly one-one: a Ray call leaves this process and the replica busy for a while after
    it returns, and a NATS round trip right behind it takes ~2.5x as long (0.22 -> 0.55 ms measured
    here), which would charge the raw call's aftermath to our path. `ours_block(k)`: k requests one
    after another, each one's time (ms)."""
    raw: list[float] = []
    ours: list[float] = []
    for i in range(n):
        for _ in range(block):
            t0 = time.perf_counter()
            await actors[i % 2].__call__.remote(NOOP)
            raw.append((time.perf_counter() - t0) * 1000)
        ours += await ours_block(block)
        if len(ours) >= n:
            break
    return raw, ours


async def run_block(c: Client, model: str, k: int) -> list[float]:
    """`k` requests through the SDK, one after another: each one's time in ms."""
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        await c.run(model, NOOP, timeout=60)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def client_main(url: str, model: str, creds_path: str) -> None:
    """The `--client` process: an SDK client (no Ray in this process), running blocks on command."""
    creds = load_creds(Path(creds_path)) if creds_path else None
    async with Client(url, creds=creds) as c:
        async for cmd in commands():
            answer({"ms": await run_block(c, model, cmd["n"])} if cmd["op"] == "run" else {})


class ServeNoop:
    """Ray Serve: a 2-replica no-op deployment, called through its handle (16 in flight)."""

    def start(self) -> ServeNoop:
        class Noop:
            async def __call__(self, req: dict[str, Any]) -> dict[str, Any]:
                return {"echo": req.get("data")}

        self.handle = ray_adapter.serve_run(Noop, name="bench-noop", num_replicas=2)
        self.rps(50)  # warm
        return self

    def rps(self, total: int) -> float:
        return asyncio.run_coroutine_threadsafe(in_flight(lambda: self.handle.remote(NOOP), total),
                                                _serve_loop()).result()

    def stop(self) -> None:
        ray_adapter.serve_shutdown()


_loop: asyncio.AbstractEventLoop | None = None


def _serve_loop() -> asyncio.AbstractEventLoop:
    """Serve handles want their own running loop (not the benchmark's, which is blocked meanwhile)."""
    import threading

    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, daemon=True).start()
    return _loop


async def main(a: argparse.Namespace, sync: str) -> dict[str, float]:
    print(f"sync_interval {sync}:", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="ndif-bench-"))
    auth: LocalAuth | None = ensure_local(["bench-node"], clients=["bench"], home=tmp / "home") if a.auth else None

    def role(name: str) -> Creds | None:
        return auth.role(name) if auth else None

    srv = EmbeddedNats(tmp / "nats", config_file=auth.config_path if auth else None, sync_interval=sync)
    await srv.astart()
    url = srv.url
    log = await JetStreamEventLog.open(url, creds=role("admin"))
    await log.close()
    ray_adapter.start_local(2, num_cpus=4)
    ckpt = str(make_tiny_gpt2(tmp / "tiny"))
    mk = canonical_model_key(ckpt)
    out: dict[str, float] = {}
    try:
        async with Controller.from_url(url, policy_interval_s=0.5, creds=role("controller")), \
                await NodeAgent.open(url, "bench-node", gpus=declared_gpus(2, 80 * 10**9), cpu_cache_bytes=10**10,
                          drain_timeout_s=0.05, heartbeat_s=1.0, creds=role("agent:bench-node")) as _agent, \
                await AdminClient.open(url, creds=role("admin")) as admin, Client(url, creds=role("client:bench")) as c:
            res = await admin.deploy(ckpt, 2)
            await admin.wait(res, timeout=120)
            actor0, actor1 = get_actor(mk, 0), get_actor(mk, 1)
            assert actor0 is not None and actor1 is not None, "both replicas have actors after admin.wait"
            actors = [actor0, actor1]
            # The dispatcher runs as deployed (`ndif dispatcher`, its own process), unless --in-process.
            def dispatcher_process(link: str) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    [sys.executable, "-m", "dataplane.ops.cli", "dispatcher", "--nats", url, "--ray-address",
                     ray_adapter.gcs_address()],
                    env={**os.environ, "NDIF_LOG_LEVEL": "WARNING", "NDIF_REPLICA_LINK": link,
                         **({"NDIF_CREDS": str(creds_file("dispatcher", home=tmp / "home"))} if auth else {})})

            async def warm() -> None:
                for _ in range(50):  # warm both paths (the first request also waits for the dispatcher)
                    await c.run(ckpt, NOOP, timeout=60)
                    await actors[0].__call__.remote(NOOP)

            async def single_from_child() -> tuple[list[float], list[float]]:
                """(a) with the SDK in a process of its own (a researcher's: no Ray driver in it)."""
                creds = str(creds_file("client", name="bench", home=tmp / "home")) if auth else ""
                child = await Child("client", __file__, ["--client", url, ckpt, creds]).start()
                try:
                    await child.ask({"op": "run", "n": 50})  # its warm-up: its connection, its first requests

                    async def child_block(k: int) -> list[float]:
                        return list((await child.ask({"op": "run", "n": k}))["ms"])

                    return await single(child_block, actors, a.single)
                finally:
                    await child.close()

            disp_proc = None if a.in_process else dispatcher_process("nats")
            inproc = await Dispatcher.from_url(url, creds=role("dispatcher")).start() if a.in_process else None
            try:
                await warm()
                # The SDK in a process of its own first (the figures), then inside this Ray driver (extras).
                raw, ours = await single_from_child()
                raw_d, ours_d = await single(lambda k: run_block(c, ckpt, k), actors, a.single)
                out["in_driver_raw_ray_p50_ms"], out["in_driver_ours_p50_ms"] = pct(raw_d, 50), pct(ours_d, 50)
                out["in_driver_p50_overhead_ms"] = pct(ours_d, 50) - pct(raw_d, 50)
                out["raw_ray_p50_ms"], out["raw_ray_p99_ms"] = pct(raw, 50), pct(raw, 99)
                out["ours_p50_ms"], out["ours_p99_ms"] = pct(ours, 50), pct(ours, 99)
                out["p50_overhead_ms"] = out["ours_p50_ms"] - out["raw_ray_p50_ms"]
                out["p99_overhead_ms"] = out["ours_p99_ms"] - out["raw_ray_p99_ms"]
                print(f"(a) 1 in flight: raw Ray p50 {out['raw_ray_p50_ms']:.2f} / p99 {out['raw_ray_p99_ms']:.2f} "
                      f"ms; ours p50 {out['ours_p50_ms']:.2f} / p99 {out['ours_p99_ms']:.2f} ms; added p50 "
                      f"{out['p50_overhead_ms']:.2f} ms, p99 {out['p99_overhead_ms']:.2f} ms; the SDK inside the Ray "
                      f"driver: added p50 {out['in_driver_p50_overhead_ms']:.2f} ms", flush=True)

                i = 0

                async def raw_call() -> None:
                    nonlocal i
                    i += 1
                    await actors[i % 2].__call__.remote(NOOP)

                # Paired rounds (ours, Serve, raw Ray back to back), medians: this VM's speed drifts
                # between runs by +-30%, a ratio within one round does not.
                serve = await asyncio.to_thread(ServeNoop().start)
                rounds: list[tuple[float, float, float]] = []
                try:
                    for r in range(a.rounds):
                        ours_r = await in_flight(lambda: c.run(ckpt, NOOP, timeout=120), a.requests)
                        serve_r = await asyncio.to_thread(serve.rps, a.requests)
                        raw_r = await in_flight(raw_call, a.requests)
                        rounds.append((ours_r, serve_r, raw_r))
                        print(f"(b) round {r + 1}, 16 in flight: ours {ours_r:.0f} req/s, Ray Serve {serve_r:.0f}, "
                              f"raw pipelined Ray {raw_r:.0f}; ours / Serve {ours_r / serve_r:.2f}", flush=True)
                finally:
                    await asyncio.to_thread(serve.stop)
                out["ours_rps"] = statistics.median(x[0] for x in rounds)
                out["ray_serve_rps"] = statistics.median(x[1] for x in rounds)
                out["raw_ray_rps"] = statistics.median(x[2] for x in rounds)
                out["throughput_ratio_vs_serve"] = statistics.median(x[0] / x[1] for x in rounds)
                print(f"(b) medians of {a.rounds} rounds: ours {out['ours_rps']:.0f} req/s, Ray Serve "
                      f"{out['ray_serve_rps']:.0f}, raw Ray {out['raw_ray_rps']:.0f}; ours / Serve "
                      f"{out['throughput_ratio_vs_serve']:.2f}", flush=True)
            finally:
                if disp_proc is not None:
                    disp_proc.terminate()
                    disp_proc.wait(30)
                if inproc is not None:
                    await inproc.stop()

            if not a.in_process:
                # (a) again with the replica calls made through Ray (NDIF_REPLICA_LINK=ray), for the record
                # of what the NATS endpoint saves (docs/architecture.md decision 33).
                disp_proc = dispatcher_process("ray")
                try:
                    await warm()
                    raw, ours = await single_from_child()  # as (a): compared with p50_overhead_ms
                finally:
                    disp_proc.terminate()
                    disp_proc.wait(30)
                out["ray_link_raw_ray_p50_ms"], out["ray_link_ours_p50_ms"] = pct(raw, 50), pct(ours, 50)
                out["ray_link_p50_overhead_ms"] = pct(ours, 50) - pct(raw, 50)
                print(f"(a') 1 in flight, replica calls through Ray: raw Ray p50 {pct(raw, 50):.2f} ms; ours p50 "
                      f"{pct(ours, 50):.2f} ms; added p50 {out['ray_link_p50_overhead_ms']:.2f} ms", flush=True)

            # (c) event -> lanes, seen inside a dispatcher: evict replica 1 to WARM and scale back.
            async with Dispatcher.from_url(url, creds=role("dispatcher")) as disp:
                await c.run(ckpt, NOOP, timeout=60)  # the processor exists once a request came
                proc = next(p for p in disp.processors.values() if p.model_key == mk)
                lags = []
                for _ in range(a.cycles):
                    await admin.evict(ckpt, replica_id=1)
                    async with asyncio.timeout(60):
                        while 1 in proc.lanes or (await admin.state()).replicas[(mk, 1)].state != ReplicaState.CACHED:
                            await asyncio.sleep(0.01)
                    seq0 = (await admin.state()).seq
                    await admin.scale(ckpt, 2)
                    async with asyncio.timeout(60):
                        while 1 not in proc.lanes:
                            await asyncio.sleep(0)
                    seen = time.time()
                    loaded = [e async for _, e in admin.events(start_seq=seq0 + 1)
                              if isinstance(e, E.ReplicaLoaded) and e.replica_id == 1]
                    lags.append((seen - loaded[0].ts.timestamp()) * 1000)
            out["event_to_worker_p50_ms"], out["event_to_worker_p99_ms"] = pct(lags, 50), pct(lags, 99)
            print(f"(c) ReplicaLoaded -> lanes: p50 {out['event_to_worker_p50_ms']:.2f} ms, p99 "
                  f"{out['event_to_worker_p99_ms']:.2f} ms ({a.cycles} cycles)", flush=True)
    finally:
        ray_adapter.shutdown()
        srv.close()
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        asyncio.run(client_main(*sys.argv[2:5]))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--single", type=int, default=400)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5, help="paired throughput rounds (median reported)")
    p.add_argument("--in-process", action="store_true",
                   help="run the dispatcher in the benchmark's process (default: its own, as deployed)")
    p.add_argument("--auth", action="store_true",
                   help="users and accounts as `ndif up` configures them, each part connected as its role")
    add_sync_option(p)
    args = p.parse_args()
    res: dict[str, float] = {}
    for sync in SYNC_CHOICES[args.sync]:
        res |= {k + sync_suffix(sync): v for k, v in asyncio.run(main(args, sync)).items()}
    keys = ["ours_rps", "ray_serve_rps", "raw_ray_rps", "throughput_ratio_vs_serve", "p50_overhead_ms",
            "p99_overhead_ms", "event_to_worker_p99_ms"]
    keys = [k for k in keys if k in res]
    print(json.dumps({k: round(res[k], 3) for k in [*keys, *sorted(set(res) - set(keys))]}))
