"""A power cut under a whole `ndif up`: its JetStream store on a filesystem that loses unsynced writes
(tools/lazyfs.py), every process of it SIGKILLed (nats-server first) and the unsynced writes dropped;
`ndif up` started again on the same home and store keeps every event and the kept status it had
acknowledged, and serves a request again.

Ray's files stay off the mount (RAY_TMPDIR, tests/conftest.py); only the store is on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from controlplane.ops.nats_server import free_port, stop_process
from controlplane.store.credentials import creds_file, load_creds
from controlplane.store.eventstore import JetStreamEventLog
from dataplane.client import Client
from dataplane.node.watchdog import descendants
from tests.checkpoints import TinyModels
from tests.faults.test_power_cut import need_fuse
from tests.integration.cluster import ndif, up_running
from tools.lazyfs import LazyMount

# `ndif up` twice, a replica loaded twice: about a minute; its own Ray (`starts_ray`).
pytestmark = [pytest.mark.timeout(400), pytest.mark.long, pytest.mark.usefixtures("starts_ray")]
PAYLOAD = {"op": "generate", "prompt": "Hello", "max_new_tokens": 4}


class PoweredUp:
    """`ndif up` in a session of its own, its output in files (a full pipe would block it)."""

    def __init__(self, tmp: Path, name: str, port: int, store: Path, home: Path) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        self.home = home
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dataplane.ops.cli", "up", "--port", str(port), "--store", str(store),
                 "--gpus", "1", "--heartbeat", "0.5", "--dashboard-port", str(free_port())],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={**os.environ, "NDIF_HOME": str(home)},
                start_new_session=True)

    def wait_running(self, timeout: float = 180.0) -> None:
        up_running(self.proc, self.out, self.err, timeout)

    def cut(self) -> None:
        """Every process of it SIGKILLed at once, nats-server first: none shuts down on its own."""
        procs = descendants(self.proc.pid)
        names = {p: _cmdline(p) for p in procs}
        for pid in sorted(procs, key=lambda p: b"nats-server" not in names[p]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT, 60)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def lazy(tmp_path: Path) -> Iterator[LazyMount]:
    """The store's lazy filesystem; a test asks for it before `ups`, so it is unmounted after them."""
    need_fuse()
    with LazyMount(tmp_path / "disk", tmp_path / "store" / "jetstream") as fs:
        yield fs


@pytest.fixture
def ups() -> Iterator[list[PoweredUp]]:
    started: list[PoweredUp] = []
    yield started
    for up in started:
        up.stop()


async def _events(url: str, home: Path) -> list[tuple[int, bytes]]:
    """Every stored event, as (seq, its encoded body)."""
    log = await JetStreamEventLog.open(url, ensure=False, creds=load_creds(creds_file("admin", home=home)))
    try:
        return [(seq, msgspec.json.encode(item)) async for batch in log.read_batches() for seq, item in batch]
    finally:
        await log.close()


async def test_ndif_up_keeps_what_it_acknowledged_through_a_power_cut_and_serves_again(
        tmp_path: Path, lazy: LazyMount, ups: list[PoweredUp], tiny_models: TinyModels) -> None:
    store, home, port = tmp_path / "store", tmp_path / "home", free_port()
    url = f"nats://127.0.0.1:{port}"
    model = await asyncio.to_thread(tiny_models.gpt2, tmp_path / "models" / "tiny-gpt2")
    first = PoweredUp(tmp_path, "first", port, store, home)
    ups.append(first)
    await asyncio.to_thread(first.wait_running)
    ran = await ndif(url, "deploy", str(model), "--replicas", "1", "--wait", "--wait-timeout", "150",
                     timeout=180, env={"NDIF_HOME": str(home)})
    assert ran.rc == 0, ran.err
    client_creds = load_creds(next((home / "auth").glob("client-*.creds")))  # the local user's
    async with Client(url, creds=client_creds, timeout=10) as c:
        job = await c.submit(str(model), PAYLOAD)
        before = await job.result(timeout=120)
        kept = await job.latest()
    assert kept is not None and kept.terminal
    acked = await _events(url, home)

    first.cut()
    ups.remove(first)
    dropped = lazy.drop()

    again = PoweredUp(tmp_path, "again", port, store, home)
    ups.append(again)
    await asyncio.to_thread(again.wait_running)
    after = await _events(url, home)
    assert after[:len(acked)] == acked, (f"{len(acked)} events acknowledged before the cut, "
                                         f"{len(after)} after it (the cut dropped {dropped})")
    async with Client(url, creds=client_creds, timeout=10) as c:
        status = await (await c.job(job.request_id, str(model))).latest()
        assert status is not None and status.status == kept.status and status.result == kept.result
        # The replica died in the cut: the cluster notices, loads it again and serves.
        assert await (await c.submit(str(model), PAYLOAD)).result(timeout=240) == before
