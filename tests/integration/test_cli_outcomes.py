"""Every command tells the truth: the `ndif` CLI as a subprocess against a real
nats-server, a real controller and the scripted node agent.

Exit codes and `--json` say what happened: a short placement is not a success, a reused command id
is never a second command, a failed replica is restarted for real, replay never waits for a
sequence the log does not have, undeploy forgets a model, and counts are bounded before placement.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from controlplane.store.eventstore import JetStreamEventLog
from schemas.commands import CommandResult
from schemas.events import Event
from schemas.keys import canonical_model_key
from schemas.status import ReplicaState as S
from schemas.subjects import model_token
from tests.agent_sim import GB, ScriptedAgent
from tests.conftest import bounded
from tests.integration.cluster import by_id, config_only, model_row, ndif, settle

pytestmark = pytest.mark.timeout(240)


class Cluster:
    def __init__(self, *parts: Controller | ScriptedAgent) -> None:
        self.parts = parts

    async def __aenter__(self) -> Cluster:
        for p in self.parts:
            await p.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for p in reversed(self.parts):
            await bounded(p.stop(), f"stop {type(p).__name__}")


def result(out: str) -> CommandResult:
    return msgspec.json.decode(out.splitlines()[0], type=CommandResult)


async def test_short_placement_exits_nonzero(nats_server: EmbeddedNats, admin: AdminClient, tiny: Path,
                                             tmp_path: Path) -> None:
    url = nats_server.url
    big, other = config_only(tmp_path, "big", tiny), config_only(tmp_path, "other", tiny)
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=1, gpu_bytes=80 * GB)):
        # Two 50 GiB replicas (57.5 charged) on one 80 GB card (74.5 GiB): one placed, one not -> partial (8).
        ran = await ndif(url, "deploy", big, "--replicas", "2", "--size-gib", "50", "--json")
        assert ran.rc == 8, (ran.rc, ran.out, ran.err)
        res = result(ran.out)
        assert not res.ok and (res.asked, res.placed) == (2, 1) and res.error == "PlacementError"
        assert res.last_seq > 0 and len(res.replicas) == 1 and res.rejections[0].replicas == 1
        assert "placed 1 of 2" in res.message
        # Nothing placed at all -> 7; the text form says so on stderr.
        ran = await ndif(url, "deploy", other, "--replicas", "1", "--size-gib", "50")
        assert ran.rc == 7, (ran.rc, ran.out, ran.err)
        assert "placed 0 of 1" in ran.out and "error: placed 0 of 1" in ran.err
        assert "`ndif evict`" in ran.err, ran.err  # the card is full: evicting would make room
        # Larger than any card could ever hold: the hint says no evict can help, not to evict.
        huge = config_only(tmp_path, "huge", tiny)
        ran = await ndif(url, "deploy", huge, "--size-gib", "575")
        assert ran.rc == 7 and "no eviction can make room" in ran.err and "`ndif evict`" not in ran.err, ran.err
        # A scale that falls short is the same; one that places everything is 0.
        ran = await ndif(url, "scale", big, "--replicas", "3", "--json")
        assert ran.rc == 7 and not result(ran.out).ok and result(ran.out).asked == 2
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--json")
        assert ran.rc == 0 and result(ran.out).ok and (result(ran.out).asked, result(ran.out).placed) == (1, 1)
        # A duplicate of a short command is as short as the first answer.
        ran = await ndif(url, "scale", big, "--replicas", "3", "--json", "--command-id", "short-1")
        again = await ndif(url, "scale", big, "--replicas", "3", "--json", "--command-id", "short-1")
        assert ran.rc == again.rc == 7 and result(again.out).duplicate and not result(again.out).ok


async def test_a_short_placement_on_nodes_without_gpus_names_the_gpus_flag(nats_server: EmbeddedNats,
                                                                            admin: AdminClient, tiny: Path,
                                                                            tmp_path: Path) -> None:
    url = nats_server.url
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-cpu", gpus=0)):
        ran = await ndif(url, "deploy", config_only(tmp_path, "nogpu", tiny), "--size-gib", "1")
        assert ran.rc == 7, (ran.rc, ran.out, ran.err)
        assert "no node has a GPU" in ran.err and "--gpus N" in ran.err and "`ndif evict`" not in ran.err, ran.err
        ran = await ndif(url, "deploy", config_only(tmp_path, "nogpu2", tiny), "--size-gib", "1", "--json")
        out = json.loads(ran.out.splitlines()[0])  # the same hint for a script
        assert ran.rc == 7 and not out["ok"] and "--gpus N" in out["hint"], (ran.rc, ran.out)


async def test_command_id_is_never_two_commands(nats_server: EmbeddedNats, admin: AdminClient,
                                                log: JetStreamEventLog, tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=2)):
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--command-id", "id-a", "--wait")
        assert ran.rc == 0, ran.err
        await settle(admin)
        # Same id, different payload: refused, exit 2, nothing appended.
        before = await log.last_seq()
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "2", "--command-id", "id-a")
        assert ran.rc == 2 and "already used for a different command" in ran.err, (ran.rc, ran.err)
        ran = await ndif(url, "evict", str(tiny), "--command-id", "id-a")
        assert ran.rc == 2 and "id-a" in ran.err
        assert await log.last_seq() == before

        # A no-op ("nothing to do") is recorded: one CommandDecided, and its id is remembered.
        ran = await ndif(url, "scale", str(tiny), "--replicas", "1", "--command-id", "id-b", "--json")
        assert ran.rc == 0, ran.err
        noop = result(ran.out)
        assert noop.ok and not noop.replicas and "nothing to do" in noop.message
        assert noop.first_seq == noop.last_seq == before + 1
        stored = [e async for _, e in admin.events(start_seq=noop.first_seq)]
        assert [type(e).__name__ for e in stored] == ["CommandDecided"] and stored[0].command_id == "id-b"
        # Later, the same id asking for more is another command: refused, never appended.
        ran = await ndif(url, "scale", str(tiny), "--replicas", "2", "--command-id", "id-b")
        assert ran.rc == 2 and "already used" in ran.err, (ran.rc, ran.err)
        # The same id and payload again: the first (no-op) answer, nothing appended.
        ran = await ndif(url, "scale", str(tiny), "--replicas", "1", "--command-id", "id-b", "--json")
        assert ran.rc == 0 and result(ran.out).duplicate and "nothing to do" in result(ran.out).message
        await settle(admin)
        assert await log.last_seq() == noop.last_seq
        assert sum(1 for _, e in [p async for p in log.read()]
                   if isinstance(e, Event) and e.command_id == "id-b") == 1
        st = await admin.state()
        assert st.replica_count(mk) == 1

        # Scale below the current count points to scale-down.
        await ndif(url, "scale", str(tiny), "--replicas", "2", "--wait")
        ran = await ndif(url, "scale", str(tiny), "--replicas", "1")
        assert ran.rc == 0 and "scale-down" in ran.out and "--replicas 1" in ran.out, ran.out


async def test_failed_replicas_restart_and_evict_truthfully(nats_server: EmbeddedNats, admin: AdminClient,
                                                            tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    failing = {"on": True}
    agent = ScriptedAgent(url, "node-a", gpus=2, load_delay_s=1.5, fail_loads=lambda m: failing["on"])
    async with Cluster(Controller.from_url(url), agent):
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--wait")
        assert ran.rc == 1 and "LoadFailed" in ran.out, (ran.rc, ran.out, ran.err)
        # The model whose only replica failed is not "hot 1"; the COLD replica shows no node/cards.
        status = (await ndif(url, "status", "--json")).json()
        assert model_row(status, mk)["hot"] == 0 and model_row(status, mk)["status"] == "Failed"
        r0 = by_id(status, mk)[0]
        assert (r0["state"], r0["level"], r0["node_id"], r0["gpu_indices"]) == ("LoadFailed", "COLD", "", [])
        assert r0["last_node_id"] == "node-a"
        text = (await ndif(url, "status")).out
        row = next(ln for ln in text.splitlines() if ln.startswith("/") and "Failed" in ln and "tiny-gpt2" in ln)
        assert row.split()[2] == "0", text  # hot
        rep = next(ln for ln in text.splitlines() if "LoadFailed" in ln)
        assert "node-a" not in rep, text

        # restart of the LoadFailed replica restarts it (same id), and --wait reports that load.
        failing["on"] = False
        ran = await ndif(url, "restart", str(tiny), "--replica-id", "0", "--wait", "--json")
        assert ran.rc == 0, (ran.rc, ran.out, ran.err)
        lines = ran.lines()
        assert [(r["replica_id"], r["action"]) for r in lines[0]["replicas"]] == [(0, "restarted")]
        waited = lines[1]["waited"][0]
        assert waited["state"] == "Available" and 1.4 <= waited["load_seconds"] < 10, waited

        # restart --wait of a serving replica reports the restart's own duration (the agent restarts
        # at once), not the replica's earlier 1.5 s load.
        ran = await ndif(url, "restart", str(tiny), "--replica-id", "0", "--wait", "--json")
        assert ran.rc == 0, ran.err
        waited = ran.lines()[1]["waited"][0]
        assert waited["state"] == "Available" and waited["load_seconds"] < 1.0, waited
        ran = await ndif(url, "restart", str(tiny), "--replica-id", "0", "--wait")
        assert ran.rc == 0 and "Available in 0." in ran.out, ran.out

        # evict of a LoadFailed replica: it goes COLD and says so (never "-> WARM").
        failing["on"] = True
        ran = await ndif(url, "scale", str(tiny), "--replicas", "2", "--wait")
        assert ran.rc == 1 and "LoadFailed" in ran.out
        ran = await ndif(url, "evict", str(tiny), "--replica-id", "1")
        assert ran.rc == 0, ran.err
        assert "-> COLD" in ran.out and "WARM" not in ran.out, ran.out
        evicted = [e async for _, e in admin.events(model=str(tiny)) if type(e).__name__ == "ReplicaEvictionRequested"]
        assert evicted[-1].replica_id == 1 and evicted[-1].target == "COLD"
        st = await settle(admin)
        assert st.replicas[(mk, 1)].state == "Unloaded" and st.replicas[(mk, 1)].cpu_bytes == 0


async def test_replay_past_the_end_and_events_by_name(nats_server: EmbeddedNats, admin: AdminClient,
                                                      log: JetStreamEventLog, tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=1)):
        assert (await ndif(url, "deploy", str(tiny), "--replicas", "1", "--wait")).rc == 0
        await settle(admin)
        last = await log.last_seq()
        t0 = time.monotonic()
        ran = await ndif(url, "replay", "--until", str(last + 1000), "--json", timeout=30)
        assert ran.rc == 0 and time.monotonic() - t0 < 30, ran.err
        assert ran.json()["seq"] == last and f"the log ends at seq {last}" in ran.err
        # A time past the last event, or before the first, says what is shown.
        later = await ndif(url, "replay", "--until", "2999-01-01T00:00:00Z", "--json", timeout=30)
        assert later.rc == 0 and later.json()["seq"] == last, later.err
        assert f"the log's last event is at or before 2999-01-01T00:00:00Z: showing the state at its end, seq {last}" in later.err
        earlier = await ndif(url, "replay", "--until", "2000-01-01T00:00:00Z", "--json", timeout=30)
        assert earlier.rc == 0 and earlier.json()["seq"] == 0 and "the log starts later" in earlier.err, earlier.err
        live = (await ndif(url, "status", "--json")).json()
        for node in live["nodes"]:  # what `status` adds from the heartbeat bucket (not in the log)
            node.pop("heartbeat_age_s", None)
            node.pop("stale", None)
        assert live.pop("refused_facts") == {"count": 0, "last": None}  # the gate's (not in the log either)
        assert ran.json() == live

        # events --model resolves names as history does: a short name that matches one model.
        ran = await ndif(url, "events", "--model", "tiny-gpt2", "--json")
        assert ran.rc == 0, ran.err
        evs = ran.lines()
        assert evs and all(e["event"]["model_key"] == mk for e in evs)
        ran = await ndif(url, "history", "tiny-gpt2")
        assert ran.rc == 0 and "ReplicaLoaded" in ran.out
        for name in ("no-such-model", "org/nothing"):
            ran = await ndif(url, "events", "--model", name)
            assert ran.rc == 3 and "unknown model" in ran.err and ran.out == "", (name, ran.rc, ran.err)


async def test_undeploy_forgets_the_model(nats_server: EmbeddedNats, admin: AdminClient, log: JetStreamEventLog,
                                          tiny: Path) -> None:
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=2)):
        assert (await ndif(url, "deploy", str(tiny), "--replicas", "2", "--wait")).rc == 0
        assert (await ndif(url, "evict", str(tiny), "--replica-id", "1")).rc == 0  # one WARM, one HOT
        await settle(admin)
        ran = await ndif(url, "undeploy", "--json", str(tiny))
        assert ran.rc == 0, ran.err
        res = result(ran.out)
        assert sorted((r.replica_id, r.level) for r in res.evictions) == [(0, "COLD"), (1, "COLD")]
        st = await settle(admin)
        assert mk not in st.models and not st.model_replicas(mk) and mk in st.undeployed
        assert all(c.reserved_bytes == 0 for c in st.node_cards("node-a")) and st.cpu_cached("node-a") == 0
        status = (await ndif(url, "status", "--json")).json()
        assert not [m for m in status["models"] if m["model_key"] == mk]
        assert not [r for r in status["replicas"] if r["model_key"] == mk]
        # Its ids are free: deployed again, it starts at replica 0; its history tells both lives.
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--json", "--wait")
        assert ran.rc == 0 and [r["replica_id"] for r in ran.lines()[0]["replicas"]] == [0]
        hist = (await ndif(url, "history", str(tiny))).out
        assert "ModelUndeployed" in hist
        ran = await ndif(url, "undeploy", "nobody/never-deployed")
        assert ran.rc == 3, ran.err
        # A command given a deployed model's short name is refused, naming the model it may mean.
        ran = await ndif(url, "undeploy", tiny.name)
        assert ran.rc == 3 and f"did you mean {tiny}?" in ran.err, ran.err
        assert mk in (await settle(admin)).models
        # Replay of the whole history is clean (no anomaly from late reports).
        ran = await ndif(url, "replay", "--until", str(await log.last_seq()), "--strict")
        assert ran.rc == 0, ran.err


async def test_undeploy_ends_waiting_requests_and_drops_the_processor(nats_server: EmbeddedNats,
                                                                     admin: AdminClient, tiny: Path,
                                                                     tmp_path: Path) -> None:
    from dataplane.client import Client
    from dataplane.serving.dispatcher import Dispatcher

    url = nats_server.url
    big = config_only(tmp_path, "huge", tiny)
    mk = canonical_model_key(big)
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=1, gpu_bytes=80 * GB)):
        # The only card (74.5 GiB) is taken (69 GiB charged) and the model needs 69 GiB: no room now (not
        # impossible: that would end the request at once), so its request waits in the processor.
        assert (await ndif(url, "deploy", str(tiny), "--size-gib", "60")).rc == 0
        assert (await ndif(url, "deploy", big, "--size-gib", "60")).rc == 7
        d = await Dispatcher.from_url(url, name="dispatcher:test").start()
        try:
            async with Client(url) as c:
                job = await c.submit(big, {"op": "generate", "prompt": "hi", "max_new_tokens": 1})
                async with asyncio.timeout(20):
                    while not any(p.model_key == mk and p.queue for p in d.processors.values()):
                        await asyncio.sleep(0.05)
                assert (await ndif(url, "undeploy", big)).rc == 0
                last: Any = None
                async for s in job.statuses(timeout=20):
                    last = s
                assert last is not None and str(last.status) == "ERROR" and last.error == "ModelUndeployed", last
            async with asyncio.timeout(20):
                while any(p.model_key == mk for p in d.processors.values()):
                    await asyncio.sleep(0.05)
            durable = f"proc-{model_token(mk)}"
            assert d.nc is not None
            async with asyncio.timeout(10):
                while durable in [ci.name for ci in await d.nc.jetstream().consumers_info("NDIF_REQUESTS")]:
                    await asyncio.sleep(0.05)
        finally:
            await d.stop()


async def test_replica_bounds(nats_server: EmbeddedNats, admin: AdminClient, log: JetStreamEventLog,
                              tiny: Path) -> None:
    url = nats_server.url
    # The default bounds (128 per model, 64 per command): through the CLI, and published raw on the
    # command subject (no client-side check), refused in well under a second with nothing appended.
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-a", gpus=8)):
        assert (await ndif(url, "deploy", str(tiny), "--replicas", "1", "--wait")).rc == 0
        await settle(admin)
        before = await log.last_seq()
        for args in (("scale", str(tiny), "--replicas", "1000"), ("deploy", "x/y", "--replicas", str(10**9)),
                     ("scale", str(tiny), "--replicas", str(2**70))):
            ran = await ndif(url, *args)
            assert ran.rc == 2 and "limit" in ran.err and ran.err.count("\n") == 1, (args, ran.rc, ran.err)
        for n in (10**9, 2**70, 1000):
            body = b'{"verb": "scale", "command_id": "raw-%d", "model_key": "%s", "replicas": %d}' % (
                n, str(tiny).encode(), n)
            t0 = time.perf_counter()
            reply = await log.nc.request("ndif.cmd.scale", body, timeout=10)
            took = time.perf_counter() - t0
            res = msgspec.json.decode(reply.data, type=CommandResult)
            assert not res.ok and res.error == "InvalidCommand" and "limit" in res.message, res
            assert took < 1.0, took  # (the controller spent 30+ s placing 10^9 replicas before)
        assert await log.last_seq() == before
    # Configured bounds: per command and per model.
    ctl = Controller.from_url(url, max_replicas_per_model=3, max_replicas_per_command=2)
    async with Cluster(ctl, ScriptedAgent(url, "node-a", gpus=8)):
        ran = await ndif(url, "scale", str(tiny), "--replicas", "3")
        assert ran.rc == 2 and "limit per command (2 replicas)" in ran.err, ran.err
        assert (await ndif(url, "scale", str(tiny), "--replicas", "2", "--scale-up")).rc == 0  # 1 + 2 = 3
        ran = await ndif(url, "scale", str(tiny), "--replicas", "1", "--scale-up")
        assert ran.rc == 2 and "limit of 3 per model" in ran.err, ran.err


async def test_restart_of_a_model_is_rolling_and_it_never_stops_serving(nats_server: EmbeddedNats, admin: AdminClient,
                                                                        tiny: Path) -> None:
    """`ndif restart MODEL` restarts one replica at a time (each after the previous is Available
    again): at every point of the log at least two of three replicas serve; --all-at-once does not."""
    url = nats_server.url
    mk = canonical_model_key(str(tiny))
    agent = ScriptedAgent(url, "node-r", gpus=3, load_delay_s=0.4)
    async with Cluster(Controller.from_url(url), agent):
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "3", "--wait")
        assert ran.rc == 0, ran.err
        ran = await ndif(url, "restart", str(tiny), "--wait", "--json")
        assert ran.rc == 0, (ran.out, ran.err)
        first, waited = ran.lines()
        assert [r["replica_id"] for r in first["replicas"]] == [0] and "rolling" in first["message"]
        assert sorted(w["replica_id"] for w in waited["waited"]) == [0, 1, 2]
        assert all(w["state"] == "Available" for w in waited["waited"]), waited
        state = await settle(admin)
        assert [r.restarts for r in state.model_replicas(mk)] == [1, 1, 1]
        assert state.models[mk].rollout == ()

        # Fold the log from the restart on: never fewer than 2 of 3 replicas Available.
        from controlplane.core.projections import ClusterState

        fold, fewest, start = ClusterState(), 3, first["first_seq"]
        async for seq, item in admin.log.read():
            fold.apply(seq, item)
            if seq >= start:
                fewest = min(fewest, sum(r.state is S.AVAILABLE for r in fold.model_replicas(mk)))
        assert fewest == 2

        ran = await ndif(url, "restart", str(tiny), "--all-at-once", "--json")
        assert ran.rc == 0 and sorted(r["replica_id"] for r in ran.lines()[0]["replicas"]) == [0, 1, 2]


async def test_operator_views_say_why_and_hide_what_is_gone(nats_server: EmbeddedNats, admin: AdminClient,
                                                            tiny: Path, tmp_path: Path) -> None:
    """`history` gives each event's reason (a failed load's error, a refused placement's needed vs
    free, a command's verb); `status` hides replicas unloaded and no longer wanted unless `--all`;
    `status MODEL` shows the model's replicas with node, cards and full error, and its recent events."""
    url = nats_server.url
    failing = {"on": True}
    agent = ScriptedAgent(url, "node-v", gpus=2, fail_loads=lambda m: failing["on"])
    async with Cluster(Controller.from_url(url), agent):
        ran = await ndif(url, "deploy", str(tiny), "--replicas", "1", "--wait")
        assert ran.rc == 1
        failing["on"] = False
        ran = await ndif(url, "scale", str(tiny), "--replicas", "2", "--wait")
        assert ran.rc == 0, ran.err
        hist = (await ndif(url, "history", str(tiny))).out
        assert "[verb=deploy]" in hist and "[verb=scale]" in hist, hist
        failed_line = next(ln for ln in hist.splitlines() if "ReplicaLoadFailed" in ln)
        assert "error:" in failed_line, failed_line

        big = config_only(tmp_path, "huge", tiny)
        ran = await ndif(url, "deploy", big, "--replicas", "1", "--size-gib", "5000")
        assert ran.rc == 7
        refused = next(ln for ln in (await ndif(url, "history", big)).out.splitlines() if "PlacementRejected" in ln)
        assert "needed" in refused and "GiB" in refused and "free" in refused, refused

        ran = await ndif(url, "evict", str(tiny), "--replica-id", "0", "--cold")
        assert ran.rc == 0, ran.err
        await settle(admin)
        def replica_rows(out: str) -> set[str]:
            return {ln.split()[1] for ln in out.split("REPLICAS", 1)[-1].splitlines() if "tiny-gpt2" in ln}

        text = (await ndif(url, "status")).out
        assert "not listed: `ndif status --all` lists them" in text, text
        assert replica_rows(text) == {"1"}, text  # replica 0 is unloaded and no longer wanted
        assert replica_rows((await ndif(url, "status", "--all")).out) == {"0", "1"}
        one = await ndif(url, "status", str(tiny))
        assert one.rc == 0, one.err
        assert "REPLICAS" in one.out and "RECENT EVENTS" in one.out, one.out
        rows = {ln.split()[0]: ln.split() for ln in one.out.split("REPLICAS", 1)[1].split("RECENT EVENTS")[0].splitlines()
                if ln[:1].isdigit()}
        # id, node, cards, level, desired, state: the failed one keeps its whole error on its row
        assert rows["0"][:6] == ["0", "node-v", "-", "COLD", "COLD", "Unloaded"], one.out
        assert "LoadError: sim: config.json is corrupt" in " ".join(rows["0"]), one.out
        assert rows["1"][:6] == ["1", "node-v", "0", "HOT", "HOT", "Available"], one.out
        assert "ReplicaLoadFailed#0  error: LoadError: sim: config.json is corrupt" in one.out, one.out
        js = (await ndif(url, "status", str(tiny), "--json")).json()
        assert {r["replica_id"] for r in js["replicas"]} == {0, 1} and js["recent_events"], js


