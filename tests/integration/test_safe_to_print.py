"""A node agent's free text reaches operators' terminals shown, never acted on: its hostname, its
card names and its replica's error, full of escape sequences and direction marks, through every
verb that prints them (`status`, `status MODEL`, `events`, `history`). Real nats-server, a real
controller, the scripted agent; the CLI as a subprocess."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.service.controller import Controller
from controlplane.store.admin import AdminClient
from tests.agent_sim import ScriptedAgent
from tests.conftest import bounded
from tests.integration.cluster import config_only, ndif, settle, until_state

pytestmark = pytest.mark.timeout(180)

CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
HOSTILE = f"{CLEAR}all replicas healthy\x1b]0;owned\x07\u202etxt.exe\r\nFAKE LINE\u2028FAKE TOO\u200b"
RAW = ("\x1b", "\x07", "\u202e", "\r", "\u2028", "\u200b")


async def test_a_hostile_agents_text_is_escaped_by_every_verb(nats_server: EmbeddedNats, admin: AdminClient,
                                                             tiny: Path, tmp_path: Path) -> None:
    url = nats_server.url
    ctl = await Controller.from_url(url).start()
    agent = await ScriptedAgent(url, "node-h", gpus=1, hostname=HOSTILE, gpu_name=HOSTILE).start()
    try:
        model = config_only(tmp_path, "hostile", tiny)
        assert (await ndif(url, "deploy", model, "--size-gib", "1", "--wait")).rc == 0
        await settle(admin)
        state = await admin.state()
        (key,) = [k for k in state.replicas if k[0].endswith('hostile", "revision": null}')]
        agent.runtime.crash(key[0], key[1], f"RuntimeError: {HOSTILE}")
        await until_state(admin, lambda s: s.replicas[key].error is not None and "FAKE" in (s.replicas[key].error or ""),
                          timeout=30)
        outs = {}
        for args in (["status"], ["status", "--all"], ["status", model], ["events"], ["history", model]):
            ran = await ndif(url, *args)
            assert ran.rc == 0, (args, ran.err)
            outs[" ".join(args[:1] + (["MODEL"] if model in args else []))] = ran.out + ran.err
        for verb, out in outs.items():
            assert not any(c in out for c in RAW), (verb, [c for c in RAW if c in out])
            assert not any(ln.startswith(("FAKE LINE", "FAKE TOO")) for ln in out.splitlines()), verb  # no line of its own
        assert any("\\x1b[2J" in out for out in outs.values())  # what was there, shown as its escape
        assert "\\x1b[2J" in outs["history MODEL"] and "\\u202e" in outs["events"], outs["history MODEL"][-400:]
    finally:
        await bounded(agent.stop(), "agent.stop")
        await bounded(ctl.stop(), "controller.stop")
        await asyncio.sleep(0)
