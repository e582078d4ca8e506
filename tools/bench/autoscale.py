"""Benchmark of the autoscaler's reaction on a real nats-server with a real controller (in this process).

A model deployed at 1 replica with a policy (`--upscale-delay`, default 0: the mechanism alone);
queue figures published on its real subject (`ndif.figures.<mtok>`) every 0.2 s, as a dispatcher
publishes them. `--trials` times: figures below target, then the first figure above it published
-> the scale-up's AutoscaleDecided seen on the event subjects (a core subscription to
`ndif.evt.>`): `reaction_s` (median) and `reaction_max_s`; then back below, and the scale-down is
waited for. Then a steady load for `--steady` seconds at exactly the target per replica:
`flaps` counts the decisions that changed the count during it (0 expected). There are no agents:
replicas stay scheduled, which is all a decision needs.

`from_zero_first_result_s` and `lost` need Ray, the dispatcher and a replica answering; this bench
does not run them and prints them as null.

    python tools/bench/autoscale.py [--trials 10] [--steady 20] [--upscale-delay 0]
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
from nats.aio.client import Client as NatsClient  # noqa: E402
from nats.aio.msg import Msg  # noqa: E402

from controlplane.ops.nats_server import EmbeddedNats  # noqa: E402
from controlplane.service.controller import Controller  # noqa: E402
from controlplane.store.admin import AdminClient  # noqa: E402
from controlplane.store.eventstore import JetStreamEventLog  # noqa: E402
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
            "upscale_delay_s": a.upscale_delay, "trials": a.trials, "flaps": flaps, "steady_s": a.steady,
            "from_zero_first_result_s": None, "lost": None}


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
            return await bench(srv.url, str(ckpt), a)
        finally:
            srv.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady load for the flap count")
    p.add_argument("--upscale-delay", type=float, default=0.0, help="the policy's upscale delay (s)")
    a = p.parse_args()
    print(json.dumps(asyncio.run(amain(a))))


if __name__ == "__main__":
    main()