async def test_status_watch_redraws_on_a_tick_without_events(nats_server: EmbeddedNats, admin: AdminClient) -> None:
    """A dead node's heartbeat age must keep moving on screen although nothing is appended."""
    import os
    import sys

    url = nats_server.url
    async with Cluster(Controller.from_url(url), ScriptedAgent(url, "node-w", gpus=1)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dataplane.ops.cli", "status", "--watch", "--nats", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ})
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 60)  # the first view, on start
        await asyncio.sleep(3.6)  # no event meanwhile: only the tick redraws
        proc.terminate()
        out, _ = await proc.communicate()
    text = first.decode() + out.decode()
    assert text.count("cluster at seq") >= 3, text


async def test_queue_and_kill_unanswered_say_why_in_one_line(nats_server: EmbeddedNats) -> None:
    """A dispatcher that never answers (or a server that refuses to pass the request on, as for a
    client's credentials) ends `ndif queue` / `ndif kill` with one `error:` line and exit 5, not a
    traceback."""
    import nats

    async def silent(_: Any) -> None:  # hears, never answers
        pass

    nc = await nats.connect(nats_server.url)
    try:
        await nc.subscribe("ndif.dispatcher.state", cb=silent)
        await nc.subscribe("ndif.dispatcher.kill", cb=silent)
        await nc.flush()
        for args in (["queue"], ["kill", "some-request"]):
            ran = await ndif(nats_server.url, *args, timeout=60)
            assert ran.rc == 5, (args, ran)
            assert "Traceback" not in ran.err and "no dispatcher answered" in ran.err, (args, ran.err)
    finally:
        await nc.close()


async def test_ctrl_c_while_waiting_says_what_stands(nats_server: EmbeddedNats, log: JetStreamEventLog,
                                                     tiny: Path) -> None:
    """Ctrl-C in `ndif submit` (no dispatcher: it waits for statuses) ends with exit 130 and a line
    that names the stored request, so nobody takes the interruption for a cancellation."""
    import os
    import signal
    import sys

    # A shell's background job (CI's, say) starts with SIGINT ignored, and a child inherits that:
    # Python then never turns Ctrl-C into KeyboardInterrupt. The child gets the default back.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dataplane.ops.cli", "submit", str(tiny), "--prompt", "hi", "--nats", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stderr is not None
    first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert first.startswith("request "), first
    rid = first.split()[1]
    await asyncio.sleep(0.5)  # waiting for its statuses now
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130, (proc.returncode, err)
    assert f"interrupted: request {rid} is stored" in err.decode(), err
    assert "Traceback" not in err.decode(), err
