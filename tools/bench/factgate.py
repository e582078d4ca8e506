"""Benchmark of the fact gate: how fast agents' facts reach the log.

Starts its own nats-server (file storage, synced writes, temp dir), a controller (whose gate admits
facts one at a time) and two scripted agents (tests/agent_sim.py: the real agent, an in-memory
runtime), deploys a config-only model and scales it to `--replicas` in steps of 10. Measures:
 (a) the time until every replica is Available, and the facts the gate admitted per second then
     (each replica: `ReplicaLoading`, `ReplicaLoaded`);
 (b) the baseline in the same run: one awaited synced publish after another into a stream of the
     same server, as many as the gate admitted (what one-at-a-time costs with nothing else).
The last line printed is one JSON object with the figures.

    python tools/bench/factgate.py [--replicas 300]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.js import api

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.status import ReplicaState

GB = 10**9

CONFIG = '{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 64, "n_positions": 16}'


async def gated(url: str, tmp: Path, replicas: int) -> tuple[float, int]:
    """(seconds until `replicas` are Available, facts the gate admitted)."""
    ScriptedAgent = importlib.import_module("tests.agent_sim").ScriptedAgent  # the suite's simulated node
    ctl = await Controller.from_url(url, name="controller:bench", max_replicas_per_model=replicas,
                                    max_replicas_per_command=replicas).start()
    agents = [await ScriptedAgent(url, f"bench-{i}", gpus=8, gpu_bytes=80 * GB).start() for i in range(2)]
    admin = await AdminClient.open(url, timeout=30)
    model = tmp / "cfg"
    model.mkdir()
    (model / "config.json").write_text(CONFIG)
    try:
        assert (await admin.deploy(str(model), 1, size_bytes=GB)).ok
        t0 = time.perf_counter()
        for n in range(10, replicas + 1, 10):
            await admin.scale(str(model), n)
        while sum(r.state is ReplicaState.AVAILABLE for r in ctl.state.replicas.values()) < replicas:
            await asyncio.sleep(0.01)
        took = time.perf_counter() - t0
        admitted = ctl.gate.admitted if ctl.gate is not None else 0
    finally:
        await admin.close()
        for a in agents:
            await a.stop()
        await ctl.stop()
    return took, admitted


async def raw_serial(url: str, n: int) -> float:
    """Seconds for `n` awaited publishes, one after another, into a stream of its own."""
    lg = await JetStreamEventLog.open(url, ensure=False)
    try:
        await lg.js.add_stream(api.StreamConfig(name="BENCH_RAW", subjects=["bench.raw"], storage=api.StorageType.FILE))
        t0 = time.perf_counter()
        for i in range(n):
            await lg.js.publish("bench.raw", b'{"i": %d}' % i)
        return time.perf_counter() - t0
    finally:
        await lg.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=300)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        srv = EmbeddedNats(Path(d) / "nats")
        await srv.astart()
        try:
            print(f"scaling to {a.replicas} replicas through the gate ...", file=sys.stderr)
            took, admitted = await gated(srv.url, Path(d), a.replicas)
            print(f"{admitted} facts admitted in {took:.2f} s; the raw baseline ...", file=sys.stderr)
            raw = await raw_serial(srv.url, admitted)
        finally:
            srv.close()
    print(json.dumps({"replicas": a.replicas, "facts": admitted, "available_s": round(took, 3),
                      "facts_per_s": round(admitted / took, 1), "raw_serial_per_s": round(admitted / raw, 1),
                      "gate_over_raw": round(raw / took, 3)}))


if __name__ == "__main__":
    asyncio.run(main())
