"""`ndif` output that lands in pipes and files: real nats-server, the CLI as a subprocess."""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import UTC, datetime

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
