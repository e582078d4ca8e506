"""`ndif up` as an operator runs it: real subprocesses, real nats-server, real local Ray.

Its default users are made on the first start (files 0600) and kept on the next, and the CLI in
another shell finds them by itself; without them the server refuses. A second `ndif up` on a port
in use fails in one line (exit 5) and appends nothing; `kill -9` of `ndif up` leaves no process of
it behind; a machine without GPUs is warned about; `ndif status` shows the heartbeat's age and marks
a dead node stale. The tests that only read what an `ndif up` prints and does share one (`shared`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.ops.nats_server import free_port, stop_process
from controlplane.store.credentials import creds_file, load_creds
from controlplane.store.eventstore import JetStreamEventLog
from controlplane.store.heartbeats import STALE_S
from dataplane.node.watchdog import _start_time, descendants
from tests.checkpoints import TinyModels
from tests.integration.cluster import ndif, up_running

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("starts_ray")]  # `ndif up` starts its own Ray


class Up:
    """One `ndif up` subprocess; stdout/stderr go to files (a full pipe would block it)."""

    def __init__(self, tmp: Path, name: str, port: int, *args: str, store: str | None = None) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        # The home (its credentials) goes with the store: an `up` on the same store is the same deployment.
        self.home = tmp / f"{store or name}-home"
        env = {**os.environ, "NDIF_HOME": str(self.home)}
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dataplane.ops.cli", "up", "--port", str(port), "--store",
                 str(tmp / f"{store or name}-store"), "--heartbeat", "0.5", *args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)

    def wait_running(self, timeout: float = 180.0) -> None:
        up_running(self.proc, self.out, self.err, timeout)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT, 60)


@pytest.fixture(scope="class")
def shared(tmp_path_factory: pytest.TempPathFactory, starts_ray: None) -> Iterator[tuple[Up, str, int]]:
    """One `ndif up` (no --gpus on a CPU machine: warned, not silent) for the tests of `TestOneUp`,
    which only read it: it, its URL and its port. Stopped before the tests that start their own
    (one Ray on the machine at a time)."""
    port = free_port()
    up = Up(tmp_path_factory.mktemp("shared"), "shared", port, "--snapshot-every", "2")
    try:
        up.wait_running()
        yield up, f"nats://127.0.0.1:{port}", port
    finally:
        up.stop()


@pytest.fixture
def ups(tmp_path: Path) -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for u in started:
        u.stop()


def started(tmp_path: Path, ups: list[Up], name: str, *args: str) -> tuple[Up, str, int]:
    """An `ndif up` on a free port (stopped at the end of the test): it, its URL and its port."""
    port = free_port()
    up = Up(tmp_path, name, port, *args)
    ups.append(up)
    return up, f"nats://127.0.0.1:{port}", port


@contextlib.asynccontextmanager
async def _admin_log(url: str, home: Path) -> AsyncIterator[JetStreamEventLog]:
    """The event log as the admin of the `ndif up` whose home is `home`."""
    log = await JetStreamEventLog.open(url, ensure=False, creds=load_creds(creds_file("admin", home=home)))
    try:
        yield log
    finally:
        await log.close()


async def _last_seq(url: str, home: Path) -> int:
    async with _admin_log(url, home) as log:
        return int((await log.js.stream_info("NDIF_EVENTS")).state.last_seq)


class TestOneUp:
    """What one `ndif up` prints and does, read by each test; none changes it."""

    async def test_up_makes_users_on_its_first_start_and_local_commands_use_them(
            self, shared: tuple[Up, str, int], tmp_path: Path) -> None:
        up, url, _ = shared
        auth = up.home / "auth"
        assert (auth / "admin.creds").exists() and (auth / "nats-auth.conf").exists()
        # files 0600; the directory of `nats` CLI contexts 0700 (its files 0600)
        assert all((f.stat().st_mode & 0o777) == (0o700 if f.is_dir() else 0o600) for f in auth.rglob("*"))
        ran = await ndif(url, "status", env={"NDIF_HOME": str(up.home)})
        assert ran.rc == 0 and "NODES" in ran.out, ran.out + ran.err
        ran = await ndif(url, "status", env={"NDIF_HOME": str(tmp_path / "elsewhere")})  # no credentials: refused
        assert ran.rc != 0 and "requires a user and none was found" in ran.err, ran.err

    async def test_up_snapshots_its_fold_as_its_flag_says(self, shared: tuple[Up, str, int]) -> None:
        """`ndif up --snapshot-every 2`: its controller stores a snapshot once the log has 2 events
        (its node's join and declaration) and more."""
        up, url, _ = shared
        async with _admin_log(url, up.home) as log:
            deadline = time.monotonic() + 30
            while not await log.snapshot_names() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            names = await log.snapshot_names()
        assert names, "no snapshot stored"
        ran = await ndif(url, "status", env={"NDIF_HOME": str(up.home)})  # folds from it
        assert ran.rc == 0, ran.err

    async def test_no_secret_in_its_log(self, shared: tuple[Up, str, int]) -> None:
        """Its log lines (stderr, INFO) name the dashboard's address, never its token."""
        up, _, _ = shared
        token = (up.home / "auth" / "dashboard.token").read_text().strip()
        log = up.err.read_text()
        assert "dashboard_started" in log and len(token) >= 16 and token not in log

    async def test_a_second_up_on_a_port_in_use_fails_in_one_line_and_appends_nothing(
            self, shared: tuple[Up, str, int], tmp_path: Path, ups: list[Up]) -> None:
        first, url, port = shared
        assert "no GPU found" in first.err.read_text() and "--gpus N" in first.err.read_text()
        before = await _last_seq(url, first.home)
        await asyncio.sleep(1.0)
        assert await _last_seq(url, first.home) == before  # quiet now: nothing appends on its own

        second = Up(tmp_path, "second", port, "--gpus", "1")
        ups.append(second)  # stopped at the end should it wrongly come up
        rc = await asyncio.to_thread(second.proc.wait, 120)
        err = second.err.read_text().strip().splitlines()
        assert rc == 5, (rc, err)
        assert len(err) == 1 and err[0].startswith("error: cannot start nats-server on port"), err
        assert "address already in use" in err[0] and "try --port" in err[0]
        assert "running" not in second.out.read_text()
        assert await _last_seq(url, first.home) == before  # it has exited: whatever it appended is in

        status = (await ndif(url, "status", "--json", env={"NDIF_HOME": str(first.home)})).json()
        assert [n["node_id"] for n in status["nodes"]] == [socket.gethostname()]
        assert status["nodes"][0]["stale"] is False and status["nodes"][0]["heartbeat_age_s"] < 3


async def test_kill_9_of_up_leaves_no_process_behind_and_status_marks_the_node_stale(
        tmp_path: Path, ups: list[Up]) -> None:
    up, url, port = started(tmp_path, ups, "up", "--gpus", "1")
    await asyncio.to_thread(up.wait_running)
    await asyncio.sleep(2.0)  # Ray's helper agents are up by now, and the watchdog has seen them
    kids = descendants(up.proc.pid)
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:80] for p in kids}
    assert any(b"nats-server" in n for n in names.values()) and any(b"raylet" in n for n in names.values())

    # The node's heartbeat is fresh while it runs.
    status = (await ndif(url, "status", "--json", env={"NDIF_HOME": str(up.home)})).json()
    assert status["nodes"][0]["stale"] is False

    up.proc.kill()
    up.proc.wait()
    killed_at = time.monotonic()
    deadline = time.monotonic() + 30
    while (alive := {p: names[p] for p, st in kids.items() if _start_time(p) == st}) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert not alive, alive  # nats-server, Ray's processes and its agents went with `ndif up`

    # The same store under a new server: the log still says the node is up, its heartbeat says otherwise.
    again = Up(tmp_path, "again", port, "--gpus", "1", "--node-id", "other", store="up")
    ups.append(again)
    await asyncio.to_thread(again.wait_running)
    # Stale means no beat for more than STALE_S: on a fast machine `again` is up sooner than that.
    async with asyncio.timeout(STALE_S + 60):
        while True:
            ran = await ndif(url, "status", "--json", env={"NDIF_HOME": str(up.home)})
            nodes = {n["node_id"]: n for n in ran.json()["nodes"]}
            if nodes[socket.gethostname()]["stale"] or time.monotonic() > killed_at + STALE_S + 5:
                break
            await asyncio.sleep(0.5)
    assert nodes["other"]["stale"] is False
    hb: Any = nodes[socket.gethostname()]
    assert hb["alive"] is True and hb["stale"] is True and (hb["heartbeat_age_s"] is None or hb["heartbeat_age_s"] > 6)
    ran = await ndif(url, "status", env={"NDIF_HOME": str(up.home)})
    line = next(ln for ln in ran.out.splitlines() if ln.startswith(socket.gethostname()))
    assert "STALE" in line, ran.out


