"""Benchmark of the admin dashboard on a large projection.

Starts its own nats-server (file storage, temp dir), appends a history that leaves 1,000 nodes x 8
GPUs and 5,000 replicas (500 models x 10) and is `--events` long (default 200,000: each replica
scheduled and loaded, then WARM -> HOT cycles of random replicas), stores the snapshots a
controller would have (every 10,000 events), starts the dashboard on it and measures:
  state_p50_ms     GET /api/state (live), the whole body read, p50 of --samples
  scrub_p50_ms     GET /api/state?until=SEQ at random past sequences, p50 of --samples
  first_render_s   headless chromium: page.goto until the page has drawn the log's last seq
  plots_drawn_s    ... until the plots (a model's four, a node's card memory) and lifelines are drawn
  live_lag_p99_ms  events appended at --rate per second for --live-s seconds (by another process):
                   from the append call to the frame that drew the event's seq (the page's own
                   record), p99; live_arrive_p99_ms: to the update's arrival in the page
The last line printed is one JSON object with the figures.

    python tools/bench/dashboard.py [--events 200000] [--rate 500] [--live-s 10] [--samples 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp
from benchkit import Envelope, ReplicaRef, append_in_order, bulk_append, pct

from controlplane.core.projections import ClusterState
from controlplane.dashboard import Dashboard
from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.factgate import fact_gate
from controlplane.service.snapshots import SNAPSHOT_EVERY, SnapshotWriter
from controlplane.store.eventstore import JetStreamEventLog
from schemas import events as E
from schemas.status import EvictionReason, Level

GB = 10**9
NODES, GPUS, MODELS, PER_MODEL = 1000, 8, 500, 10
T0 = datetime(2026, 1, 1, tzinfo=UTC)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


async def until(page: Any, js: str, timeout: float) -> None:
    """Poll a JS expression every 20 ms until it is truthy. `page.evaluate` runs outside the page's
    CSP (`script-src 'self'`); playwright's `wait_for_function` evaluates its string with eval inside
    the page, which that CSP refuses."""
    deadline = time.monotonic() + timeout
    while not await page.evaluate(js):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout} s: {js}")
        await asyncio.sleep(0.02)


class History:
    """A valid history (no anomalies): the replicas and their cards are fixed, levels move."""

    def __init__(self) -> None:
        self.n = 0
        self.rng = random.Random(16)
        self.models = [f'nnsight.modeling.language.LanguageModel:{{"repo_id": "org/model-{i:03d}", "revision": null}}'
                       for i in range(MODELS)]
        # replica -> (node, gpu); 5,000 replicas over 8,000 cards, one card each.
        cards = [(f"gpu-{n:04d}", g) for n in range(NODES) for g in range(GPUS)]
        self.rng.shuffle(cards)
        self.where = {(mk, r): cards[i * PER_MODEL + r] for i, mk in enumerate(self.models) for r in range(PER_MODEL)}
        self.hot = set(self.where)
        self.warm: set[tuple[str, int]] = set()

    def env(self, actor: str) -> Envelope:
        self.n += 1
        return {"event_id": f"bench-{self.n}", "ts": T0 + timedelta(milliseconds=self.n), "actor": actor}

    def setup(self) -> list[E.Event]:
        out: list[E.Event] = [
            E.NodeJoined(**self.env(f"agent:gpu-{n:04d}"), node_id=f"gpu-{n:04d}", cpu_cache_bytes=400 * GB,
                         gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB, name="H100") for g in range(GPUS)))
            for n in range(NODES)]
        for mk in self.models:
            out.append(E.ModelRegistered(**self.env("controller"), model_key=mk, checkpoint="/ckpt",
                                         size_bytes=20 * GB))
        for (mk, r), (node, g) in self.where.items():
            out += self.load(mk, r, node, g, Level.COLD)
        return out

    def load(self, mk: str, r: int, node: str, g: int, source: Level) -> list[E.Event]:
        rep: ReplicaRef = {"model_key": mk, "replica_id": r, "node_id": node}
        cid = f"cmd-{self.n}"
        return [E.ReplicaScheduled(**self.env("controller"), **rep, command_id=cid, gpu_indices=(g,),
                                   bytes_per_gpu=23 * GB, source=source),
                E.ReplicaLoading(**self.env(f"agent:{node}"), **rep),
                E.ReplicaLoaded(**self.env(f"agent:{node}"), **rep, load_seconds=1.0)]

    def step(self) -> list[E.Event]:
        """Evict a HOT replica to WARM, or bring a WARM one back (same card)."""
        if self.warm and (len(self.warm) > 400 or self.rng.random() < 0.5):
            key = self.rng.choice(sorted(self.warm)) if len(self.warm) < 50 else self.warm.pop()
            self.warm.discard(key)
            self.hot.add(key)
            node, g = self.where[key]
            return self.load(*key, node, g, Level.WARM)
        key = self.hot.pop()
        self.warm.add(key)
        node, g = self.where[key]
        rep: ReplicaRef = {"model_key": key[0], "replica_id": key[1], "node_id": node}
        return [E.ReplicaEvictionRequested(**self.env("cli:bench"), **rep, command_id=f"cmd-{self.n}",
                                           reason=EvictionReason.ADMIN, target=Level.WARM),
                E.ReplicaCached(**self.env(f"agent:{node}"), **rep, cpu_bytes=20 * GB)]


async def append_all(log: JetStreamEventLog, events: list[E.Event]) -> None:
    await bulk_append(log, events)


async def store_snapshots(log: JetStreamEventLog, events: list[E.Event], every: int = SNAPSHOT_EVERY) -> int:
    """What a controller following this history would have stored: a snapshot every `every` events
    (the dashboard starts from the newest, and past positions from the one before them)."""
    writer = SnapshotWriter(log, every=every, every_s=0)
    state = ClusterState()
    for seq, ev in enumerate(events, 1):
        state.apply(seq, ev)
        if seq % every == 0:
            await writer.write_now(state)
    return writer.written


def appender(url: str, batches: list[list[bytes]], tick: float, conn: Any) -> None:
    """Child process: append one batch per tick; send back [(seq, wall ms at the append call)], seconds."""

    async def run() -> tuple[list[tuple[int, float]], float]:
        log = await JetStreamEventLog.open(url, timeout=30, ensure=False)
        try:
            async with fact_gate(log):  # what a controller runs: the facts' way into the log
                return await ticks(log)
        finally:
            await log.close()

    async def ticks(log: JetStreamEventLog) -> tuple[list[tuple[int, float]], float]:
        sent: list[tuple[int, float]] = []
        start = time.perf_counter()
        last = await log.last_seq()
        for i, batch in enumerate(batches):
            wall = time.time() * 1000
            # The controller's events in a batch, each agent's fact alone through NDIF_FACTS (returning
            # once the gate admitted it): when the tick's appends return, the log holds all of it, after `last`.
            await append_in_order(log, [E.decode_event(b) for b in batch])
            now = await log.last_seq()
            sent += [(s, wall) for s in range(last + 1, now + 1)]
            last = now
            delay = start + (i + 1) * tick - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        return sent, time.perf_counter() - start

    conn.send(asyncio.run(run()))


async def get_state(http: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    async with http.get(url) as r:
        body = await r.read()
        assert r.status == 200, body[:200]
    return (time.perf_counter() - t0) * 1000, len(body)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--rate", type=int, default=500, help="live events per second")
    ap.add_argument("--live-s", type=float, default=10.0)
    ap.add_argument("--samples", type=int, default=30)
    a = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("dashboard bench: chromium is not installed (apt-get install -y chromium)")
    from playwright.async_api import async_playwright

    out: dict[str, object] = {"events": a.events, "nodes": NODES, "gpus_per_node": GPUS,
                              "replicas": MODELS * PER_MODEL, "rate": a.rate}
    tmp = Path(tempfile.mkdtemp(prefix="ndif-bench-dash-"))
    srv = EmbeddedNats(tmp / "nats")
    await srv.astart()
    try:
        log = await JetStreamEventLog.open(srv.url, timeout=30)
        h = History()
        t0 = time.perf_counter()
        events = h.setup()
        while len(events) < a.events:
            events += h.step()
        # Whole cycles only (a few events past --events): the live phase goes on from the generator's state.
        h_live = h
        await append_all(log, events)
        out["snapshots"] = await store_snapshots(log, events)
        out["append_s"] = round(time.perf_counter() - t0, 1)
        out["log_events"] = await log.last_seq()
        print(f"appended {out['log_events']} events in {out['append_s']} s", flush=True)

        t0 = time.perf_counter()
        async with Dashboard.from_url(srv.url, port=0) as dash, \
                aiohttp.ClientSession(headers=dash.auth_headers()) as http:
            out["dashboard_fold_s"] = round(time.perf_counter() - t0, 2)
            live = dash.model.live
            assert len(live.nodes) == NODES and len(live.replicas) == MODELS * PER_MODEL, "bad projection"
            out["anomalies"] = live.anomaly_count
            print(f"dashboard folded in {out['dashboard_fold_s']} s: {len(live.nodes)} nodes, "
                  f"{len(live.replicas)} replicas, {live.anomaly_count} anomalies", flush=True)
            base = dash.base_url.rstrip("/")
            last = dash.model.seq

            samples, size = [], 0
            for _ in range(a.samples):
                ms, size = await get_state(http, f"{base}/api/state")
                samples.append(ms)
            out["state_p50_ms"] = round(statistics.median(samples), 1)
            out["state_p99_ms"] = round(pct(samples, 99), 1)
            out["state_bytes"] = size
            rng = random.Random(7)
            samples = []
            for _ in range(a.samples):
                ms, _ = await get_state(http, f"{base}/api/state?until={rng.randint(1, last - 1)}")
                samples.append(ms)
            out["scrub_p50_ms"] = round(statistics.median(samples), 1)
            out["scrub_p99_ms"] = round(pct(samples, 99), 1)
            print(f"state p50 {out['state_p50_ms']} ms ({size} bytes), scrub p50 {out['scrub_p50_ms']} ms", flush=True)

            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
                page = await browser.new_page(viewport={"width": 1400, "height": 900})
                t0 = time.perf_counter()
                await page.goto(dash.url)  # the URL with the token: the page keeps it in a cookie
                await until(page, f"window.ndif && window.ndif.renderedSeq >= {last}", timeout=60)
                out["first_render_s"] = round(time.perf_counter() - t0, 2)
                # Where it went: the state's fetch (request to parsed) and the first frame's script.
                probe_t = await page.evaluate("window.ndif.t")
                out["state_fetch_ms"] = round(probe_t["fetched"] - probe_t["fetch"], 1)
                out["first_frame_script_ms"] = round(probe_t["lastFrameMs"], 1)
                out["page_blocks"] = await page.evaluate("document.querySelectorAll('.block').length")
                # The plots and lifelines are on: the selected model's four plots, its lifelines and
                # the first node's card memory, asked after the first render.
                await until(page, "window.ndif.plots.rev > 0 && window.ndif.plots.cards && "
                            "window.ndif.lifeline.rev > 0", timeout=60)
                out["plots_drawn_s"] = round(time.perf_counter() - t0, 2)
                print(f"first render {out['first_render_s']} s ({out['page_blocks']} blocks drawn)", flush=True)

                # Live: `rate` events a second from another process (as agents and controllers append),
                # in ticks of 20 ms, each an unguarded atomic append of the tick's events.
                tick = 0.02
                per_tick = max(1, round(a.rate * tick))
                n_ticks = int(a.live_s / tick)
                live_events: list[E.Event] = []
                while len(live_events) < per_tick * n_ticks:
                    live_events += h_live.step()
                batches = [[E.encode_event(e) for e in live_events[i * per_tick:(i + 1) * per_tick]]
                           for i in range(n_ticks)]
                ctx = multiprocessing.get_context("spawn")
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=appender, args=(srv.url, batches, tick, child))
                proc.start()
                sent, elapsed = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
                proc.join()
                final = sent[-1][0]
                await until(page, f"window.ndif.renderedSeq >= {final}", timeout=30)
                renders = await page.evaluate("window.ndif.renders")
                received = await page.evaluate("window.ndif.received")  # [seq, ms] as each update arrived
                await browser.close()
            lags = []
            j = 0
            renders.sort()
            for seq, wall in sent:
                while j < len(renders) and renders[j][0] < seq:
                    j += 1
                lags.append(renders[j][1] - wall)
            out["live_events"] = len(sent)
            out["live_rate_achieved"] = round(len(sent) / elapsed, 1)
            out["live_lag_p50_ms"] = round(pct(lags, 50), 1)
            out["live_lag_p99_ms"] = round(pct(lags, 99), 1)
            out["live_frames"] = sum(1 for r in renders if r[0] > last)
            # Where the lag is: appended -> the update reached the page (server side and transport).
            recv = sorted(received)
            j, arrive = 0, []
            for seq, wall in sent:
                while j < len(recv) and recv[j][0] < seq:
                    j += 1
                if j < len(recv):
                    arrive.append(recv[j][1] - wall)
            out["live_arrive_p99_ms"] = round(pct(arrive, 99), 1) if arrive else None
        await log.close()
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)  # other work on the machine while it ran
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
