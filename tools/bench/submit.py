"""Benchmark of submit: how fast the SDK stores requests, against raw nats-py JetStream publishes.

Starts a nats-server of its own for each `--sync` setting (file storage, temp dir, the streams `ndif up`
makes, an open server, no dispatcher: the requests stay stored) and measures, in paired rounds
(each round runs every part on every server back to back; medians):
 (a) 1 in flight: `Client.submit` one after another vs a raw `js.publish` of a body of the same bytes
     with a fresh `Nats-Msg-Id`, to the same subject of the same stream: latency p50 and submits/s;
 (b) 16 in flight: submits/s, the same two.
Before them, `fsync_p50_ms` / `fsync_p99_ms`: a small append and `os.fsync` on the stores' filesystem.
The last line printed is one JSON object; figures under `2m` have keys ending in `_nosync`.

    python tools/bench/submit.py [--requests 2000] [--single 400] [--rounds 5] [--sync always|2m|both]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats
from benchkit import SYNC_CHOICES, add_sync_option, fsync_ms, in_flight, pct, sync_suffix

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.logs import configure
from controlplane.store.credentials import mark_open
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client
from schemas.keys import canonical_model_key
from schemas.requests import Request, encode_request
from schemas.subjects import request_subject

MODEL = "openai-community/gpt2"
NOOP = {"op": "echo", "data": 1}


class Pair:
    """One server of a sync setting, with an SDK client and a raw nats-py connection to it."""

    def __init__(self, sync: str, c: Client, js: Any) -> None:
        self.sync, self.c, self.js = sync, c, js
        mk = canonical_model_key(MODEL)
        self.subject = request_subject(mk, "")
        self.body = encode_request(Request(request_id=uuid.uuid4().hex, model_key=mk, payload=NOOP,
                                           submitted_at=datetime.now(UTC), client=c.name))
        self.jobs: list[Any] = []

    async def ours(self) -> None:
        self.jobs.append(await self.c.submit(MODEL, NOOP))

    async def raw(self) -> None:
        await self.js.publish(self.subject, self.body, headers={"Nats-Msg-Id": uuid.uuid4().hex}, timeout=10)

    async def close_jobs(self) -> None:
        # An open server's job holds a subscription of its own: dropped between parts, untimed.
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            await job.close()


async def one_by_one(call: Callable[[], Awaitable[None]], n: int) -> tuple[list[float], float]:
    lat, t0 = [], time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        await call()
        lat.append((time.perf_counter() - s) * 1000)
    return lat, n / (time.perf_counter() - t0)


async def main(a: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ndif-bench-")))
        lat = fsync_ms(tmp)
        out["fsync_p50_ms"], out["fsync_p99_ms"] = pct(lat, 50), pct(lat, 99)
        print(f"fsync of a small append on {tmp}: p50 {out['fsync_p50_ms']:.2f} ms, p99 {out['fsync_p99_ms']:.2f} ms",
              flush=True)
        pairs = []
        for sync in SYNC_CHOICES[a.sync]:
            srv = stack.enter_context(EmbeddedNats(tmp / sync, sync_interval=sync))
            mark_open(srv.url)
            async with await JetStreamEventLog.open(srv.url):  # the streams, as `ndif up` makes them
                pass
            c = await stack.enter_async_context(Client(srv.url))
            nc = await nats.connect(srv.url)
            stack.push_async_callback(nc.close)
            pairs.append(Pair(sync, c, nc.jetstream()))
        for p in pairs:  # warm both paths
            await one_by_one(p.ours, 50)
            await one_by_one(p.raw, 50)
            await p.close_jobs()
        # Per setting: latencies pooled over rounds; rates and ratios per round, their median reported.
        got: dict[str, dict[str, list[float]]] = {p.sync: {} for p in pairs}
        for r in range(a.rounds):
            for p in pairs:
                g = got[p.sync]
                ours_lat, ours_1 = await one_by_one(p.ours, a.single)
                await p.close_jobs()
                raw_lat, raw_1 = await one_by_one(p.raw, a.single)
                ours_16 = await in_flight(p.ours, a.requests)
                await p.close_jobs()
                raw_16 = await in_flight(p.raw, a.requests)
                for k, v in {"ours_lat": ours_lat, "raw_lat": raw_lat}.items():
                    g.setdefault(k, []).extend(v)
                for k, x in {"submits_per_s_1": ours_1, "raw_publishes_per_s_1": raw_1, "submits_per_s_16": ours_16,
                             "raw_publishes_per_s_16": raw_16, "submit_ratio_1": ours_1 / raw_1,
                             "submit_ratio_16": ours_16 / raw_16}.items():
                    g.setdefault(k, []).append(x)
                print(f"round {r + 1}, sync {p.sync}: 1 in flight submit {ours_1:.0f}/s (p50 {pct(ours_lat, 50):.2f} ms), "
                      f"raw publish {raw_1:.0f}/s (p50 {pct(raw_lat, 50):.2f} ms); 16 in flight submit {ours_16:.0f}/s, "
                      f"raw publish {raw_16:.0f}/s; submit / raw {ours_16 / raw_16:.2f}", flush=True)
        for p in pairs:
            g, sfx = got[p.sync], sync_suffix(p.sync)
            res = {"submit_p50_ms": pct(g.pop("ours_lat"), 50), "raw_publish_p50_ms": pct(g.pop("raw_lat"), 50)}
            res["submit_over_raw_p50"] = res["submit_p50_ms"] / res["raw_publish_p50_ms"]
            res |= {k: statistics.median(v) for k, v in g.items()}
            out |= {k + sfx: v for k, v in res.items()}
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="submits per round at 16 in flight")
    p.add_argument("--single", type=int, default=400, help="submits per round at 1 in flight")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds (medians reported)")
    add_sync_option(p)
    configure("ERROR")
    res = asyncio.run(main(p.parse_args()))
    keys = ["submits_per_s_16", "raw_publishes_per_s_16", "submit_ratio_16", "submit_p50_ms", "raw_publish_p50_ms",
            "submit_over_raw_p50", "submits_per_s_1", "raw_publishes_per_s_1", "submit_ratio_1"]
    keys = [k for k in keys if k in res] + sorted(set(res) - set(keys))
    print(json.dumps({k: round(res[k], 3) for k in keys}))
