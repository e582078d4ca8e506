"""Shared fixtures: a real nats-server per test module (port 0, temp store), fresh streams per test."""

from __future__ import annotations

import asyncio
import faulthandler
import os
import pathlib
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.tasks import awaiting
from controlplane.store.eventstore import JetStreamEventLog
from schemas.subjects import EVENTS_STREAM, FACTS_STREAM, REQUESTS_STREAM, SNAPSHOTS_BUCKET

# Credentials `ndif up` may have left in a developer's $NDIF_HOME must not reach the tests' servers
# (their commands find credentials there): each session gets an empty home of its own.
os.environ["NDIF_HOME"] = tempfile.mkdtemp(prefix="ndif-test-home-")
os.environ.pop("NDIF_CREDS", None)
# The tests' checkpoints live in temp dirs (tmp_path): their controllers offer those to requests. The
# tests of the model roots themselves give a controller its own (controlplane/service/registry.py).
os.environ["NDIF_MODEL_ROOTS"] = tempfile.gettempdir()
# Each test process keeps its Ray under a root of its own: `--ray-address auto` (the agent's default)
# finds the cluster of that root only, so an agent a test starts joins this process's Ray, never a
# developer's nor another pytest worker's. Short: Ray's socket paths must fit 107 bytes.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="r", dir="/tmp")

EXIT_GRACE_S = 120
_exit_status = 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the long fault tests (marker `long`; CI runs them as a step of their own)")


# Markers by directory: what needs a real nats-server (and Ray) is `integration`, the browser test
# `e2e`, so `-m "not integration and not e2e"` is the pure, fast set.
INTEGRATION_DIRS = ("integration", "dataplane", "faults")
E2E_DIRS = ("e2e",)


def _tests_dir(item: pytest.Item) -> str:
    parts = item.path.relative_to(pathlib.Path(__file__).parent).parts
    return parts[0] if len(parts) > 1 else ""


def _needs_nats(item: pytest.Item) -> bool:
    """A test outside those directories that still talks to a real server: it asks for one (a
    fixture), or is a contract case run against JetStream."""
    callspec = getattr(item, "callspec", None)
    return "nats_server" in getattr(item, "fixturenames", ()) or (
        callspec is not None and "jetstream" in callspec.params.values())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        where = _tests_dir(item)
        if where in E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
        elif where in INTEGRATION_DIRS or _needs_nats(item):
            item.add_marker(pytest.mark.integration)
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long fault test: run with --long (CI: `python -m pytest -q --long -m long`)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The results are in: if shutting down (Ray, threads, atexit) hangs, dump stacks and exit anyway."""

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(f"\npytest finished but the process did not exit within {EXIT_GRACE_S}s; stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(_exit_status or 1)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


async def bounded(aw: Any, what: str, timeout: float = 30.0) -> None:
    """Await a teardown step; if it hangs, show where every asyncio task waits and fail (never hang)."""
    step = asyncio.ensure_future(aw)
    await asyncio.wait([step], timeout=timeout)
    if not step.done():
        dump_tasks(f"teardown step {what!r}")
        step.cancel()
        raise AssertionError(f"teardown step {what!r} did not finish within {timeout}s (tasks above)")
    step.result()


def dump_tasks(why: str) -> None:
    """Where every asyncio task waits (the chain of awaits, not just each task's own frame), on stderr."""
    sys.stderr.write(f"--- asyncio tasks ({why}):\n")
    for t in asyncio.all_tasks():
        sys.stderr.write(f"  {t.get_name()}: {awaiting(t)}\n")


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    srv = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def local_ray() -> Iterator[str]:
    """One local Ray for the test process (2 declared GPUs, 2 CPUs), started on first use: starting one
    takes seconds. Modules clean up their replica actors (tests/dataplane/conftest.py `kill_all_actors`)."""
    from dataplane.runtime import ray_adapter  # imported here: the pure tests never load Ray

    gcs = ray_adapter.start_local(2, num_cpus=2)
    try:
        yield gcs
    finally:
        ray_adapter.shutdown()


async def fresh_event_log(url: str) -> JetStreamEventLog:
    """A connected log on empty streams and no snapshots (the streams are dropped and re-made)."""
    log = await JetStreamEventLog.open(url, ensure=False)
    # the facts stream too: a new log would source every fact still in it
    for stream in (EVENTS_STREAM, FACTS_STREAM, REQUESTS_STREAM, f"OBJ_{SNAPSHOTS_BUCKET}"):
        try:
            await log.js.delete_stream(stream)
        except Exception:  # noqa: BLE001 - absent on the first test
            pass
    await log.ensure(start_new_history=True)  # dropped on purpose: not a lost history
    return log


@pytest_asyncio.fixture
async def event_log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    log = await fresh_event_log(nats_server.url)
    yield log
    await log.close()
