"""`ndif up --demo`: the whole service on this machine, end to end (about 25 s on a 2-core VM).

Embedded NATS (JetStream, temp store, free port), a local Ray (2 declared GPUs on a CPU-only
machine, the real ones otherwise), the controller, one node agent and the dispatcher run in this
process; two tiny real checkpoints are made on the first run (`$NDIF_HOME/models`, default
`~/.ndif/models`). Then, as an operator and a researcher would:

1. `ndif deploy tiny-gpt2 --replicas 2 --wait` (the real CLI, in a subprocess);
2. a burst of requests through the async SDK, with a progress bar; both replicas serve;
3. `ndif scale --replicas 3 --wait`; a second burst, and `ndif evict --replica-id 0` while it flows:
   the replica drains (no request lost), goes WARM, the others take the rest;
4. `ndif status`, `ndif queue`, `ndif history`, `ndif replay --until` (the cluster before the eviction);
5. the outcome and the commands to look further (`--stay` keeps the cluster up for them).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas.units import GiB

PAYLOAD = {"op": "generate", "prompt": "The control plane is", "max_new_tokens": 12}


def say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


class Progress:
    """One line redrawn in a terminal; a line per quarter otherwise (logs, CI)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.done = self.failed = 0
        self.tty = sys.stdout.isatty()
        self._last_quarter = -1
        self.t0 = time.perf_counter()

    def update(self, *, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self.draw()

    def say(self, text: str) -> None:
        """Print `text` on lines of its own above the bar, which is drawn again below it (never
        written over, never written into)."""
        if self.tty:
            print("\r" + " " * 110 + "\r" + text, flush=True)
            if self.done < self.total:
                self.draw()
        else:
            print(text, flush=True)

    def draw(self, note: str = "") -> None:
        frac = self.done / self.total
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = (f"  {self.label} [{bar}] {self.done}/{self.total} done, {self.failed} failed, "
                f"{time.perf_counter() - self.t0:5.1f}s {note}")
        if self.tty:
            print("\r" + line.ljust(110), end="" if self.done < self.total else "\n", flush=True)
        elif int(frac * 4) != self._last_quarter or note:
            self._last_quarter = int(frac * 4)
            print(line, flush=True)


def _print(text: str) -> None:
    print(text, flush=True)


async def run_cli(url: str, *args: str, show: Callable[[str], None] = _print) -> str:
    """Run the real CLI and show it (through `show`: a progress bar's `say` while one is drawn), as
    an operator would type it."""
    show(f"$ ndif {' '.join(args)}")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", *args,
        env={**os.environ, "NDIF_NATS_URL": url, "NDIF_LOG_LEVEL": "WARNING"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    text = out.decode()
    if text.strip():
        show("  " + text.rstrip().replace("\n", "\n  "))
    if proc.returncode:
        raise SystemExit(f"demo: `ndif {' '.join(args)}` exited {proc.returncode}")
    return text


async def _burst(client: Any, model: str, n: int, label: str, *, during: Any = None,
                 during_at: int = 0) -> dict[str, Any]:
    """n requests at once through the SDK; `during` runs once `during_at` of them are done."""
    from dataplane.client.sdk import RequestFailed

    bar = Progress(n, label)
    per_replica: Counter[int] = Counter()
    latencies: list[float] = []
    requeued = 0
    outputs: set[str] = set()
    side: asyncio.Task[Any] | None = None

    async def one() -> None:
        nonlocal requeued, side
        t0 = time.perf_counter()
        job = await client.submit(model, PAYLOAD)
        try:
            result = await job.result(timeout=300)
            ok = True
            outputs.add(str(result.get("text")))
        except RequestFailed as exc:
            ok = False
            bar.say(f"  {job.request_id}: {exc}")
        latencies.append(time.perf_counter() - t0)
        last = job.last
        if last is not None and last.replica_id is not None:
            per_replica[last.replica_id] += 1
        if last is not None and last.attempt > 1:
            requeued += 1
        bar.update(ok=ok)
        if during is not None and side is None and bar.done >= during_at:
            side = asyncio.create_task(during(bar))

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    if side is not None:
        await side
    lat = sorted(latencies)
    return {"completed": bar.done - bar.failed, "failed": bar.failed, "per_replica": dict(sorted(per_replica.items())),
            "requeued": requeued, "distinct_outputs": len(outputs), "wall_s": wall, "rps": n / wall,
            "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def _report(r: dict[str, Any]) -> None:
    spread = ", ".join(f"replica {k}: {v}" for k, v in r["per_replica"].items())
    print(f"  {r['completed']} COMPLETED, {r['failed']} ERROR in {r['wall_s']:.1f}s ({r['rps']:.0f} req/s; "
          f"latency p50 {r['p50_s'] * 1000:.0f} ms, p99 {r['p99_s'] * 1000:.0f} ms)\n"
          f"  served by {spread}; {r['requeued']} re-queued after their replica left; "
          f"{r['distinct_outputs']} distinct output(s) for the same greedy input", flush=True)


async def run_demo(*, port: int | None, store: Path | None, gpus: tuple[Any, ...] | None, requests: int,
                   stay: bool, dashboard_port: int = 8470) -> int:
    from controlplane.service.logs import configure
    from controlplane.store.admin import AdminClient
    from dataplane.client.sdk import Client
    from dataplane.node.agent import declared_gpus, detect_gpus
    from dataplane.node.tiny_models import make_tiny_gpt2, make_tiny_llama
    from dataplane.ops.local import LocalCluster, until_signal
    from schemas.keys import canonical_model_key
    from schemas.status import ReplicaState

    configure(os.environ.get("NDIF_LOG_LEVEL", "WARNING"))
    t_start = time.perf_counter()
    home = Path(os.environ.get("NDIF_HOME", Path.home() / ".ndif"))
    temp = None if store else Path(tempfile.mkdtemp(prefix="ndif-demo-"))  # removed at the end
    if store is None:
        assert temp is not None
        store = temp / "nats"
    gpus = gpus or detect_gpus() or declared_gpus(2, 80 * GiB)
    real = bool(detect_gpus())

    say("Starting nats-server (JetStream), a local Ray, the controller, a node agent and the dispatcher")
    cluster = LocalCluster(store=store, port=port, gpus=tuple(gpus), node_id="demo-node",
                           controller={"policy_interval_s": 0.2}, dashboard_port=dashboard_port,
                           agent={"cpu_cache_bytes": 20 * GiB, "drain_timeout_s": 30, "heartbeat_s": 1.0,
                                  "health_interval_s": 0.5})
    url = cluster.start_nats()
    try:
        await cluster.ensure_log()
        print(f"  NATS {url} (store {store}); Ray with {len(gpus)} {'real' if real else 'declared'} GPU(s)", flush=True)

        say(f"Tiny real checkpoints (random weights, save_pretrained) in {home / 'models'}")
        t0 = time.perf_counter()
        gpt2 = str(make_tiny_gpt2(home / "models" / "tiny-gpt2"))
        make_tiny_llama(home / "models" / "tiny-llama")
        print(f"  {gpt2} ({time.perf_counter() - t0:.1f}s)", flush=True)
        mk = canonical_model_key(gpt2)
        outcome: dict[str, Any] = {}
        async with cluster, await AdminClient.open(url) as admin, Client(url) as client:
            assert cluster.dashboard is not None
            dash = cluster.dashboard
            print(f"  dashboard {dash.url} (read-only; watch the replicas move while the demo runs)", flush=True)
            say("Deploy 2 replicas (the controller registers the model: its size measured on the meta device)")
            await run_cli(url, "deploy", gpt2, "--replicas", "2", "--wait")

            say(f"A burst of {requests} requests through the async SDK (generate, 12 new tokens)")
            outcome["burst1"] = b1 = await _burst(client, gpt2, requests, "burst 1")
            _report(b1)

            say("Scale to 3 replicas: the dispatcher starts its lanes as soon as ReplicaLoaded is in the log")
            await run_cli(url, "scale", gpt2, "--replicas", "3", "--wait")
            before_evict = (await admin.state()).seq

            async def evict(bar: Progress) -> None:
                bar.say("  (evicting replica 0 while requests flow)")
                await run_cli(url, "evict", gpt2, "--replica-id", "0", show=bar.say)

            say(f"A second burst of {requests}; replica 0 is evicted once a quarter of it is done")
            outcome["burst2"] = b2 = await _burst(client, gpt2, requests, "burst 2", during=evict,
                                                  during_at=requests // 4)
            _report(b2)
            async with asyncio.timeout(60):
                while (await admin.state()).replicas[(mk, 0)].state not in (ReplicaState.CACHED, ReplicaState.UNLOADED):
                    await asyncio.sleep(0.1)

            say("What the log says now")
            await run_cli(url, "status")
            await run_cli(url, "queue")
            await run_cli(url, "history", gpt2, "--replica-id", "0")
            say(f"Replay: the cluster as it was at seq {before_evict}, before the eviction")
            await run_cli(url, "replay", "--until", str(before_evict))

            total = requests * 2
            done = b1["completed"] + b2["completed"]
            say(f"Outcome: {done}/{total} requests COMPLETED, {b1['failed'] + b2['failed']} ERROR, "
                 f"{b2['requeued']} re-queued by the eviction and none lost; "
                 f"{time.perf_counter() - t_start:.0f}s in all")
            if stay:
                head = f"  Look further, in another shell:\n    export NDIF_NATS_URL={url}\n"
            else:
                head = ("  Look further: run `ndif up --demo --stay` (this cluster stops now), then in another\n"
                        "  shell export the NDIF_NATS_URL it prints, and:\n")
            print(head +
                  "    ndif status --watch                 # replicas, GPUs, memory, from the log\n"
                  f"    ndif history {gpt2} --replica-id 0\n"
                  "    ndif replay --until SEQ|ISO-TIME    # any past state\n"
                  "    ndif events --follow                # the event stream (or: nats stream view NDIF_EVENTS)\n"
                  f"    ndif submit {gpt2} --prompt Hello\n"
                  "    ndif queue                          # the dispatcher's processors\n"
                  f"    {dash.url}   # the dashboard (with --stay)", flush=True)
            if stay:
                print(f"\n  The cluster stays up at {url}; Ctrl-C stops it.", flush=True)
                await until_signal()
            return 0 if done == total else 1
    finally:
        await cluster.stop()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)  # the demo's own JetStream store
