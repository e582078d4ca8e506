"""The whole service over memory, for unit tests of the dispatcher: the real controller, node agent
and dispatcher on the in-memory log and serving ports, replicas in tests/fake_runtime.py (no NATS,
no Ray, no torch). `memory_stack(make_caller, **dispatcher_settings)` yields a `Stack`."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from controlplane.service.controller import Controller
from controlplane.service.parts import Parts
from controlplane.store.heartbeats import MemoryHeartbeats
from controlplane.store.memlog import MemoryEventLog
from dataplane.node.agent import NodeAgent
from dataplane.serving.dispatcher import Dispatcher
from dataplane.serving.memory import MemoryServing
from schemas import errors as errs
from schemas.commands import CommandResult, Deploy
from tests.fake_runtime import FakeRuntime
from tests.strategies import node_joined

NODE = "node-a.cluster"
GB = 10**9


@dataclass
class Stack:
    log: MemoryEventLog
    controller: Controller
    agent: NodeAgent
    dispatcher: Dispatcher
    serving: MemoryServing
    runtime: FakeRuntime
    sizes: dict[str, int]  # model key -> the size its deploy registers

    def events(self, cls: type) -> list[Any]:
        return [e for e in self.log.events() if isinstance(e, cls)]


@contextlib.asynccontextmanager
async def memory_stack(make_caller: Callable[[FakeRuntime], Any], **dispatcher_settings: Any) -> AsyncIterator[Stack]:
    log = MemoryEventLog()
    runtime = FakeRuntime("sim:a")
    sizes: dict[str, int] = {}
    ctl = await Controller(Parts(log, None), policy_interval_s=60).start()

    async def deploy(model_key: str, replicas: int, user: str) -> CommandResult:
        """The controller's answer to the dispatcher's deploy, refusals raised as the admin client does."""
        cmd = Deploy(command_id=f"cmd-{uuid.uuid4().hex[:8]}", actor="dispatcher:unit", model_key=model_key,
                     replicas=replicas, size_bytes=sizes.get(model_key, GB))
        res = await ctl.handle(msgspec.json.encode(cmd), verb="deploy")
        if not res.ok and not res.last_seq:
            raise getattr(errs, res.error or "", errs.NdifError)(res.message or "refused")
        return res

    agent = await NodeAgent(log, MemoryHeartbeats(), runtime, NODE, gpus=node_joined(NODE).gpus,
                            cpu_cache_bytes=2**34, heartbeat_s=0.05, drain_timeout_s=30.0,
                            health_interval_s=0.05).start()
    serving = MemoryServing(deploy)
    disp = await Dispatcher(Parts(log, None), name="dispatcher:unit", caller=make_caller(runtime),
                            ports=serving.ports(), ack_wait_s=1.0, **dispatcher_settings).start()
    try:
        yield Stack(log, ctl, agent, disp, serving, runtime, sizes)
    finally:
        await disp.stop()
        await agent.stop()
        await ctl.stop()
