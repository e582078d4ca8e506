"""`ndif` output that lands in pipes and files: real nats-server, the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.eventstore import JetStreamEventLog
from schemas.events import GpuInfo, NodeJoined

pytestmark = pytest.mark.timeout(120)


def joined(node: str) -> NodeJoined:
    return NodeJoined(event_id=f"join-{node}", ts=datetime.now(UTC), actor=f"agent:{node}", node_id=node,
                      gpus=(GpuInfo(index=0, memory_bytes=2**30),), cpu_cache_bytes=2**30)


async def test_status_watch_into_a_pipe_writes_no_screen_codes(nats_server: EmbeddedNats,
                                                               event_log: JetStreamEventLog) -> None:
    await event_log.append([joined("node-a")], None)  # an agent's fact: unguarded (NDIF_FACTS)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "status", "--watch", "--nats", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NDIF_LOG_LEVEL": "WARNING"})
    assert proc.stdout is not None
    try:
        out = b""

        async def read_until(text: bytes) -> None:
            nonlocal out
            while text not in out:
                chunk = await proc.stdout.read(4096)  # type: ignore[union-attr]
                assert chunk, f"ndif status --watch ended: {out!r} {await proc.stderr.read()!r}"  # type: ignore[union-attr]
                out += chunk

        async with asyncio.timeout(60):
            await read_until(b"cluster at seq 1")
            await event_log.append([joined("node-b")], None)
            await read_until(b"cluster at seq 2")
    finally:
        proc.terminate()
        await proc.wait()
    text = out.decode()
    assert "cluster at seq 1" in text and "node-b" in text.split("cluster at seq 2")[1]
    assert "\x1b" not in text  # no clear-screen / cursor codes in a pipe


async def test_a_reader_that_goes_away_is_not_a_crash(nats_server: EmbeddedNats, event_log: JetStreamEventLog) -> None:
    """`ndif status | head`: the pipe closes before ndif writes; no traceback, the SIGPIPE status 141."""
    if await event_log.last_seq() == 0:
        await event_log.append([joined("node-b")], None)
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before ndif writes a byte
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "status", "--nats", nats_server.url,
        stdout=write_fd, stderr=asyncio.subprocess.PIPE, env={**os.environ, "NDIF_LOG_LEVEL": "WARNING"})
    os.close(write_fd)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 141, (proc.returncode, err.decode()[-2000:])
    assert b"Traceback" not in err, err.decode()[-2000:]


async def append_gated(url: str, fact: NodeJoined, *, ensure: bool) -> None:
    """An agent's fact into the log through a fact gate of this test's own (no controller runs)."""
    from controlplane.service.factgate import fact_gate

    log = await JetStreamEventLog.open(url, ensure=ensure)
    try:
        async with fact_gate(log):
            await log.append([fact], None)
    finally:
        await log.close()


async def test_status_watch_outlives_an_outage_and_comes_back(tmp_path: Path) -> None:
    """The cluster stops under `status --watch`: one line says so, no traceback, the watch stays;
    the cluster starts again on its store and the view follows the log again."""
    srv = EmbeddedNats(tmp_path / "nats").start()
    try:
        await append_gated(srv.url, joined("node-a"), ensure=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dataplane.ops.cli", "status", "--watch", "--nats", srv.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ})
        assert proc.stdout is not None and proc.stderr is not None
        out, err = b"", b""

        async def read(stream: asyncio.StreamReader, text: bytes, seen: bytes) -> bytes:
            while text not in seen:
                chunk = await stream.read(4096)
                assert chunk, f"ndif status --watch ended ({proc.returncode}): {out!r} {err!r}"
                seen += chunk
            return seen

        try:
            async with asyncio.timeout(90):
                out = await read(proc.stdout, b"cluster at seq 1", out)
                srv.stop()
                err = await read(proc.stderr, b"the cluster is unreachable since", err)
                await asyncio.sleep(4)  # several ticks with the cluster down: still one line, still running
                assert proc.returncode is None
                srv.start()
                await append_gated(srv.url, joined("node-b"), ensure=False)
                out = await read(proc.stdout, b"cluster at seq 2", out)
                err = await read(proc.stderr, b"the cluster is back after", err)
        finally:
            proc.terminate()
            rest_out, rest_err = await proc.communicate()
        out, err = out + rest_out, err + rest_err
        assert b"Traceback" not in err and err.count(b"unreachable") == 1, err.decode()[-3000:]
        assert b"nats_error" not in err, err.decode()[-3000:]  # the watch's own line, not a dozen warnings
        assert "node-b" in out.decode().split("cluster at seq 2")[1]
    finally:
        srv.close()
