"""Shared fixtures: a real nats-server per test module (port 0, temp store), fresh streams per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from controlplane.eventstore import JetStreamEventLog
from controlplane.nats_server import EmbeddedNats
from schemas.subjects import EVENTS_STREAM, REQUESTS_STREAM


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.close()


async def fresh_event_log(url: str) -> JetStreamEventLog:
    """A connected log on empty streams (the streams are dropped and re-made)."""
    log = await JetStreamEventLog.open(url, ensure=False)
    for stream in (EVENTS_STREAM, REQUESTS_STREAM):
        try:
            await log.js.delete_stream(stream)
        except Exception:  # noqa: BLE001 - absent on the first test
            pass
    await log.ensure()
    return log


@pytest_asyncio.fixture
async def event_log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    log = await fresh_event_log(nats_server.url)
    yield log
    await log.close()
