"""Shared fixtures: a real nats-server per test module (port 0, temp store), fresh streams per test,
one local Ray per test process; and how the suite is laid out on pytest-xdist's workers."""

from __future__ import annotations

import asyncio
import enum
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
from hypothesis import settings

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.tasks import awaiting
from controlplane.store.eventstore import JetStreamEventLog
from schemas.subjects import EVENTS_STREAM, FACTS_STREAM, REFUSED_STREAM, REQUESTS_STREAM, SNAPSHOTS_BUCKET
from tests.checkpoints import TinyModels, shared_root

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

# Hypothesis: a property of pure code keeps its own example count (full strength, every profile); a
# property test against a live server proves the wiring, with `live_settings`'s fewer examples under
# the profile CI names (`--hypothesis-profile ci`, README's test command).
settings.register_profile("ci", print_blob=True)
LIVE_WIRING_EXAMPLES = 20


def live_settings(full: int, **kw: Any) -> settings:
    """Settings for a live-server property test: `full` examples, or LIVE_WIRING_EXAMPLES under `ci`."""
    n = LIVE_WIRING_EXAMPLES if settings.get_current_profile_name() == "ci" else full
    return settings(max_examples=n, deadline=None, **kw)


EXIT_GRACE_S = 120
_exit_status = 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the long fault tests (marker `long`; README's test command does)")


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


# Workers (`-n 2 --dist loadgroup`): every module with a test that starts Ray, in this process
# (`local_ray`) or in a process it runs (`starts_ray`: `ndif up`, `ray start`, a probe), is in the
# group "ray", which one worker runs in order, so no two Ray clusters ever run at once; the long
# modules without Ray (minutes of several servers each) are the group "long", one at a time; every
# other module is a group, so its module-scoped stack starts once and its tests meet one another's
# state in file order, as in one process.
RAY_GROUP, LONG_GROUP = "ray", "long"


class RayUse(enum.IntEnum):
    """What a module's tests do with Ray, in the order the group "ray" runs them."""

    NONE = 0
    LOCAL = 1  # this process's Ray (`local_ray`)
    OWN = 2  # a Ray of its own, in a process it runs (`starts_ray`), which stops this process's first


def _ray_use(item: pytest.Item) -> RayUse:
    names = getattr(item, "fixturenames", ())
    return RayUse.OWN if "starts_ray" in names else RayUse.LOCAL if "local_ray" in names else RayUse.NONE


def _group(item: pytest.Item, use: RayUse) -> str:
    if use is not RayUse.NONE:
        return RAY_GROUP
    return LONG_GROUP if "long" in item.keywords else item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups from the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules: dict[pathlib.Path, set[RayUse]] = {}
    for item in items:
        modules.setdefault(item.path, set()).add(_ray_use(item))
    mixed = [str(path) for path, uses in modules.items() if {RayUse.LOCAL, RayUse.OWN} <= uses]
    if mixed:
        raise pytest.UsageError(f"{mixed[0]}: a module's tests use either `local_ray` or `starts_ray`, not both")
    use = {path: max(uses) for path, uses in modules.items()}
    grouping = config.pluginmanager.hasplugin("xdist")
    for item in items:
        where = _tests_dir(item)
        if where in E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
        elif where in INTEGRATION_DIRS or _needs_nats(item):
            item.add_marker(pytest.mark.integration)
        if grouping:
            item.add_marker(pytest.mark.xdist_group(_group(item, use[item.path])))
    # The modules on this process's Ray first, then those that start their own: one start and one
    # stop of this process's Ray per run. A stable sort keeps each module's tests in file order.
    items.sort(key=lambda it: use[it.path])
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long fault test: run with --long (README's test command does)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker: refuse a run that would start Ray in two workers at once, because it was not
    `--dist loadgroup` or because the groups did not take (xdist names a grouped test `id@group`)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    ray = [it.nodeid for it in session.items if _ray_use(it) is not RayUse.NONE]
    if not getattr(session.config.option, "loadgroup", False):
        why = f"{len(ray)} tests start Ray (e.g. {ray[0]}): run them with `--dist loadgroup`" if ray else ""
    else:
        lost = [it.nodeid for it in session.items if (m := it.get_closest_marker("xdist_group"))
                and not it.nodeid.endswith(f"@{m.args[0]}")]
        why = (f"--dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): pytest-xdist does not "
               "work with this pytest (pyproject.toml's dev extra pins one that does)") if lost else ""
    if why:
        os.write(2, f"\n{why}\n".encode())  # a worker's own report would be lost in xdist's INTERNALERROR
        pytest.exit(why, pytest.ExitCode.USAGE_ERROR)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The results are in: if shutting down (Ray, threads, atexit) hangs, dump stacks and exit anyway.
    Not in an xdist worker: it waits for the controller, which ends its workers itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return

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
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """The run's tiny checkpoints, copied where a test wants one (tests/checkpoints.py)."""
    return TinyModels(shared_root(tmp_path_factory))


class RayHost:
    """This process's one local Ray (2 declared GPUs, 2 CPUs), started on first use (it takes seconds)
    and kept for every module that asks, until a test that starts a Ray of its own needs it gone."""

    def __init__(self) -> None:
        self.gcs: str | None = None

    def up(self) -> str:
        from dataplane.runtime import ray_adapter  # imported here: the pure tests never load Ray

        if self.gcs is None:
            self.gcs = ray_adapter.start_local(2, num_cpus=2)
        return self.gcs

    def down(self) -> None:
        if self.gcs is not None:
            from dataplane.runtime import ray_adapter

            ray_adapter.shutdown()
            self.gcs = None


@pytest.fixture(scope="session")
def ray_host() -> Iterator[RayHost]:
    host = RayHost()
    try:
        yield host
    finally:
        host.down()


@pytest.fixture(scope="module")
def local_ray(ray_host: RayHost) -> str:
    """The GCS address of this process's Ray. Modules clean up their replica actors
    (tests/dataplane/conftest.py `kill_all_actors`)."""
    return ray_host.up()


@pytest.fixture(scope="module")
def starts_ray(ray_host: RayHost) -> None:
    """For a module whose tests start Ray in a process they run (`ndif up`, `ray start`): it puts them
    in the group "ray" (one Ray cluster at a time on this machine) and stops this process's Ray first."""
    ray_host.down()


async def fresh_event_log(url: str) -> JetStreamEventLog:
    """A connected log on empty streams and no snapshots (the streams are dropped and re-made)."""
    log = await JetStreamEventLog.open(url, ensure=False)
    # the facts stream and the gate's refusals too: a new log is a new history of facts
    for stream in (EVENTS_STREAM, FACTS_STREAM, REFUSED_STREAM, REQUESTS_STREAM, f"OBJ_{SNAPSHOTS_BUCKET}"):
        try:
            await log.js.delete_stream(stream)
        except Exception:  # noqa: BLE001 - absent on the first test
            pass
    await log.ensure(start_new_history=True)  # dropped on purpose: not a lost history
    return log


@pytest_asyncio.fixture
async def event_log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    """A fresh log with a fact gate running (what a controller runs): observed facts reach it."""
    from controlplane.service.factgate import fact_gate

    log = await fresh_event_log(nats_server.url)
    async with fact_gate(log):
        yield log
    await log.close()


@pytest_asyncio.fixture
async def ungated_event_log(nats_server: EmbeddedNats) -> AsyncIterator[JetStreamEventLog]:
    """A fresh log with no fact gate (no controller): observed facts wait in NDIF_FACTS."""
    log = await fresh_event_log(nats_server.url)
    yield log
    await log.close()
