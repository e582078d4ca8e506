"""What the benchmarks share: percentiles, and the typed field sets their synthetic events are built from.

Imported by the scripts beside it (`python tools/bench/<name>.py` puts this directory on sys.path).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict


async def tiny_model_stack(tmp: Path, nats_dir: str, ray_nodes: int, num_cpus: int) -> tuple[Any, str, str, str]:
    """A nats-server of its own under `tmp / nats_dir`, a local Ray of `ray_nodes` nodes, and a tiny
    GPT-2 checkpoint: (the server, its URL, the checkpoint, its model key). Imported late: the
    benchmarks without Ray need none of it."""
    from controlplane.ops.nats_server import EmbeddedNats
    from dataplane.node.tiny_models import make_tiny_gpt2
    from dataplane.runtime import ray_adapter
    from schemas.keys import canonical_model_key

    srv = EmbeddedNats(tmp / nats_dir)
    await srv.astart()
    ray_adapter.start_local(ray_nodes, num_cpus=num_cpus)
    ckpt = str(make_tiny_gpt2(tmp / "tiny"))
    return srv, srv.url, ckpt, canonical_model_key(ckpt)


async def in_flight(call: Callable[[], Awaitable[object]], total: int, width: int = 16) -> float:
    """`total` awaited calls, `width` at a time: calls a second."""
    done = 0

    async def lane() -> None:
        nonlocal done
        while done < total:
            done += 1
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(width)))
    return total / (time.perf_counter() - t0)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


# `--sync`: the server's `sync_interval` for the stores a benchmark measures. `always` is the project's
# (controlplane/ops/nats_server.py SYNC_ALWAYS); `2m` is nats-server's default, measured for what the sync costs.
SYNC_CHOICES = {"always": ["always"], "2m": ["2m"], "both": ["always", "2m"]}


def add_sync_option(ap: Any) -> None:
    ap.add_argument("--sync", choices=list(SYNC_CHOICES), default="always",
                    help="the server's sync_interval: always (the project's), 2m (the server's default), or both; "
                         "figures under 2m get keys ending in _nosync")


def sync_suffix(sync: str) -> str:
    """The suffix of a JSON key measured under `sync`: none for the project's setting."""
    return "" if sync == "always" else "_nosync"


def fsync_ms(where: Path, n: int = 500, size: int = 256) -> list[float]:
    """`n` appends of `size` bytes to a file under `where`, each followed by `os.fsync`: each one's time
    (ms). What a synced write costs the filesystem the benchmark's stores live on, without the server."""
    import os
    import time

    path = where / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * size)
            os.fsync(fd)
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return out


class Envelope(TypedDict):
    """The envelope fields of every event (`E.Event`), passed as `**env`."""

    event_id: str
    ts: datetime
    actor: str


class ReplicaRef(TypedDict):
    """The fields naming a replica (`E.ReplicaEvent`), passed as `**rep`."""

    model_key: str
    replica_id: int
    node_id: str


async def bulk_append(log: Any, events: list[Any], *, progress: Any = None) -> int:
    """Append a prepared history (the controller's events and agents' observed facts mixed, in order)
    as fast as the server takes it: a benchmark's setup, not what it measures. Returns the log's last seq.

    The product appends each observed fact alone, through NDIF_FACTS, and returns once the fact gate
    has admitted it into the log (decisions 48, 50): a million generated events that way would take
    many minutes, and a guarded batch may hold no fact. The log takes the facts' subjects itself
    (only the gate publishes there in a cluster; a benchmark's admin may), so the whole history is
    stored in atomic batches of E.MAX_BATCH."""
    import time

    from controlplane.store.eventstore import appends, topology
    from schemas import events as E

    js = log.js
    t0, done = time.perf_counter(), 0
    for i in range(0, len(events), E.MAX_BATCH):
        batch = events[i:i + E.MAX_BATCH]
        ack = await appends._publish_batch(log.nc, batch, None, 30.0)
        if ack.error is not None:
            raise RuntimeError(f"bulk append refused at event {i}: {ack.error.description}")
        done += len(batch)
        if progress is not None and (done % 50_000 < E.MAX_BATCH or done == len(events)):
            progress(f"  appended {done:>9,} / {len(events):,} events ({done / (time.perf_counter() - t0):,.0f}/s)")
    await topology.ensure(js, replicas=1, may_create=True)  # as `ndif up` leaves them: nothing to change
    return int(await log.last_seq())


async def append_in_order(log: Any, events: list[Any]) -> None:
    """Append a mixed history the product's way, in order: each run of the controller's events as
    guard-free atomic batches, each observed fact alone (through NDIF_FACTS, returning once the gate
    admitted it, as an agent's append does: a controller, or `controlplane.service.factgate.fact_gate`,
    must run). For what follows a live cluster; `bulk_append` for a setup."""
    from schemas import events as E
    from schemas.events import event_subject
    from schemas.subjects import is_fact_subject

    run: list[Any] = []
    for ev in [*events, None]:
        if ev is not None and not is_fact_subject(event_subject(ev)):
            run.append(ev)
            if len(run) < E.MAX_BATCH:
                continue
        if run:
            await log.append(run, None)
            run = []
        if ev is not None and is_fact_subject(event_subject(ev)):
            await log.append([ev], None)


class Child:
    """A process of the benchmark's own (`script` run with `args`, e.g. fairness.py `--client`): commands
    and answers are JSON lines (`commands`, `answer` in the child). Times are `time.monotonic()`, one
    clock for every process of the machine."""

    def __init__(self, what: str, script: str, args: list[str]) -> None:
        self.what = what
        self.args = [sys.executable, script, *args]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Child:
        self.proc = await asyncio.create_subprocess_exec(*self.args, stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE, limit=2**26)
        await self.ask({"op": "ready"})
        return self

    async def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.what} process ended (exit {await self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        if out.get("failed"):
            raise RuntimeError(f"{len(out['failed'])} {self.what} requests did not complete, e.g. {out['failed'][0]}")
        return out

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                self.proc.kill()  # a child that hangs on its way out does not hang the benchmark
                await self.proc.wait()


async def commands() -> AsyncIterator[dict[str, Any]]:
    """The JSON-line commands of a child process, from stdin."""
    reader = asyncio.StreamReader(limit=2**26)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield json.loads(line)


def answer(out: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
