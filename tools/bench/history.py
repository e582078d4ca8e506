"""Benchmark of long histories: a start from a snapshot, memory bounded by the cluster, a
million events.

Starts its own nats-server (file storage, temp dir) and a controller process that follows the log
and stores a snapshot every --snapshot-every events (the real writer, `Controller(snapshot_every=)`).
Appends a generated lifecycle history (64 nodes x 8 cards, 40 models; replicas scheduled with new
ids, loaded, drained to WARM, brought back, scaled down to COLD; one command per decision: every
event valid, no anomaly). Before each measuring point the writer is stopped at half a snapshot
interval short of it, one snapshot stored where it stopped, and the rest appended, so a new reader
folds the same tail (half the interval, the average) at both points. At 100,000 and at --events
(default 1,000,000) it measures, each in a NEW process:
  snapshot_start_s   a controller connects, loads the newest snapshot, folds the tail and is started
                     (subscribed: ready to decide); in-process time from connecting, median of --starts
  rss                that started controller's resident memory (VmRSS)
  full_rebuild_s     a fold of the whole log from seq 1, no snapshot (for reference; its state is
                     checked equal to the snapshot-started controller's)
and at --events only:
  dashboard_first_render_s   a dashboard process connects, starts (snapshot + tail) and answers
                             GET /api/state; in-process time from connecting to the body read
  replay_random_p50_ms       `AdminClient.state(until_seq=random past seq)` (what `ndif replay --until`
                             folds), p50 of --samples; one of them checked against a fold from seq 1
The last line printed is one JSON object with the figures; progress goes to stderr.

    python tools/bench/history.py [--events 1000000] [--snapshot-every 5000] [--starts 3] [--samples 30]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchkit import Envelope, ReplicaRef, bulk_append, pct

from controlplane.core.projections import encode_snapshot
from controlplane.core.projections.snapshot import parse_name
from controlplane.ops.nats_server import EmbeddedNats, die_with_parent
from controlplane.service.snapshots import SNAPSHOT_EVERY, SnapshotWriter
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.rebuild import rebuild
from schemas import events as E
from schemas.status import DeploymentOp, EvictionReason, Level

GB = 10**9
T0 = datetime(2026, 1, 1, tzinfo=UTC)
NODES = [f"gpu-{i:03d}.bench" for i in range(64)]
GPUS, SLOTS, BPG = 8, 3, 24 * GB  # three 24 GB replicas fit an 80 GB card
MODELS = [f'nnsight.modeling.language.LanguageModel:{{"repo_id": "org/model-{i:02d}", "revision": null}}'
          for i in range(40)]
MAX_LIVE = 1200  # replicas HOT or WARM at once: the cluster stays this size, the history grows
QUIET: dict[str, Any] = {"heartbeat_grace_s": 1e9, "policy_interval_s": 3600.0}  # no NodeLost, no policies


def log_progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the generated history ----------------------------------------------------------------------------



def agent(node: str) -> str:
    """The generated facts' author: an actor without a `kind:` (unchecked), so their subjects carry no
    source and the history is appended in batches straight into the log. An agent's own facts
    (`agent:<node>`) go one at a time through the facts stream, too slow for a million events."""
    return f"agent-{node}"


class History:
    """A controller's and its agents' events, decision by decision, on a fixed cluster."""

    def __init__(self, seed: int = 28) -> None:
        self.rng = random.Random(seed)
        self.n = 0
        self.next_id = dict.fromkeys(MODELS, 0)
        self.free = {(nd, g): SLOTS for nd in NODES for g in range(GPUS)}
        self.hot: dict[tuple[str, int], tuple[str, int]] = {}  # replica -> (node, card)
        self.warm: dict[tuple[str, int], str] = {}  # replica -> node whose CPU cache holds it
        self.target = dict.fromkeys(MODELS, 0)

    def env(self, actor: str, cid: str | None = None) -> dict[str, Any]:
        """The envelope of the next event (`Envelope`), with the command that caused it."""
        env: Envelope = {"event_id": f"h-{self.n + 1:09d}", "ts": T0 + timedelta(milliseconds=self.n), "actor": actor}
        self.n += 1
        return {**env, "command_id": cid}

    def setup(self) -> list[E.Event]:
        out: list[E.Event] = [
            E.NodeJoined(**self.env(agent(nd)), node_id=nd, cpu_cache_bytes=2000 * GB,
                         gpus=tuple(E.GpuInfo(index=g, memory_bytes=80 * GB, name="H100") for g in range(GPUS)))
            for nd in NODES]
        for mk in MODELS:
            out.append(E.ModelRegistered(**self.env("controller:bench"), model_key=mk, checkpoint="/ckpt",
                                         size_bytes=20 * GB))
        return out

    def _decided(self, verb: str, mk: str) -> tuple[str, E.Event]:
        cid = f"cmd-{self.n + 1:09d}"
        return cid, E.CommandDecided(**self.env("cli:bench", cid), model_key=mk, verb=verb,
                                     fingerprint=hashlib.blake2b(cid.encode(), digest_size=12).hexdigest())

    def _load(self, mk: str, rid: int, node: str, g: int, source: Level, cid: str) -> list[E.Event]:
        rep: ReplicaRef = {"model_key": mk, "replica_id": rid, "node_id": node}
        self.free[(node, g)] -= 1
        self.hot[(mk, rid)] = (node, g)
        return [E.ReplicaScheduled(**self.env("controller:bench", cid), **rep, gpu_indices=(g,), bytes_per_gpu=BPG,
                                   source=source),
                E.ReplicaLoading(**self.env(agent(node)), **rep),
                E.ReplicaLoaded(**self.env(agent(node)), **rep, load_seconds=1.0)]

    def _card(self, node: str | None = None) -> tuple[str, int] | None:
        for _ in range(20):
            nd = node or self.rng.choice(NODES)
            g = self.rng.randrange(GPUS)
            if self.free[(nd, g)] > 0:
                return nd, g
        return None

    def step(self) -> list[E.Event]:
        """One decision and what the agents (and the dispatcher) report after it."""
        r = self.rng.random()
        live = len(self.hot) + len(self.warm)
        if (r < 0.3 and live < MAX_LIVE) or not self.hot:  # scale up: a new replica id
            mk = self.rng.choice(MODELS)
            card = self._card()
            if card is not None:
                cid, head = self._decided("scale", mk)
                self.target[mk] += 1
                rid = self.next_id[mk]
                self.next_id[mk] += 1
                return [head, E.DeploymentRequested(**self.env("cli:bench", cid), model_key=mk, op=DeploymentOp.SCALE,
                                                    replicas=self.target[mk], target_hot=self.target[mk]),
                        *self._load(mk, rid, *card, Level.COLD, cid)]
        if r < 0.55 and self.hot:  # evict HOT -> WARM (drained first)
            key = self.rng.choice(list(self.hot))
            node, g = self.hot.pop(key)
            self.free[(node, g)] += 1
            self.warm[key] = node
            cid, head = self._decided("evict", key[0])
            rep: ReplicaRef = {"model_key": key[0], "replica_id": key[1], "node_id": node}
            return [head, E.ReplicaEvictionRequested(**self.env("cli:bench", cid), **rep, reason=EvictionReason.ADMIN,
                                                     target=Level.WARM, drain=True),
                    E.ReplicaDrained(**self.env("dispatcher:bench"), **rep),
                    E.ReplicaCached(**self.env(agent(node)), **rep, cpu_bytes=BPG)]
        if r < 0.75 and self.warm:  # WARM -> HOT again, on its node
            key = self.rng.choice(list(self.warm))
            card = self._card(self.warm[key])
            if card is not None:
                del self.warm[key]
                cid, head = self._decided("scale", key[0])
                return [head, *self._load(*key, *card, Level.WARM, cid)]
        if self.warm and (r < 0.85 or not self.hot):  # WARM -> COLD: gone
            key = self.rng.choice(list(self.warm))
            node = self.warm.pop(key)
            cid, head = self._decided("evict", key[0])
            rep = {"model_key": key[0], "replica_id": key[1], "node_id": node}
            return [head, E.ReplicaEvictionRequested(**self.env("cli:bench", cid), **rep, reason=EvictionReason.ADMIN,
                                                     target=Level.COLD),
                    E.ReplicaUnloaded(**self.env(agent(node)), **rep)]
        key = self.rng.choice(list(self.hot))  # scale down: HOT -> COLD, drained
        node, g = self.hot.pop(key)
        self.free[(node, g)] += 1
        self.target[key[0]] = max(0, self.target[key[0]] - 1)
        cid, head = self._decided("scale-down", key[0])
        rep = {"model_key": key[0], "replica_id": key[1], "node_id": node}
        return [head, E.ReplicaEvictionRequested(**self.env("cli:bench", cid), **rep,
                                                 reason=EvictionReason.SCALE_DOWN, target=Level.COLD, drain=True),
                E.ReplicaDrained(**self.env("dispatcher:bench"), **rep),
                E.ReplicaUnloaded(**self.env(agent(node)), **rep)]


async def fill(log: JetStreamEventLog, h: History, upto: int, pending: list[E.Event]) -> list[E.Event]:
    """Append whole decisions until the log holds exactly `upto` events; returns the rest of the last one.
    A setup, not what is measured: stored in atomic batches however many facts it holds (`bulk_append`)."""
    last = await log.last_seq()
    batch = pending
    while len(batch) < upto - last:
        batch += h.step()
    batch, pending = batch[:upto - last], batch[upto - last:]
    if batch:
        await bulk_append(log, batch, progress=log_progress)
    return pending


# ---- child processes (each measured figure is a fresh process) -----------------------------------------


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def digest(state: Any) -> str:
    return hashlib.sha256(encode_snapshot(state)).hexdigest()[:16]


async def child(mode: str, url: str, seed: int, samples: int, every: int) -> dict[str, Any]:
    import structlog

    from controlplane.service.logs import configure

    configure("INFO")  # to stderr; what is measured reads its own log lines (fold_rebuilt, snapshot_ignored)
    if mode == "start":  # a new controller: connect, newest snapshot, tail, subscribed
        from controlplane.service.controller import Controller

        with structlog.testing.capture_logs() as logs:
            t0 = time.perf_counter()
            ctl = await Controller.from_url(url, name="controller:bench-start", snapshot_every=0, snapshot_every_s=0,
                                            **QUIET).start()
            ready = time.perf_counter() - t0
        rebuilt = [e for e in logs if e.get("event") == "fold_rebuilt"]
        gc.collect()
        out = {"ready_s": ready, "seq": ctl.state.seq, "rss_mb": rss_mb(), "digest": digest(ctl.state),
               "snapshot": rebuilt[-1].get("snapshot") if rebuilt else None,
               "tail": rebuilt[-1].get("tail") if rebuilt else None,
               "ignored": [e.get("reason") for e in logs if e.get("event") == "snapshot_ignored"]}
        await ctl.stop()
        return out
    if mode == "full":  # the whole log from seq 1, no snapshot
        from controlplane.store.rebuild import rebuild

        log = await JetStreamEventLog.open(url, ensure=False)
        t0 = time.perf_counter()
        state = await rebuild(log, snapshots=False)
        took = time.perf_counter() - t0
        await log.close()
        gc.collect()
        return {"full_s": took, "seq": state.seq, "rss_mb": rss_mb(), "digest": digest(state),
                "anomalies": state.anomaly_count, "replicas": len(state.replicas), "commands": len(state.commands),
                "event_ids": len(state.event_ids)}
    if mode == "dashboard":
        import aiohttp

        from controlplane.dashboard import Dashboard

        t0 = time.perf_counter()
        d = await Dashboard.from_url(url, port=0).start()
        started = time.perf_counter() - t0
        async with aiohttp.ClientSession(headers=d.auth_headers()) as http, http.get(d.base_url + "api/state") as r:
            body = await r.read()
            assert r.status == 200, body[:200]
        first = time.perf_counter() - t0
        out = {"first_render_s": first, "started_s": started, "state_bytes": len(body),
               "seq": json.loads(body)["seq"], "kept": len(d.model.items), "rss_mb": rss_mb()}
        await d.stop()
        return out
    if mode == "replay":
        from controlplane.store.admin import AdminClient
        from controlplane.store.rebuild import rebuild

        rng = random.Random(seed)
        async with await AdminClient.open(url, timeout=60) as admin:
            last = await admin.log.last_seq()
            times, seqs = [], [rng.randint(1, last) for _ in range(samples)]
            for s in seqs:
                t0 = time.perf_counter()
                st = await admin.state(until_seq=s)
                times.append((time.perf_counter() - t0) * 1000)
                assert st.seq == s, (st.seq, s)
            check = min(seqs, key=lambda s: abs(s - last // 3))  # one position checked against seq 1 on
            same = digest(await admin.state(until_seq=check)) == digest(await rebuild(admin.log, until_seq=check,
                                                                                    snapshots=False))
        return {"p50_ms": statistics.median(times), "p99_ms": pct(times, 99), "checked_seq": check, "same": same}
    if mode == "writer":  # the controller that follows the log and stores snapshots (runs until killed)
        from controlplane.service.controller import Controller

        async with Controller.from_url(url, name="controller:bench-writer", snapshot_every=every,
                                       snapshot_every_s=0, **QUIET) as ctl:
            while True:
                w = ctl.snapshots
                writing = w is not None and ((w._task is not None and not w._task.done()) or w._pending is not None)
                print(json.dumps({"seq": ctl.state.seq, "written": w.written if w else 0, "writing": writing,
                                  "written_seq": w.written_seq if w else 0, "bytes": w.last_bytes if w else 0,
                                  "dropped": w.dropped if w else 0}), flush=True)
                await asyncio.sleep(0.5)
    raise SystemExit(f"unknown child mode {mode}")


async def run_child(mode: str, url: str, *, seed: int = 0, samples: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child", mode, "--url", url, "--seed", str(seed), "--samples", str(samples),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "NDIF_LOG_LEVEL": "INFO"},
        preexec_fn=die_with_parent)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} failed ({proc.returncode}): {err.decode()[-2000:]}")
    got: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    got["process_s"] = time.perf_counter() - t0
    return got


class Writer:
    """The snapshot-writing controller, as a child process; its last progress line is kept."""

    def __init__(self, url: str, every: int) -> None:
        self.url, self.every = url, every
        self.last: dict[str, Any] = {"seq": 0, "written": 0, "writing": False, "written_seq": 0, "bytes": 0,
                                     "dropped": 0}
        self.started = False
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Writer:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", "writer", "--url", self.url, "--every", str(self.every),
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "NDIF_LOG_LEVEL": "INFO"}, preexec_fn=die_with_parent)
        self._reader = asyncio.create_task(self._read())
        while not self.started:  # started and following before the first event is appended
            if self.proc.returncode is not None:
                raise RuntimeError("the writing controller exited")
            await asyncio.sleep(0.2)
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            try:
                self.last = json.loads(line)
            except ValueError:
                continue
            self.started = True

    async def caught_up(self, seq: int, timeout: float = 600) -> dict[str, Any]:
        """Wait until it has folded to `seq` and its last snapshot write (if one was due) is stored."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.last["seq"] >= seq and not self.last["writing"]:
                await asyncio.sleep(1.5)  # two more progress lines: a write due at the last batch has started
                if not self.last["writing"]:
                    return self.last
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the writer did not reach seq {seq} ({self.last})")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


