"""Autoscaling on a real stack: nats-server, controller, node agent on a local Ray, dispatcher, a tiny
GPT-2, requests through the SDK. A burst scales up and its end down, idle goes to zero and the next
request comes back from zero, with every request answered; a controller SIGKILLed during a ramp
loses, doubles and reverses no decision, and an operator's count then stands; `ndif history` says
why each count changed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.ops.nats_server import EmbeddedNats, stop_process
from controlplane.store.admin import AdminClient
from dataplane.client import Client
from dataplane.client.sdk import RequestFailed
from dataplane.node.agent import NodeAgent, declared_gpus
from schemas import events as E
from schemas.errors import InfrastructureError
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState
from tests.conftest import bounded, fresh_event_log
from tests.dataplane.conftest import kill_all_actors, running_service
from tests.integration.cluster import Publisher, ndif
from tests.waiting import until_state

pytestmark = pytest.mark.timeout(180)
GB = 10**9


def scaled(events: list[E.Event]) -> list[tuple[int, int, str]]:
    return [(e.current, e.target, e.rule) for e in events if isinstance(e, E.AutoscaleDecided) and e.target != e.current]


async def autoscale_events(admin: AdminClient, mk: str) -> list[E.Event]:
    return [e async for _, e in admin.events(model=mk) if isinstance(e, E.AutoscaleDecided)]


async def test_a_burst_scales_up_its_end_down_idle_to_zero_and_back_from_zero_nothing_lost(
        nats_server: EmbeddedNats, local_ray: str, models: dict[str, Path]) -> None:
    async with running_service(nats_server.url, local_ray, drain_timeout_s=5) as parts:
        url, admin = parts["url"], parts["admin"]
        ckpt = str(models["gpt2"])
        mk = canonical_model_key(ckpt)
        res = await admin.deploy(ckpt, 1)
        await admin.wait(res, timeout=120)
        ran = await ndif(url, "autoscale", ckpt, "--min", "0", "--max", "2", "--target-queue-per-replica", "1",
                         "--upscale-delay", "0s", "--downscale-delay", "1s", "--idle-after", "4s")
        assert ran.rc == 0, ran.err
        async with Client(url) as c:

            async def answered(n: int, tokens: int) -> list[bool]:
                async def one(i: int) -> bool:
                    try:
                        out = await c.run(ckpt, {"op": "generate", "input_ids": [[1 + i % 50, 2, 3]],
                                                 "max_new_tokens": tokens}, timeout=120)
                    except RequestFailed:
                        return False
                    return isinstance(out, dict) and len(out["output_ids"][0]) > 3

                return list(await asyncio.gather(*(one(i) for i in range(n))))

            # A burst: far more queued than one replica's target -> 2 replicas while it lasts.
            burst = asyncio.create_task(answered(40, 32))
            await until_state(admin, lambda s: s.replica_count(mk) == 2, 30)
            assert all(await burst)  # 0 lost, 0 errors
            # Its end: idle -> 1 after the downscale delay, -> 0 (WARM) after the idle delay.
            st = await until_state(admin, lambda s: s.replica_count(mk) == 0
                                   and not any(r.on_gpu for r in s.model_replicas(mk)), 60)
            assert any(r.state is ReplicaState.CACHED for r in st.model_replicas(mk))
            # From zero: the next request brings one replica back and is answered.
            t0 = time.monotonic()
            assert await answered(1, 4) == [True]
            from_zero_s = time.monotonic() - t0
        steps = scaled(await autoscale_events(admin, mk))
        assert steps[:3] == [(1, 2, "queue-above-target"), (2, 1, "queue-below-target"), (1, 0, "idle")], steps
        # Back from zero once, by whichever asks first: the dispatcher's provisioning deploy (on the
        # request's arrival) or the autoscaler's from-zero rule (on the figures); never both.
        back = [e for _, e in [p async for p in admin.events(model=mk)]
                if isinstance(e, E.DeploymentRequested) and e.actor.startswith("dispatcher:")]
        rest = steps[3:-1] if steps[-1] == (1, 0, "idle") and len(steps) > 3 else steps[3:]  # idle again since
        assert len(rest) + len(back) == 1 and rest in ([], [(0, 1, "from-zero")]), (steps, back)
        st = await admin.state()
        assert st.anomaly_count == 0, st.anomalies
        ran = await ndif(url, "history", ckpt)
        assert ran.rc == 0 and "scaled 1 -> 2: " in ran.out, ran.out
        assert "scaled 2 -> 1 (queue-below-target, to WARM): 0 queued, 2 replicas" in ran.out, ran.out
        assert "scaled 1 -> 0 (idle, to WARM): 0 queued, 1 replicas, target 1 per replica, idle for" in ran.out
        print(f"from zero: first result in {from_zero_s:.2f} s; steps {steps}")


def controller_process(url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "dataplane.ops.cli", "controller", "--nats", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_a_controller_sigkilled_during_a_ramp_loses_doubles_and_reverses_no_decision(
        nats_server: EmbeddedNats, local_ray: str, models: dict[str, Path]) -> None:
    url = nats_server.url
    kill_all_actors()
    lg = await fresh_event_log(url)
    procs: list[subprocess.Popen[bytes]] = [controller_process(url)]  # its fact gate admits the agent's join
    agent = await (await NodeAgent.open(url, "node-a", gpus=declared_gpus(4, 80 * GB), cpu_cache_bytes=10 * GB,
                                        heartbeat_s=0.5, health_interval_s=0.5)).start()
    admin = await AdminClient.open(url, timeout=30)
    ckpt = str(models["gpt2"])
    mk = canonical_model_key(ckpt)
    figures = contextlib.ExitStack()
    pub = figures.enter_context(Publisher(admin, mk))  # a dispatcher's figures, by hand: the load is set
    try:
        async with asyncio.timeout(60):  # the controller process is up once it answers a command
            while True:
                with contextlib.suppress(InfrastructureError):
                    res = await admin.deploy(ckpt, 1)
                    break
                await asyncio.sleep(0.2)
        await admin.wait(res, timeout=120)
        ran = await ndif(url, "autoscale", ckpt, "--min", "1", "--max", "4", "--target-queue-per-replica", "4",
                         "--upscale-delay", "0.5s", "--downscale-delay", "1h", "--idle-after", "1h")
        assert ran.rc == 0, ran.err

        def kill_and_restart() -> None:
            procs[-1].send_signal(signal.SIGKILL)
            procs[-1].wait(10)
            procs.append(controller_process(url))

        # Step 1: the load rises, and the controller dies before or while it decides.
        pub.load = (7, 2)  # 9 for 1 replica at 4 each -> 3
        await asyncio.sleep(0.3)
        kill_and_restart()
        await until_state(admin, lambda s: s.replica_count(mk) == 3, 60)
        # Step 2: right after a decision is appended, while its replicas load.
        pub.load = (14, 2)  # 16 -> 4
        await until_state(admin, lambda s: s.replica_count(mk) == 4, 60)
        kill_and_restart()
        await asyncio.sleep(3.0)  # the new controller's ticks on the same load: nothing more to do
        st = await until_state(admin, lambda s: sum(r.state is ReplicaState.AVAILABLE
                                                    for r in s.model_replicas(mk)) == 4, 60)
        steps = scaled(await autoscale_events(admin, mk))
        assert steps == [(1, 3, "queue-above-target"), (3, 4, "queue-above-target")], steps
        assert st.replica_count(mk) == 4 and st.anomaly_count == 0, st.anomalies
        ran = await ndif(url, "history", ckpt)
        assert ran.rc == 0 and "scaled 1 -> 3: 7 queued, 2 running, 1 replicas, target 4 per replica, above for" \
            in ran.out, ran.out
        # An operator's count stands against the load (and against the restarted controller).
        ran = await ndif(url, "scale-down", ckpt, "--replicas", "2")
        assert ran.rc == 0, ran.err
        await until_state(admin, lambda s: s.replica_count(mk) == 2, 30)
        await asyncio.sleep(2.0)  # several ticks, the load still asking for 4
        st = await admin.state()
        assert st.replica_count(mk) == 2 and st.models[mk].autoscale_manual
        assert scaled(await autoscale_events(admin, mk)) == steps
    finally:
        figures.close()
        for p in procs:
            with contextlib.suppress(Exception):
                stop_process(p, signal.SIGTERM, 10)
        await bounded(admin.close(), "admin.close")
        await bounded(agent.stop(), "agent.stop")
        await bounded(lg.close(), "log.close")
        kill_all_actors()