async def _events(url: str, home: Path) -> list[tuple[int, bytes]]:
    """Every stored event as (seq, its encoded body): what the log acknowledged, byte for byte."""
    import msgspec

    async with _admin_log(url, home) as log:
        return [(seq, msgspec.json.encode(item)) async for batch in log.read_batches() for seq, item in batch]


async def test_a_second_up_on_the_same_home_refuses_before_opening_the_store_and_the_log_keeps_what_it_acked(
        tmp_path: Path, ups: list[Up], tiny_models: TinyModels) -> None:
    first, url, port = started(tmp_path, ups, "first", "--gpus", "1")
    model = await asyncio.to_thread(tiny_models.gpt2, tmp_path / "models" / "tiny-gpt2")
    await asyncio.to_thread(first.wait_running)
    ran = await ndif(url, "deploy", str(model), "--replicas", "1", env={"NDIF_HOME": str(first.home)})
    assert ran.rc == 0, ran.err
    acked = await _events(url, first.home)
    assert acked

    # The hint an operator follows after "port in use": another port, the same home (and so the same store).
    second = Up(tmp_path, "second", free_port(), "--gpus", "1", store="first")
    ups.append(second)
    rc = await asyncio.to_thread(second.proc.wait, 120)
    err = second.err.read_text().strip().splitlines()
    assert rc == 5, (rc, err)
    assert len(err) == 1 and "is in use by another cluster" in err[0] and f"pid {first.proc.pid}" in err[0], err
    assert "NDIF_HOME" in err[0] and "--port" in err[0]
    assert (await _events(url, first.home))[:len(acked)] == acked

    # After a restart of the first cluster, its log holds exactly what it acknowledged, and its users
    # are the ones its first start made (the local commands still find theirs).
    creds = (first.home / "auth" / "admin.creds").read_bytes()
    first.stop()
    again = Up(tmp_path, "again", port, "--gpus", "1", store="first")
    ups.append(again)
    await asyncio.to_thread(again.wait_running)
    assert (await _events(url, first.home))[:len(acked)] == acked
    assert (again.home / "auth" / "admin.creds").read_bytes() == creds
    ran = await ndif(url, "status", env={"NDIF_HOME": str(again.home)})
    assert ran.rc == 0, ran.err