async def measure_point(url: str, log: JetStreamEventLog, starts: int) -> dict[str, Any]:
    names = [n for n in map(parse_name, await log.snapshot_names()) if n is not None]
    runs = []
    for i in range(starts):
        r = await run_child("start", url)
        runs.append(r)
        log_progress(f"  new controller {i + 1}/{starts}: started in {r['ready_s']:.3f} s in process "
                     f"({r['process_s']:.2f} s with interpreter start), from {r['snapshot']} + {r['tail']} events, "
                     f"RSS {r['rss_mb']:.0f} MB")
    full = await run_child("full", url)
    log_progress(f"  full rebuild from seq 1: {full['full_s']:.1f} s, RSS {full['rss_mb']:.0f} MB, "
                 f"{full['replicas']} replicas, {full['commands']} command records, {full['event_ids']} event ids")
    assert full["anomalies"] == 0, full
    same = all(r["digest"] == full["digest"] and r["seq"] == full["seq"] for r in runs)
    return {"start_s": statistics.median(r["ready_s"] for r in runs),
            "start_process_s": statistics.median(r["process_s"] for r in runs),
            "tail": runs[0]["tail"], "snapshot": runs[0]["snapshot"], "ignored": runs[0]["ignored"],
            "rss_mb": statistics.median(r["rss_mb"] for r in runs), "full_s": full["full_s"],
            "full_rss_mb": full["rss_mb"], "same_state": same, "snapshots": len(names),
            "replicas": full["replicas"], "commands": full["commands"]}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=100_000, help="the first measuring point")
    ap.add_argument("--snapshot-every", type=int, default=SNAPSHOT_EVERY, help="the controller's default")
    ap.add_argument("--starts", type=int, default=3, help="new controller processes timed at each point")
    ap.add_argument("--samples", type=int, default=30, help="random past positions replayed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--every", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(await child(a.child, a.url, a.seed, a.samples, a.every)), flush=True)
        return
    out: dict[str, Any] = {"events": a.events}
    with tempfile.TemporaryDirectory(prefix="ndif-bench-history-") as tmp, EmbeddedNats(Path(tmp) / "nats",
                                                                                       die_with_parent=True) as srv:
        log = await JetStreamEventLog.open(srv.url, timeout=30)
        h = History()
        t_fill = time.perf_counter()
        await bulk_append(log, h.setup())
        pending: list[E.Event] = []
        points: dict[int, dict[str, Any]] = {}
        tail = a.snapshot_every // 2  # the average tail: held equal at both points, so they compare
        writer: Writer | None = None
        try:
            for target in (a.small, a.events):
                log_progress(f"filling the log to {target - tail:,} events (a controller follows, a snapshot every "
                             f"{a.snapshot_every:,}) ...")
                writer = await Writer(srv.url, a.snapshot_every).start()  # a restart: from its newest snapshot
                pending = await fill(log, h, target - tail, pending)
                w = await writer.caught_up(target - tail)
                await writer.stop()
                writer = None
                log_progress(f"  the writing controller is at seq {w['seq']:,}: {w['written']} snapshots written "
                             f"({w['dropped']} dropped while a write was in flight), the last at seq "
                             f"{w['written_seq']:,}, {w['bytes']:,} bytes; stopped")
                # One more where it stands (the writer's own code), then the tail with no writer running.
                name = await SnapshotWriter(log, every=0, every_s=0).write_now(await rebuild(log))
                log_progress(f"  stored {name} at the writer's stop; filling the last {tail:,} events ...")
                pending = await fill(log, h, target, pending)
                points[target] = await measure_point(srv.url, log, a.starts) | {"snapshot_bytes": w["bytes"]}
            fill_s = time.perf_counter() - t_fill
            log_progress("a new dashboard process, first /api/state ...")
            dash = await run_child("dashboard", srv.url)
            log_progress(f"  started in {dash['started_s']:.3f} s, first /api/state body after {dash['first_render_s']:.3f} s "
                         f"({dash['state_bytes']:,} bytes; {dash['process_s']:.2f} s with interpreter start)")
            log_progress(f"replaying {a.samples} random past positions ...")
            rep = await run_child("replay", srv.url, seed=7, samples=a.samples)
            log_progress(f"  p50 {rep['p50_ms']:.0f} ms, p99 {rep['p99_ms']:.0f} ms; seq {rep['checked_seq']:,} "
                         f"equals a fold from seq 1: {rep['same']}")
        finally:
            if writer is not None:
                await writer.stop()
            await log.close()
    small, big = points[a.small], points[a.events]
    out |= {
        "full_rebuild_s": round(big["full_s"], 2),
        "snapshot_start_s": round(big["start_s"], 3),
        "start_ratio_1m_100k": round(big["start_s"] / small["start_s"], 3),
        "dashboard_first_render_s": round(dash["first_render_s"], 3),
        "replay_random_p50_ms": round(rep["p50_ms"], 1),
        "rss_ratio_1m_100k": round(big["rss_mb"] / small["rss_mb"], 3),
        "snapshot_bytes": big["snapshot_bytes"],
        "snapshot_bytes_100k": small["snapshot_bytes"],
        "snapshot_start_100k_s": round(small["start_s"], 3),
        "snapshot_start_process_s": round(big["start_process_s"], 2),
        "tail_events_100k": small["tail"], "tail_events": big["tail"],
        "rss_100k_mb": round(small["rss_mb"], 1), "rss_mb": round(big["rss_mb"], 1),
        "full_rebuild_100k_s": round(small["full_s"], 2),
        "full_fold_rss_100k_mb": round(small["full_rss_mb"], 1), "full_fold_rss_mb": round(big["full_rss_mb"], 1),
        "replicas_in_fold": big["replicas"], "command_records": big["commands"],
        "snapshots_stored": big["snapshots"], "start_equals_full_fold": small["same_state"] and big["same_state"],
        "replay_random_p99_ms": round(rep["p99_ms"], 1), "replay_checked_equal": rep["same"],
        "dashboard_started_s": round(dash["started_s"], 3), "fill_s": round(fill_s, 1),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
