"""Benchmark of the autoscaler's reaction on a real nats-server with a real controller (in this process).

A model deployed at 1 replica with a policy (`--upscale-delay`, default 0: the mechanism alone);
queue figures published on its real subject (`ndif.figures.<mtok>`) every 0.2 s, as a dispatcher
publishes them. `--trials` times: figures below target, then the first figure above it published
-> the scale-up's AutoscaleDecided seen on the event subjects (a core subscription to
`ndif.evt.>`): `reaction_s` (median) and `reaction_max_s`; then back below, and the scale-down is
waited for. Then a steady load for `--steady` seconds at exactly the target per replica:
`flaps` counts the decisions that changed the count during it (0 expected). There are no agents:
replicas stay scheduled, which is all a decision needs.

Then from zero, on a real stack of its own (another nats-server; a controller, a node agent on a
local Ray with 1 declared GPU, a dispatcher, all in this process; a tiny GPT-2 from
dataplane/node/tiny_models.py): the model deployed at 1 replica gets a policy of min 0, max 2,
idle after `--idle-after` s to `--idle-to` (WARM: a copy in the node's CPU memory), serves one request (the dispatcher publishes figures of the
models it serves) and is waited down to zero; then `--zero-trials` times one
request is submitted and waited for: `from_zero_first_result_s` (median; `..._max_s`) is submit ->
its result, and before each trial the model is at zero again. Last, at zero, `--burst` requests
submitted at once. `lost` counts the requests of this phase without their right result (an error
or none at all: `errors` counts the errors among them).

    python tools/bench/autoscale.py [--trials 10] [--steady 20] [--upscale-delay 0] [--zero-trials 3]
                                    [--burst 50] [--idle-after 2] [--idle-to WARM|COLD]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controlplane.service.logs import configure

configure("ERROR")

import msgspec  # noqa: E402
import nats  # noqa: E402
from benchkit import tiny_model_stack  # noqa: E402
from nats.aio.client import Client as NatsClient  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402

from controlplane.ops.nats_server import EmbeddedNats  # noqa: E402
from controlplane.service.controller import Controller  # noqa: E402
from controlplane.store.admin import AdminClient  # noqa: E402
from controlplane.store.eventstore import JetStreamEventLog  # noqa: E402
from dataplane.client import Client  # noqa: E402
from dataplane.client.sdk import RequestFailed  # noqa: E402
from dataplane.node.agent import NodeAgent, declared_gpus  # noqa: E402
from dataplane.runtime import ray_adapter  # noqa: E402
from dataplane.serving.dispatcher import Dispatcher  # noqa: E402
from schemas import events as E  # noqa: E402
from schemas.autoscale import AutoscalePolicy, QueueFigures  # noqa: E402
from schemas.keys import canonical_model_key  # noqa: E402
from schemas.status import Level  # noqa: E402
from schemas.subjects import EVENTS_ALL, figures_subject  # noqa: E402

GB = 10**9


class Figures:
    """A dispatcher's figures for one model, `load` = (queued, running), published every 0.2 s;
    `changed` is when the load last changed (perf_counter), taken as it is published."""

    def __init__(self, nc: NatsClient, model_key: str) -> None:
        self.nc, self.model_key = nc, model_key
        self.load = (0, 0)
        self.changed = 0.0
        self._wake = asyncio.Event()

    def set(self, queued: int, running: int) -> None:
        self.load = (queued, running)
        self._wake.set()  # published now, not at the next 0.2 s

    async def run(self) -> None:
        while True:
            q, r = self.load
            f = QueueFigures(model_key=self.model_key, queued=q, running=r, dispatcher="dispatcher:bench",
                             ts=datetime.now(UTC))
            if self._wake.is_set():
                self.changed = time.perf_counter()
            self._wake.clear()
            await self.nc.publish(figures_subject(self.model_key), msgspec.json.encode(f))
            await self.nc.flush()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.2)
            except TimeoutError:
                pass


async def bench(url: str, ckpt: str, a: argparse.Namespace) -> dict[str, object]:
    log = await JetStreamEventLog.open(url)
    for i in range(2):
        await log.append([E.NodeJoined(event_id=f"bench-node-{i}", ts=datetime.now(UTC), actor="bench",
                                       node_id=f"node-{i}", cpu_cache_bytes=500 * GB,
                                       gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB) for g in range(8)))], None)
    await log.close()
    ctl = Controller.from_url(url, heartbeat_grace_s=3600)  # the product's tick (autoscale_interval_s 0.5)
    await ctl.start()
    nc = await nats.connect(url)
    decided: list[tuple[float, E.AutoscaleDecided]] = []

    async def on_event(msg: Msg) -> None:
        ev = E.decode_or_skip(msg.data)
        if isinstance(ev, E.AutoscaleDecided):
            decided.append((time.perf_counter(), ev))

    await nc.subscribe(EVENTS_ALL, cb=on_event)
    try:
        async with await AdminClient.open(url, timeout=30) as admin:
            res = await admin.deploy(ckpt, 1, size_bytes=5 * GB)
            mk = canonical_model_key(ckpt)
            assert res.ok, res.message
            policy = AutoscalePolicy(min_replicas=1, max_replicas=4, target_queue_per_replica=4,
                                     upscale_delay_s=a.upscale_delay, downscale_delay_s=1.0, idle_to=Level.WARM,
                                     idle_after_s=3600, max_wait_s=None)
            await admin.autoscale(ckpt, policy)
            pub = Figures(nc, mk)
            task = asyncio.create_task(pub.run())

            async def scaled(after: int, up: bool, timeout: float = 30.0) -> float:
                """Wait for a decision changing the count (up or down) after `after` decisions seen."""
                end = time.perf_counter() + timeout
                while time.perf_counter() < end:
                    for t, ev in decided[after:]:
                        if (ev.target > ev.current) if up else (ev.target < ev.current):
                            return t
                    await asyncio.sleep(0.002)
                raise TimeoutError("no decision")

            reactions = []
            try:
                pub.set(2, 1)  # 3 for 1 replica at 4 each: below target
                await asyncio.sleep(1.5)
                for i in range(a.trials):
                    n = len(decided)
                    pub.set(7, 2)  # 9 for 1 replica: above target -> 3 replicas
                    await asyncio.sleep(0)
                    t_up = await scaled(n, up=True)
                    reactions.append(t_up - pub.changed)
                    print(f"trial {i + 1}: figure above target -> scale-up appended in {reactions[-1] * 1000:.0f} ms",
                          flush=True)
                    n = len(decided)
                    pub.set(2, 1)
                    await scaled(n, up=False)
                    await asyncio.sleep(1.2)  # the downscale delay counts from the last change too
                # Steady: 8 for 2 replicas, exactly the target.
                n = len(decided)
                pub.set(6, 2)
                await scaled(n, up=True)
                await asyncio.sleep(2.0)
                n = len(decided)
                await asyncio.sleep(a.steady)
                steady = [ev for _, ev in decided[n:]]
                flaps = sum(1 for ev in steady if ev.target != ev.current)
                st = await admin.state()
                print(f"steady {a.steady:g} s at the target: {flaps} count changes, {len(steady)} decisions; "
                      f"{st.replica_count(mk)} replicas", flush=True)
            finally:
                task.cancel()
    finally:
        await nc.close()
        await ctl.stop()
    return {"reaction_s": round(statistics.median(reactions), 3), "reaction_max_s": round(max(reactions), 3),
            "upscale_delay_s": a.upscale_delay, "trials": a.trials, "flaps": flaps, "steady_s": a.steady}


async def at_zero(admin: AdminClient, mk: str, timeout: float = 60.0) -> tuple[float, int]:
    """Wait until the model has no replica wanted HOT and none holding a GPU: (seconds waited,
    the log's last seq then)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        st = await admin.state()
        if st.replica_count(mk) == 0 and not any(r.on_gpu for r in st.model_replicas(mk)):
            return time.perf_counter() - t0, st.seq
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{mk} not at zero after {timeout:g} s")


async def brought_back(admin: AdminClient, mk: str, after: int) -> str:
    """What brought the model back from zero after seq `after`: the autoscaler's from-zero rule
    or the dispatcher's provisioning deploy (whichever asked first), and the load it took."""
    how, took = [], []
    async for _, e in admin.events(model=mk, start_seq=after + 1):
        if isinstance(e, E.AutoscaleDecided) and e.rule == "from-zero":
            how.append("autoscaler from-zero")
        elif isinstance(e, E.DeploymentRequested) and e.actor.startswith("dispatcher:"):
            how.append("dispatcher provisioning")
        elif isinstance(e, E.ReplicaLoaded):
            took.append(f"{e.load_seconds:.2f} s load")
    return ", ".join(how + took) or "nothing"


async def from_zero(tmp: Path, a: argparse.Namespace) -> dict[str, object]:
    """The real stack's from-zero figures (see the module's docstring)."""
    srv, url, ckpt, mk = await tiny_model_stack(tmp, "nats-zero", 1, 2)
    firsts: list[float] = []
    asked = ok = errors = 0
    try:
        log = await JetStreamEventLog.open(url)
        await log.close()
        async with Controller.from_url(url, policy_interval_s=0.5) as _ctl, \
                await NodeAgent.open(url, "bench-node", gpus=declared_gpus(1, 80 * GB), cpu_cache_bytes=10 * GB,
                                     drain_timeout_s=5.0, heartbeat_s=0.5) as _agent, \
                Dispatcher.from_url(url) as _disp, await AdminClient.open(url, timeout=30) as admin, Client(url) as c:
            res = await admin.deploy(ckpt, 1)
            await admin.wait(res, timeout=120)
            await admin.autoscale(ckpt, AutoscalePolicy(
                min_replicas=0, max_replicas=2, target_queue_per_replica=4, upscale_delay_s=0, downscale_delay_s=1,
                idle_to=Level(a.idle_to), idle_after_s=a.idle_after, max_wait_s=None))

            async def one(i: int) -> tuple[bool, bool]:
                """(the right result, an error)."""
                try:
                    out = await c.run(ckpt, {"op": "echo", "data": i}, timeout=120)
                except RequestFailed:
                    return False, True
                except TimeoutError:
                    return False, False
                return isinstance(out, dict) and out.get("echo") == i, False

            # The dispatcher publishes a model's figures once it has served it (no figures: no
            # decision), so one request first; then the model idles down to zero.
            right, err = await one(-1)
            asked, ok, errors = asked + 1, ok + right, errors + err
            for trial in range(a.zero_trials):
                waited, seq = await at_zero(admin, mk)
                t0 = time.perf_counter()
                right, err = await one(trial)
                firsts.append(time.perf_counter() - t0)
                asked, ok, errors = asked + 1, ok + right, errors + err
                print(f"from zero {trial + 1}: at zero after {waited:.1f} s; first result in {firsts[-1]:.2f} s "
                      f"({'right' if right else 'WRONG'}; back by {await brought_back(admin, mk, seq)})", flush=True)
            _, seq = await at_zero(admin, mk)
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(1000 + i) for i in range(a.burst)))
            asked += a.burst
            ok += sum(r for r, _ in done)
            errors += sum(e for _, e in done)
            st = await admin.state()
            print(f"burst of {a.burst} at zero: {sum(r for r, _ in done)} right in {time.perf_counter() - t0:.2f} s; "
                  f"back by {await brought_back(admin, mk, seq)}; {st.replica_count(mk)} replicas; "
                  f"anomalies {st.anomaly_count}", flush=True)
    finally:
        ray_adapter.shutdown()
        srv.close()
    return {"from_zero_first_result_s": round(statistics.median(firsts), 3) if firsts else None,
            "from_zero_first_result_max_s": round(max(firsts), 3) if firsts else None,
            "lost": asked - ok, "errors": errors, "requests": asked, "zero_trials": len(firsts), "idle_to": a.idle_to}


async def amain(a: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt" / "m0"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text('{"model_type": "gpt2"}')
        srv = EmbeddedNats(Path(tmp) / "nats")
        srv.start()
        try:
            lg = await JetStreamEventLog.open(srv.url)
            await lg.close()
            out = await bench(srv.url, str(ckpt), a)
        finally:
            srv.close()
        return {**out, **await from_zero(Path(tmp), a)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady load for the flap count")
    p.add_argument("--upscale-delay", type=float, default=0.0, help="the policy's upscale delay (s)")
    p.add_argument("--zero-trials", type=int, default=3, help="single requests, each to the model at zero")
    p.add_argument("--burst", type=int, default=50, help="requests submitted at once to the model at zero")
    p.add_argument("--idle-after", type=float, default=2.0, help="the from-zero policy's idle_after_s")
    p.add_argument("--idle-to", choices=["WARM", "COLD"], default="WARM", help="the from-zero policy's idle_to")
    a = p.parse_args()
    print(json.dumps(asyncio.run(amain(a))))


if __name__ == "__main__":
    main()
