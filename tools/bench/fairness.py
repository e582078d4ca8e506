"""Benchmark of fair serving: a light user's wait under a heavy user's flood, idle replicas while
requests wait, and the throughput of fair dispatch against FIFO on the same load.

One machine: nats-server, local Ray, the controller, a node agent (2 declared cards), 2 replicas of
a tiny gpt2 (real ModelActors running `forward`), and two dispatchers sharing the model's durable
consumers (each with its lanes on both replicas, as two dispatcher hosts would). Each dispatcher
runs in a process of its own, as `ndif dispatcher` does, and samples its model's processor for this
one (`--dispatcher`); each user's client runs in a process of its own (`--client`, as a
researcher's does: the light user's timing never waits on another's event loop, nor on the flood's
statuses), publishing as the SDK publishes, on the user's own subject.

 (idle) the light user alone: `--light` requests, one published every `--gap-ms` (whatever became
        of the earlier ones), each timed from its publish to its terminal status;
 (flood) rounds, fair and FIFO dispatchers alternately (`NDIF_FAIRNESS` `order`, the same policy
        otherwise): the heavy user stores `--heavy` requests (200 publishes at a time), then the
        light user runs the idle phase's pattern while the flood is served; each round's throughput
        is all its requests (the same work under either order) over the time from the first publish
        to the last terminal status.
 Meanwhile each dispatcher samples its processor every `--sample-ms`; from the two timelines this
 process adds up replica-seconds a ready replica had no call outstanding from either dispatcher
 while the model had requests waiting: queued at a dispatcher, or handed to another replica behind
 the one it runs.

The last line printed is one JSON object:
  light_user_wait_p99_s       the light user's wait p99 under the flood (every fair round's waits)
  idle_light_user_wait_p99_s  the same figure on the idle cluster
  light_wait_ratio            their ratio (target <= 2)
  idle_replica_s_with_queue   replica-seconds idle while requests of the model waited (fair rounds, summed)
  fair_throughput_ratio       median over paired rounds of fair req/s over FIFO req/s (target >= 0.95)
  nats_rtt_p99_ratio          a baseline with none of our queues, measured during the light user's
                              requests (the first half of them): NATS round trips from a client process
                              of its own, p99 under the flood (fair rounds) over idle
  ray_call_p99_ratio          the same for raw calls of an idle no-op Ray actor, from that process, during
                              the second half (what the flood's load on the machine alone does to a call)
and, for the record, the FIFO rounds' light wait and idle figures, the req/s medians and the flood's
backlog when the light user finished.

    python tools/bench/fairness.py [--heavy 1500] [--light 30] [--rounds 4] [--gap-ms 50] [--sample-ms 5]
                                   [--new-tokens 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from controlplane.service.logs import configure

configure("ERROR")
logging.getLogger("ray").setLevel(logging.ERROR)

from benchkit import Child, answer, commands, pct, tiny_model_stack  # noqa: E402

from controlplane.core.fairness import FairnessPolicy  # noqa: E402
from controlplane.service.controller import Controller  # noqa: E402
from controlplane.store.admin import AdminClient  # noqa: E402
from controlplane.store.eventstore import JetStreamEventLog  # noqa: E402
from dataplane.node.agent import NodeAgent, declared_gpus  # noqa: E402
from dataplane.runtime import ray_adapter  # noqa: E402
from dataplane.serving.dispatcher import Dispatcher  # noqa: E402
from dataplane.serving.processor import idle_with_queue  # noqa: E402
from schemas.requests import Request, encoder, status_decoder  # noqa: E402
from schemas.status import RequestStatus  # noqa: E402
from schemas.subjects import model_token, request_subject, user_statuses  # noqa: E402

REPLICAS = 2
DISPATCHERS = ("bench-dispatcher-a", "bench-dispatcher-b")


class Load:
    """Publishes requests as the SDK does (its dedup id shape) and times each to its terminal status."""

    def __init__(self, log: JetStreamEventLog, mk: str, new_tokens: int = 0,
                 users: tuple[str, ...] = ("light", "heavy", "warm")) -> None:
        self.log = log
        self.users = users
        self.mk = mk
        self.new_tokens = new_tokens  # 0: every request a forward pass; N: a generation of N tokens
        self.sent: dict[str, float] = {}  # request id -> monotonic publish time
        self.ended: dict[str, float] = {}  # request id -> monotonic time its terminal status arrived
        self.failed: dict[str, str] = {}  # request id -> its error, for a request that did not complete
        self.waiters: dict[str, asyncio.Event] = {}

    async def listen(self) -> list[Any]:
        """One subscription per user: the light user's statuses never queue behind the flood's in
        this client (nats-py hands each subscription its messages in order, from its own queue)."""

        async def on_status(msg: Any) -> None:
            s = status_decoder.decode(msg.data)
            if s.terminal and s.request_id in self.sent and s.request_id not in self.ended:
                self.ended[s.request_id] = time.monotonic()
                if s.status is not RequestStatus.COMPLETED:
                    self.failed[s.request_id] = f"{s.error}: {s.message}"
                ev = self.waiters.pop(s.request_id, None)
                if ev is not None:
                    ev.set()

        return [await self.log.nc.subscribe(user_statuses(user), cb=on_status) for user in self.users]

    async def submit(self, user: str, i: int) -> str:
        rid = f"{user}-{i}-{uuid.uuid4().hex[:10]}"
        payload: dict[str, Any] = {"op": "forward", "input_ids": [[1 + i % 50, 2, 3]]}
        if self.new_tokens:
            payload.update(op="generate", max_new_tokens=self.new_tokens)
        req = Request(request_id=rid, model_key=self.mk, submitted_at=datetime.now(UTC), user=user, payload=payload)
        self.sent[rid] = time.monotonic()
        await self.log.js.publish(request_subject(self.mk, user), encoder.encode(req),
                                  headers={"Nats-Msg-Id": f"{user}.bench.{rid}"})
        return rid

    async def one(self, user: str, i: int, timeout: float = 120) -> float:
        """Publish one request and wait for its end: its wait in seconds (publish -> terminal status)."""
        rid = await self.submit(user, i)
        if rid not in self.ended:  # (its status may have come before the publish's ack)
            ev = self.waiters[rid] = asyncio.Event()
            await asyncio.wait_for(ev.wait(), timeout)
        return self.ended[rid] - self.sent[rid]

    async def light_user(self, n: int, gap_s: float, start: int = 0) -> list[float]:
        """`n` requests, one published every `gap_s` whatever the earlier ones' fate (so the work of a
        round is the same under fair and FIFO dispatch); each one's wait."""
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(self.one(self.users[0], start + i)))
            await asyncio.sleep(gap_s)
        return list(await asyncio.gather(*tasks))

    async def flood(self, n: int, start: int = 0) -> list[str]:
        rids: list[str] = []
        for at in range(start, start + n, 200):
            rids += await asyncio.gather(*(self.submit(self.users[0], i) for i in range(at, min(start + n, at + 200))))
        return rids

    async def until_ended(self, rids: list[str], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while any(r not in self.ended for r in rids):
                await asyncio.sleep(0.05)


def client_process(url: str, mk: str, user: str, new_tokens: int) -> Child:
    """One user's client in a process of its own."""
    return Child(f"{user} client", __file__, ["--client", url, mk, user, str(new_tokens)])


async def nats_probe(log: JetStreamEventLog, n: int, gap_s: float) -> list[float]:
    """A baseline without any of our queues: `n` round trips to the NATS server itself (JetStream's
    account info), one every `gap_s`; each one's time."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        await log.nc.request("$JS.API.INFO", b"", timeout=10)
        out.append(time.monotonic() - t)
        await asyncio.sleep(gap_s)
    return out


async def ray_probe(actor: Any, n: int, gap_s: float) -> list[float]:
    """The other baseline: `n` raw calls of a no-op Ray actor (one of its own, never busy) from the
    calling process, one every `gap_s`; each one's time."""
    out = []
    for _ in range(n):
        t = time.monotonic()
        await actor.ping.remote()
        out.append(time.monotonic() - t)
        await asyncio.sleep(gap_s)
    return out


async def client_main(url: str, mk: str, user: str, new_tokens: int) -> None:
    """The `--client` process: one user's Load, driven by JSON lines on stdin."""
    log = await JetStreamEventLog.open(url)
    load = Load(log, mk, new_tokens, users=(user,))
    subs = await load.listen()
    flood: list[str] = []
    sent = 0
    actor: Any = None
    try:
        async for cmd in commands():
            out: dict[str, Any] = {}
            if cmd["op"] == "light":
                out["waits"] = await load.light_user(cmd["n"], cmd["gap_s"], start=sent)
                sent += cmd["n"]
            elif cmd["op"] == "flood":
                out["t0"] = time.monotonic()
                flood = await load.flood(cmd["n"], start=sent)
                sent += cmd["n"]
            elif cmd["op"] == "probe":
                if actor is None:  # this process joins the benchmark's Ray, and calls its probe actor
                    ray_adapter.join(cmd["ray"])
                    actor = ray_adapter.named_actor("bench-probe")
                    await actor.ping.remote()  # the first call sets up this process's connection: not timed
                out["nats"] = await nats_probe(log, cmd["n"], cmd["gap_s"])
                out["ray"] = await ray_probe(actor, cmd["n"], cmd["gap_s"])
            elif cmd["op"] == "left_at":
                out["left"] = sum(load.ended.get(r, float("inf")) > cmd["t"] for r in flood)
            elif cmd["op"] == "until_ended":
                await load.until_ended(flood, timeout=cmd["timeout_s"])
                out["t_last"] = max((load.ended[r] for r in flood), default=time.monotonic())
            out["failed"] = list(load.failed.values())[:3]
            answer(out)
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await log.close()


class Probe:
    """A no-op Ray actor of the benchmark's own: the raw-call baseline."""

    def ping(self) -> int:
        return 0


async def dispatcher_main(url: str, name: str, order: str, token: str, gcs: str, sample_ms: float) -> None:
    """The `--dispatcher` process: one dispatcher as `ndif dispatcher` runs it (its own process, joined
    to the benchmark's Ray), which samples its model's processor every `sample_ms` for the parent:
    (time, ready replicas, calls outstanding per replica, queued, requests taken from the stream)."""
    ray_adapter.join(gcs)
    d = await Dispatcher.from_url(url, name=name, fairness=FairnessPolicy(order="fifo" if order == "fifo" else "fair")).start()
    samples: list[list[Any]] = []

    async def sample() -> None:
        while True:
            p = d.processors.get(token)
            if p is not None:
                samples.append([time.monotonic(), sorted(p.ready), {str(r): len(c) for r, c in p.in_flight.items()},
                                len(p.queue), len(p.queue) + p.running() + p.completed + p.errors])
            await asyncio.sleep(sample_ms / 1000)

    sampling = asyncio.create_task(sample())
    try:
        async for cmd in commands():
            out: dict[str, Any] = {}
            if cmd["op"] == "ready":
                p = d.processors.get(token)
                out["ready"] = p is not None and len(p.ready) == REPLICAS
            elif cmd["op"] == "mark":
                samples.clear()
                p = d.processors.get(token)
                out["held"] = 0 if p is None else len(p.queue) + p.running() + p.completed + p.errors
            elif cmd["op"] == "samples":
                out["samples"] = samples[:]
            answer(out)
    finally:
        sampling.cancel()
        await d.stop()
        ray_adapter.shutdown()


def idle_and_intake(timelines: list[list[list[Any]]], base: int, n: int) -> tuple[float, float | None]:
    """From each dispatcher's samples: replica-seconds a ready replica had no call outstanding from
    any dispatcher while requests of the model waited (queued at a dispatcher, or handed to another
    replica behind the one it runs: `idle_with_queue` over the dispatchers' latest samples at each
    instant; a dispatcher whose loop stalls keeps its last sample meanwhile), and when the
    dispatchers together had taken `n` more requests from the stream than `base` (what they held
    when marked), the flood's, give or take the light user's few taken meanwhile: what a request
    stored right behind the flood waited for before partitions."""
    merged = sorted((s[0], i, s) for i, line in enumerate(timelines) for s in line)
    cur: list[list[Any] | None] = [None] * len(timelines)
    idle_s, last_t, last_idle, intake_t = 0.0, None, 0, None
    for t, i, s in merged:
        if last_t is not None:
            idle_s += last_idle * (t - last_t)
        cur[i], last_t = s, t
        if any(c is None for c in cur):
            continue
        now = [c for c in cur if c is not None]
        ready = {r for c in now for r in c[1]}
        last_idle = idle_with_queue({r: sum(c[2].get(str(r), 0) for c in now) for r in ready}, any(c[3] for c in now))
        held = sum(c[4] for c in now)
        if intake_t is None and held >= base + n:
            intake_t = t
    return idle_s, intake_t


def dispatcher_process(url: str, name: str, order: str, token: str, sample_ms: float) -> Child:
    return Child(name, __file__, ["--dispatcher", url, name, order, token, ray_adapter.gcs_address(), str(sample_ms)])


async def start_dispatchers(url: str, order: str, load: Load, token: str, sample_ms: float) -> list[Child]:
    """Two dispatchers with dispatch `order`, each in its own process with lanes on both replicas
    (warmed with a few requests)."""
    ds = [await dispatcher_process(url, name, order, token, sample_ms).start() for name in DISPATCHERS]
    async with asyncio.timeout(60):
        i = 0
        while True:
            await asyncio.gather(*(load.one("warm", i + k) for k in range(8)))
            i += 8
            if all([(await d.ask({"op": "ready"}))["ready"] for d in ds]):
                return ds


async def stop_dispatchers(ds: list[Child]) -> None:
    for d in ds:
        await d.close()


async def with_probes(clients: dict[str, Child], a: argparse.Namespace) -> tuple[list[float], dict[str, list[float]]]:
    """The light user's requests and, during them, the baselines from a client process of their
    own: NATS round trips over the first half of the light user's run, raw Ray calls over the
    second (`--light` / 2 of each, at `--gap-ms`; so each baseline's p99 is its largest of 15)."""
    light, other = await asyncio.gather(
        clients["light"].ask({"op": "light", "n": a.light, "gap_s": a.gap_ms / 1000}),
        clients["probe"].ask({"op": "probe", "n": a.light // 2, "gap_s": a.gap_ms / 1000,
                              "ray": ray_adapter.gcs_address()}))
    return light["waits"], {"nats": other["nats"], "ray": other["ray"]}


async def flood_round(url: str, order: str, load: Load, clients: dict[str, Child], token: str,
                      a: argparse.Namespace) -> tuple[dict[str, float], dict[str, list[float]]]:
    ds = await start_dispatchers(url, order, load, token, a.sample_ms)
    try:
        base = sum([(await d.ask({"op": "mark"}))["held"] for d in ds])
        t0 = (await clients["heavy"].ask({"op": "flood", "n": a.heavy}))["t0"]
        published = time.monotonic() - t0
        light, probes = await with_probes(clients, a)
        light_done = time.monotonic()
        left = (await clients["heavy"].ask({"op": "left_at", "t": light_done}))["left"]
        t_last = (await clients["heavy"].ask({"op": "until_ended", "timeout_s": 600}))["t_last"]
        t1 = max(light_done, t_last)  # the round's every request ended
        idle_s, intake_t = idle_and_intake([(await d.ask({"op": "samples"}))["samples"] for d in ds], base, a.heavy)
    finally:
        await stop_dispatchers(ds)
    return {"rps": (a.heavy + a.light) / (t1 - t0), "light_p99_s": pct(light, 99), "light_p50_s": pct(light, 50),
            "nats_p99_s": pct(probes["nats"], 99), "ray_p99_s": pct(probes["ray"], 99),
            "light_first_s": light[0], "light_rest_max_s": max(light[1:], default=0.0), "idle_replica_s": idle_s,
            "heavy_left_when_light_done": left, "flood_s": t1 - t0, "published_s": published,
            "intake_s": (intake_t if intake_t is not None else float("nan")) - t0}, {"light": light, **probes}


async def main(a: argparse.Namespace) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="ndif-bench-fair-"))
    srv, url, ckpt, mk = await tiny_model_stack(tmp, "nats", 2, 4)
    token = model_token(mk)
    log = await JetStreamEventLog.open(url)
    out: dict[str, float] = {}
    try:
        async with Controller.from_url(url, policy_interval_s=0.5), \
                await NodeAgent.open(url, "bench-node", gpus=declared_gpus(2, 80 * 10**9), cpu_cache_bytes=10**10,
                                     drain_timeout_s=0.05, heartbeat_s=1.0), \
                await AdminClient.open(url) as admin:
            await admin.wait(await admin.deploy(ckpt, REPLICAS), timeout=120)
            load = Load(log, mk, a.new_tokens, users=("warm",))  # the dispatchers' warm-up, from this process
            subs = await load.listen()
            clients = {u: await client_process(url, mk, u, a.new_tokens).start() for u in ("light", "heavy", "probe")}
            probe: Any = ray_adapter.plain_actor(Probe, name="bench-probe")
            await probe.ping.remote()
            try:
                ds = await start_dispatchers(url, "fair", load, token, a.sample_ms)
                try:
                    idle, idle_probes = await with_probes(clients, a)
                finally:
                    await stop_dispatchers(ds)
                print(f"(idle) light user alone: wait p50 {pct(idle, 50) * 1000:.1f} ms, p99 "
                      f"{pct(idle, 99) * 1000:.1f} ms ({a.light} requests); the baselines meanwhile: NATS round "
                      f"trip p50 {pct(idle_probes['nats'], 50) * 1000:.2f} / p99 {pct(idle_probes['nats'], 99) * 1000:.2f} ms, "
                      f"raw Ray call p50 {pct(idle_probes['ray'], 50) * 1000:.2f} / p99 "
                      f"{pct(idle_probes['ray'], 99) * 1000:.2f} ms", flush=True)
                rounds: list[tuple[dict[str, float], dict[str, float]]] = []
                waits: dict[str, list[float]] = {"fair": [], "fifo": []}  # the light user's, every round
                base: dict[str, list[float]] = {k: [] for k in idle_probes}  # the baselines, the fair rounds
                for r in range(a.rounds):
                    got = {}
                    # Alternate which goes first: the VM's speed drifts, a pair's ratio less so.
                    for name in (("fair", "fifo") if r % 2 == 0 else ("fifo", "fair")):
                        got[name], w = await flood_round(url, name, load, clients, token, a)
                        waits[name] += w["light"]
                        if name == "fair":
                            for k in base:
                                base[k] += w[k]
                        g = got[name]
                        print(f"(flood) round {r + 1} {name}: {g['rps']:.0f} req/s, light wait p50 "
                              f"{g['light_p50_s'] * 1000:.1f} ms / p99 {g['light_p99_s'] * 1000:.1f} ms (the first "
                              f"{g['light_first_s'] * 1000:.1f} ms, the others at most "
                              f"{g['light_rest_max_s'] * 1000:.1f} ms); the flood stored in {g['published_s'] * 1000:.0f} ms, all "
                              f"taken by the dispatchers {g['intake_s'] * 1000:.0f} ms after its first publish; flood "
                              f"left when the light user finished {g['heavy_left_when_light_done']:.0f}, idle "
                              f"replica-s with a queue {g['idle_replica_s']:.3f}; meanwhile NATS round trip p99 "
                              f"{g['nats_p99_s'] * 1000:.2f} ms, raw Ray call p99 {g['ray_p99_s'] * 1000:.2f} ms", flush=True)
                    rounds.append((got["fair"], got["fifo"]))
            finally:
                for c in clients.values():
                    await c.close()
                for sub in subs:
                    await sub.unsubscribe()
            if load.failed:
                raise RuntimeError(f"{len(load.failed)} requests did not complete, e.g. {next(iter(load.failed.values()))}")
    finally:
        await log.close()
        ray_adapter.shutdown()
        srv.close()
    out["light_user_wait_p99_s"] = pct(waits["fair"], 99)
    out["idle_light_user_wait_p99_s"] = pct(idle, 99)
    out["light_wait_ratio"] = out["light_user_wait_p99_s"] / out["idle_light_user_wait_p99_s"]
    # What the machine alone does to a round trip under the same flood (no queue of ours on the way).
    out["nats_rtt_p99_ratio"] = pct(base["nats"], 99) / pct(idle_probes["nats"], 99)
    out["ray_call_p99_ratio"] = pct(base["ray"], 99) / pct(idle_probes["ray"], 99)
    out["idle_replica_s_with_queue"] = sum(f["idle_replica_s"] for f, _ in rounds)
    out["fair_throughput_ratio"] = statistics.median(f["rps"] / g["rps"] for f, g in rounds)
    out["fair_rps"] = statistics.median(f["rps"] for f, _ in rounds)
    out["fifo_rps"] = statistics.median(g["rps"] for _, g in rounds)
    out["fifo_light_user_wait_p99_s"] = pct(waits["fifo"], 99)
    out["fifo_idle_replica_s_with_queue"] = sum(g["idle_replica_s"] for _, g in rounds)
    intakes = [f["intake_s"] for f, _ in rounds if f["intake_s"] == f["intake_s"]]  # NaN: not seen whole
    out["flood_intake_s_median"] = statistics.median(intakes) if intakes else -1.0
    out["heavy_left_when_light_done_min"] = min(f["heavy_left_when_light_done"] for f, _ in rounds)
    out["flood_requests"] = a.heavy
    out["light_requests"] = a.light
    out["rounds"] = a.rounds
    out["new_tokens"] = a.new_tokens
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        url, mk, user, new_tokens = sys.argv[2:6]
        asyncio.run(client_main(url, mk, user, int(new_tokens)))
        sys.exit(0)
    if sys.argv[1:2] == ["--dispatcher"]:
        url, name, order, token, gcs, sample_ms = sys.argv[2:8]
        asyncio.run(dispatcher_main(url, name, order, token, gcs, float(sample_ms)))
        sys.exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heavy", type=int, default=1500, help="the heavy user's flood, per round")
    p.add_argument("--light", type=int, default=30, help="the light user's requests, one after another")
    p.add_argument("--gap-ms", type=float, default=50.0, help="the light user's pause between its requests")
    p.add_argument("--rounds", type=int, default=4, help="paired rounds (fair and FIFO each once a round)")
    p.add_argument("--sample-ms", type=float, default=5.0, help="the idle sampler's period")
    p.add_argument("--new-tokens", type=int, default=0,
                   help="0: every request (both users') a forward pass; N: a generation of N tokens (slower requests)")
    res = asyncio.run(main(p.parse_args()))
    keys = ["light_user_wait_p99_s", "idle_light_user_wait_p99_s", "light_wait_ratio", "idle_replica_s_with_queue",
            "fair_throughput_ratio"]
    print(json.dumps({k: round(res[k], 4) for k in [*keys, *sorted(set(res) - set(keys))]}))
