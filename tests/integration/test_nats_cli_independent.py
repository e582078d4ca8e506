"""docs/nats-cli.md's commands, checked with an independent NATS client: nats.js (tests/integration/
natsjs_cli.js) reads the `nats` contexts `ndif up` writes (url, user, password, inbox_prefix,
jetstream_api_prefix) as the `nats` CLI does, against a real server with users, and does what the
doc's commands do for each role: the admin views the event stream (JSON bodies, the documented
headers) and its subjects; a client follows its own statuses live, reads its own kept status from
the KV bucket, and is refused everyone's statuses, another user's kept status and the event stream;
the dashboard reads an event by direct get and is refused a consumer on the stream.

nats.js is installed into `.cache/natsjs` (ignored) on first use; .ci/run installs it too. Without
node and npm the test is skipped (CI has both: .ci/run checks)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from controlplane.ops.auth import ensure_local
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from dataplane.client import Client, RequestFailed
from dataplane.node.agent import declared_gpus
from dataplane.ops.local import LocalCluster
from dataplane.serving.dispatcher import Dispatcher
from schemas.subjects import EVENTS_STREAM, REQUEST_STATUS_BUCKET
from tests.conftest import bounded

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
NATSJS = ROOT / ".cache" / "natsjs"
NATSJS_VERSION = "2.29.3"
SCRIPT = Path(__file__).with_name("natsjs_cli.js")
NODE = "node-js"


@pytest.fixture(scope="session")
def natsjs() -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the independent (nats.js) client cannot run here")
    if not (NATSJS / "node_modules" / "nats" / "package.json").exists():
        subprocess.run(["npm", "install", "--prefix", str(NATSJS), f"nats@{NATSJS_VERSION}", "--no-audit", "--no-fund"],
                       check=True, capture_output=True, timeout=300)
    got = json.loads((NATSJS / "node_modules" / "nats" / "package.json").read_text())["version"]
    assert got == NATSJS_VERSION, got
    return NATSJS


async def natsjs_run(natsjs: Path, steps: list[dict[str, Any]], *, ready: asyncio.Event | None = None) -> list[Any]:
    proc = await asyncio.create_subprocess_exec("node", str(SCRIPT), str(natsjs), json.dumps(steps),
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None and proc.stdout is not None
    err: list[str] = []
    while line := await asyncio.wait_for(proc.stderr.readline(), 150):  # silent while its steps run
        err.append(line.decode())
        if line.strip() == b"READY" and ready is not None:
            ready.set()
    out = await asyncio.wait_for(proc.stdout.read(), 30)
    assert await proc.wait() == 0, "".join(err)
    results: list[Any] = json.loads(out)
    return results


async def _until_ready(ready: asyncio.Event, run: asyncio.Task[Any], timeout_s: float = 60) -> None:
    """Wait for the client's subscriptions, or its end: a client that ended first says why (its
    stderr, in the task's error) rather than a bare timeout."""
    waiting = asyncio.create_task(ready.wait())
    try:
        await asyncio.wait({waiting, run}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not ready.is_set():
        if run.done():
            raise AssertionError(f"the nats.js client ended before its subscriptions were in place: {run.result()!r}")
        raise TimeoutError(f"the nats.js client was not subscribed within {timeout_s} s")


async def test_the_docs_nats_commands_work_with_an_independent_client(natsjs: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    auth = ensure_local([NODE], clients=["alice", "bob"], home=home)
    cluster = LocalCluster(store=tmp_path / "store", gpus=declared_gpus(1, 10**9), node_id=NODE, auth=auth,
                           dispatcher=False)
    cluster.start_nats()
    ctx = {p.stem: str(p) for p in (home / "auth" / "nats-context").glob("*.json")}
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    try:
        await cluster.ensure_log()
        url = cluster.url
        ctl = await Controller.from_url(url, creds=auth.role("controller")).start()
        disp = await Dispatcher.from_url(url, creds=auth.role("dispatcher")).start()
        admin = await AdminClient.open(url, timeout=30, creds=auth.role("admin"))
        try:
            res = await admin.deploy(str(model), 1, size_bytes=10**6)  # no node: registered, placement refused
            assert res.first_seq, res

            # alice follows her statuses live (and is refused everyone's) while she submits
            ready = asyncio.Event()
            live = asyncio.create_task(natsjs_run(natsjs, [
                {"ctx": ctx["client-alice"], "op": "sub", "subject": "ndif.status.alice.>", "count": 20, "seconds": 20,
                 "until": "ERROR"},
                {"ctx": ctx["client-alice"], "op": "sub", "subject": "ndif.status.>", "count": 1, "seconds": 3},
            ], ready=ready))
            await _until_ready(ready, live)
            async with Client(url, creds=auth.role("client:alice")) as alice:
                job = await alice.submit(str(tmp_path / "missing"), {"op": "forward", "input_ids": [[1]]})
                with pytest.raises(RequestFailed):
                    await job.result(timeout=30)
                rid = job.request_id
            mine, everyone = await live
            assert mine["ok"], mine
            assert {m["subject"] for m in mine["messages"]} == {f"ndif.status.alice.{rid}"}, mine
            assert mine["messages"][-1]["body"]["status"] == "ERROR" and mine["messages"][-1]["body"]["user"] == "alice"
            assert not everyone["ok"] and "permissions violation" in everyone["error"].lower(), everyone

            admin_view, admin_subjects, own, other, alice_view, dash_get, dash_view = await natsjs_run(natsjs, [
                {"ctx": ctx["admin"], "op": "view", "stream": EVENTS_STREAM, "count": 50},
                {"ctx": ctx["admin"], "op": "subjects", "stream": EVENTS_STREAM, "filter": "ndif.evt.>"},
                {"ctx": ctx["client-alice"], "op": "kv_get", "bucket": REQUEST_STATUS_BUCKET, "key": f"alice.{rid}"},
                {"ctx": ctx["client-alice"], "op": "kv_get", "bucket": REQUEST_STATUS_BUCKET, "key": f"bob.{rid}"},
                {"ctx": ctx["client-alice"], "op": "view", "stream": EVENTS_STREAM, "count": 1},
                {"ctx": ctx["dashboard"], "op": "direct_get", "stream": EVENTS_STREAM, "seq": 1},
                {"ctx": ctx["dashboard"], "op": "view", "stream": EVENTS_STREAM, "count": 1},
            ])
        finally:
            await bounded(admin.close(), "admin.close")
            await bounded(disp.stop(), "dispatcher.stop")
            await bounded(ctl.stop(), "controller.stop")
    finally:
        await cluster.stop()

    # the admin: `nats stream view NDIF_EVENTS`, JSON bodies and the documented headers
    assert admin_view["ok"], admin_view
    msgs = admin_view["messages"]
    assert [m["seq"] for m in msgs] == list(range(1, len(msgs) + 1)) and len(msgs) >= 3, msgs
    for m in msgs:
        body, h = m["body"], m["headers"]
        assert m["subject"].startswith("ndif.evt."), m
        assert h["Nats-Msg-Id"] == body["event_id"] and h["Ndif-Event"] == body["type"] and h["Ndif-Schema"] == "1", m
        assert {"type", "event_id", "ts", "actor", "model_key", "command_id", "correlation_id", "schema"} <= set(body)
    decided = next(m for m in msgs if m["body"]["type"] == "CommandDecided")
    assert decided["body"]["model_key"] == {"repo_id": str(model)}, decided
    batch = [m for m in msgs if m["headers"].get("Nats-Batch-Id") == decided["headers"].get("Nats-Batch-Id")]
    assert decided["headers"]["Nats-Batch-Sequence"] == "1" and batch[-1]["headers"].get("Nats-Batch-Commit") == "1", batch
    # `nats stream subjects NDIF_EVENTS 'ndif.evt.>'`
    assert admin_subjects["ok"] and sum(admin_subjects["subjects"].values()) == len(msgs), admin_subjects

    # a client: its own kept status (`nats kv get ndif_request_status alice.<id>`), not bob's key, not the events
    assert own["ok"] and own["entry"]["key"] == f"alice.{rid}", own
    assert own["entry"]["value"]["status"] == "ERROR" and own["entry"]["value"]["request_id"] == rid, own
    assert not other["ok"] and "permissions violation" in other["error"].lower(), other
    assert not alice_view["ok"] and "permissions violation" in alice_view["error"].lower(), alice_view

    # the dashboard: an event by direct get, but no consumer on the stream (`nats stream view` is refused)
    assert dash_get["ok"] and dash_get["message"]["body"] == msgs[0]["body"], dash_get
    assert not dash_view["ok"] and "permissions violation" in dash_view["error"].lower(), dash_view
