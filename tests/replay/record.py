"""Record long golden histories together with the decisions that wrote them.

    python -m tests.replay.record          # rewrites tests/replay/histories/v1_rec_*.{jsonl,decisions.json,expected.json}

Temporal's replay test, for our decider: a run appends every decision through the real
`GroupCommitter` onto the in-memory log (controlplane/store/memlog.py, JetStream's append semantics and
the wire encoding), and records beside the history what each decision was given: the command (or
the policy and its arguments), its `DecisionContext` inputs (time, actor, command id, seed), the
resolved registration and the controller's settings. tests/replay/test_recorded_decisions.py
re-runs each decision over its recorded prefix and requires byte-identical events.

The two scenarios follow the operator paths the suite runs for real: `demo` the steps of
tools/demo.py (deploy two models, evict one replica to WARM, scale back to it, a replica fails and
the restart policy brings it back, evict --all --cold), repeated over rounds; `lifecycle` the
lifecycle scenario of tests/integration/scenario.py (deploy, scale, scale-up, evict one, scale
back, restart, scale-down, evict --all --cold), the policies test of
tests/integration/test_controller_cli.py (restart, then replacement past max_restarts, then a lost
node) and undeploy, a failed load and its restart, a rejoin that places lost replicas again. The
controller's part is played by this driver with the controller's own calls (decide, decide_failure,
decide_node_lost, decide_unplaced); the nodes' part by a scripted agent that answers each replica
state the way the real agent's observed facts do. Clock, ids and seeds are deterministic, so a
re-recording with unchanged code rewrites the same files.
"""

from __future__ import annotations

import asyncio
import hashlib
import pathlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Union

import msgspec

from controlplane.core.context import DecisionContext
from controlplane.core.decide import decide, decide_failure, decide_node_lost, decide_unplaced
from controlplane.core.placement import MIN_DEPLOY_S, PADDING
from controlplane.core.projections import ClusterState
from controlplane.core.projections.base import afold_batches
from controlplane.core.projections.cluster import Registration
from controlplane.core.projections.replica import ReplicaView
from controlplane.service.committer import GroupCommitter
from controlplane.store.memlog import MemoryEventLog
from schemas import events as E
from schemas.commands import MAX_REPLICAS_PER_MODEL, AnyCommand, Deploy, Evict, Restart, Scale, ScaleDown, Undeploy
from schemas.errors import NdifError
from schemas.keys import canonical_model_key, model_parts
from schemas.status import Level, ReplicaState

HERE = pathlib.Path(__file__).parent / "histories"
T0 = datetime(2026, 3, 1, tzinfo=UTC)
GB = 10**9
S = ReplicaState


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's settings a decision was made with."""

    min_deploy_s: float = MIN_DEPLOY_S
    headroom: float = PADDING
    max_restarts: int = 3
    max_replicas_per_model: int = MAX_REPLICAS_PER_MODEL


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """A `DecisionContext`'s inputs."""

    now: datetime
    actor: str
    command_id: str
    seed: int

    def build(self) -> DecisionContext:
        return DecisionContext(now=self.now, actor=self.actor, command_id=self.command_id, seed=self.seed)


class Policy(msgspec.Struct, frozen=True, kw_only=True, tag_field="policy"):
    """What a decision decides on, besides the state: one kind per deciding path of the controller."""


class CommandPolicy(Policy, frozen=True, kw_only=True, tag="command"):
    """An operator command, with the registration the controller resolved for it (if it needed one)."""

    command: AnyCommand
    registration: Registration | None = None


class FailurePolicy(Policy, frozen=True, kw_only=True, tag="failure"):
    """A replica failed at run time: restart it, or replace it past max_restarts."""

    model_key: str
    replica_id: int


class NodeLostPolicy(Policy, frozen=True, kw_only=True, tag="node_lost"):
    node_id: str
    reason: str


class UnplacedPolicy(Policy, frozen=True, kw_only=True, tag="unplaced"):
    """Place the wanted replicas that hold no place (level-triggered)."""


AnyPolicy = Union[CommandPolicy, FailurePolicy, NodeLostPolicy, UnplacedPolicy]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One decision as recorded: what it was given, and where its events are in the history.

    `at_seq` is the last seq of the prefix it was decided over; its events are `at_seq + 1 ..
    at_seq + events`. `refused` is the NdifError class it raised instead (nothing appended).
    """

    on: AnyPolicy
    ctx: Context
    settings: Settings
    at_seq: int = 0
    events: int = 0
    refused: str | None = None

    @property
    def policy(self) -> str:
        return str(self.on.__struct_config__.tag)


def run(d: Decision, state: ClusterState) -> list[E.Event]:
    """The decision `d` describes, taken on `state` (the recorder and the replay test both call this)."""
    ctx, st = d.ctx.build(), d.settings
    match d.on:
        case CommandPolicy(command=cmd, registration=reg):
            return decide(state, cmd, ctx, registration=reg, min_deploy_s=st.min_deploy_s, headroom=st.headroom,
                          max_replicas_per_model=st.max_replicas_per_model)
        case FailurePolicy(model_key=mk, replica_id=rid):
            return decide_failure(state, mk, rid, ctx, max_restarts=st.max_restarts, min_deploy_s=st.min_deploy_s,
                                  headroom=st.headroom)
        case NodeLostPolicy(node_id=node_id, reason=reason):
            return decide_node_lost(state, node_id, ctx, reason, min_deploy_s=st.min_deploy_s, headroom=st.headroom)
        case UnplacedPolicy():
            return decide_unplaced(state, ctx, headroom=st.headroom, min_deploy_s=st.min_deploy_s)
    raise ValueError(f"unknown policy {d.on!r}")


def seed_of(command_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(command_id.encode(), digest_size=4).digest(), "big")


_decisions_encoder = msgspec.json.Encoder()
decisions_decoder = msgspec.json.Decoder(list[Decision])


class Recorder:
    """Plays the controller (through the GroupCommitter) and scripted nodes over one in-memory log."""

    def __init__(self, settings: Settings) -> None:
        self.log = MemoryEventLog()
        self.settings = settings
        self.committer = GroupCommitter(self.log, ClusterState())
        self.now = T0
        self.decisions: list[Decision] = []
        self.gpus: dict[str, tuple[E.GpuInfo, ...]] = {}
        self.cpu: dict[str, int] = {}
        self.silent: set[str] = set()  # nodes whose agent stopped (heartbeat expired)
        self.failing: set[str] = set()  # models whose loads fail
        self.sizes: dict[str, int] = {}
        self.n_obs = 0
        self.n_ctl = 0
        self.done: set[tuple[object, ...]] = set()

    @property
    def state(self) -> ClusterState:
        return self.committer.state

    def context(self, actor: str, command_id: str) -> Context:
        return Context(now=self.now, actor=actor, command_id=command_id, seed=seed_of(command_id))

    def tick(self, seconds: float = 1.0) -> None:
        self.now += timedelta(seconds=seconds)

    # ---- the controller's part --------------------------------------------------------------

    async def decide(self, d: Decision) -> None:
        seen: list[int] = []

        def once(state: ClusterState) -> list[E.Event]:
            seen.append(state.seq)
            return run(d, state)

        try:
            res = await self.committer.submit(once)
        except NdifError as exc:
            self.decisions.append(msgspec.structs.replace(d, at_seq=seen[-1], refused=type(exc).__name__))
            return
        if res.events:
            self.decisions.append(msgspec.structs.replace(d, at_seq=res.first_seq - 1, events=len(res.events)))
        await self.catch_up()

    async def command(self, cmd: AnyCommand) -> None:
        self.tick()
        mk = getattr(cmd, "model_key", None)
        reg = None
        if isinstance(cmd, (Deploy, Scale)) and mk is not None:
            m = self.state.models.get(mk)
            if m is None or m.registration is None:
                repo = model_parts(mk)[1]  # what controlplane/service/registry.py resolves, without reading a disk
                reg = Registration(checkpoint=repo if repo.startswith("/") else f"/hf-cache/{repo}",
                                   size_bytes=self.sizes[mk], dtype="float32")
        await self.decide(Decision(on=CommandPolicy(command=cmd, registration=reg),
                                   ctx=self.context(cmd.actor, cmd.command_id), settings=self.settings))
        await self.settle()

    async def policy(self, on: Policy) -> None:
        self.tick()
        self.n_ctl += 1
        cid = f"ctl-{on.__struct_config__.tag}-{self.n_ctl:04d}"
        await self.decide(Decision(on=on, ctx=self.context("controller:rec", cid), settings=self.settings))  # type: ignore[arg-type]

    async def catch_up(self) -> None:
        await afold_batches(self.log.read_batches(self.state.seq + 1), self.state)

    # ---- the nodes' part --------------------------------------------------------------------

    async def observe(self, cls: type[E.Event], actor: str, **fields: object) -> None:
        self.n_obs += 1
        self.tick(0.5)
        ev = cls(event_id=f"obs-{self.n_obs:05d}", ts=self.now, actor=actor, **fields)  # type: ignore[arg-type]
        await self.log.append([ev], None)
        await self.catch_up()

    async def join(self, node_id: str, gpus: int, gpu_gb: int, cpu_gb: int) -> None:
        self.gpus[node_id] = tuple(E.GpuInfo(index=i, memory_bytes=gpu_gb * GB, name="sim") for i in range(gpus))
        self.cpu[node_id] = cpu_gb * GB
        self.silent.discard(node_id)
        await self.observe(E.NodeJoined, f"agent:{node_id}", node_id=node_id, gpus=self.gpus[node_id],
                           cpu_cache_bytes=self.cpu[node_id], hostname=node_id)
        await self.policy(UnplacedPolicy())
        await self.settle()

    async def lose(self, node_id: str) -> None:
        """The node's agent stops; its heartbeat expires and the controller decides NodeLost."""
        self.silent.add(node_id)
        await self.policy(NodeLostPolicy(node_id=node_id, reason="heartbeat expired"))
        await self.settle()

    async def fail(self, model_key: str, replica_id: int, error: str) -> None:
        r = self.state.replicas[(model_key, replica_id)]
        await self.observe(E.ReplicaFailed, f"agent:{r.node_id}", model_key=model_key, replica_id=replica_id,
                           node_id=r.node_id, error=error)
        await self.policy(FailurePolicy(model_key=model_key, replica_id=replica_id))
        await self.settle()

    async def settle(self) -> None:
        """Every live node answers what its replicas' states ask, until none asks anything."""
        while await self._answer_one():
            pass
        await self.policy(UnplacedPolicy())  # the controller's level-triggered placement after room changed

    async def _answer_one(self) -> bool:
        moving = sorted((r for r in self.state.replicas.values() if r.node_id and r.node_id not in self.silent
                         and r.node_id in self.gpus and self.state.nodes[r.node_id].alive),
                        key=lambda r: (r.state is not S.UNLOAD_REQUESTED and r.state is not S.DRAINING,
                                       r.since_seq, r.model_key, r.replica_id))
        for r in moving:
            mark = (r.model_key, r.replica_id, r.since_seq)
            answer = _ANSWERS.get(r.state)
            if answer is None or mark in self.done:
                continue
            self.done.add(mark)
            cls, actor, extra = answer(self, r)
            await self.observe(cls, actor, model_key=r.model_key, replica_id=r.replica_id, node_id=r.node_id, **extra)
            return True
        return False


Answer = Callable[[Recorder, ReplicaView], tuple[type[E.Event], str, dict[str, object]]]


def _agent(r: ReplicaView) -> str:
    return f"agent:{r.node_id}"


def _load(rec: Recorder, r: ReplicaView) -> tuple[type[E.Event], str, dict[str, object]]:
    if r.model_key in rec.failing:
        return E.ReplicaLoadFailed, _agent(r), {"error": "OSError: config.json is corrupt"}
    return E.ReplicaLoaded, _agent(r), {"load_seconds": 1.25}


def _unload(rec: Recorder, r: ReplicaView) -> tuple[type[E.Event], str, dict[str, object]]:
    if r.desired is Level.WARM:
        return E.ReplicaCached, _agent(r), {"cpu_bytes": rec.sizes[r.model_key]}
    return E.ReplicaUnloaded, _agent(r), {}


_ANSWERS: dict[ReplicaState, Answer] = {
    S.LOAD_REQUESTED: lambda rec, r: (E.ReplicaLoading, _agent(r), {}),
    S.LOADING: _load,
    S.DRAINING: lambda rec, r: (E.ReplicaDrained, "dispatcher:rec", {}),
    S.UNLOAD_REQUESTED: _unload,
    S.RESTARTING: lambda rec, r: (E.ReplicaRestarted, _agent(r), {}),
}


# ---- the scenarios ----------------------------------------------------------------------------


def _cmd(kind: type[AnyCommand], cid: str, **fields: object) -> AnyCommand:
    return kind(command_id=cid, actor="cli:operator", **fields)  # type: ignore[arg-type]


async def demo(rec: Recorder) -> None:
    """tools/demo.py's steps on one node with 2 cards, round after round."""
    gpt2 = canonical_model_key("/models/tiny-gpt2")
    llama = canonical_model_key("/models/tiny-llama")
    huge, other, giant = (canonical_model_key(f"/models/{m}") for m in ("huge", "other", "giant"))
    rec.sizes.update({gpt2: 689152, llama: 1_126_400, huge: 60 * GB, other: 60 * GB, giant: 100 * GB})
    await rec.join("node-1", gpus=2, gpu_gb=80, cpu_gb=20)
    for n in range(8):
        if n == 0:
            await rec.command(_cmd(Deploy, f"r{n}-deploy-gpt2", model_key=gpt2, replicas=2))
            await rec.command(_cmd(Deploy, f"r{n}-deploy-llama", model_key=llama, replicas=1))
        else:
            await rec.command(_cmd(Scale, f"r{n}-scale-gpt2", model_key=gpt2, replicas=2))
            await rec.command(_cmd(Scale, f"r{n}-scale-llama", model_key=llama, replicas=1))
        hot = [r.replica_id for r in rec.state.model_replicas(gpt2) if r.desired is Level.HOT]
        await rec.command(_cmd(Evict, f"r{n}-evict-one", model_key=gpt2, replica_id=hot[-1]))  # to WARM
        await rec.command(_cmd(Scale, f"r{n}-scale-back", model_key=gpt2, replicas=2))  # the WARM id returns
        await rec.fail(gpt2, hot[0], "ActorDiedError: killed behind the agent's back")  # the policy restarts it
        await rec.command(_cmd(Scale, f"r{n}-scale-noop", model_key=gpt2, replicas=1))  # nothing to do
        await rec.command(_cmd(Deploy, f"r{n}-deploy-again", model_key=gpt2))  # refused: use scale
        if n % 2:  # memory pressure: a second large model evicts an old replica of the first; one never fits
            await rec.command(_cmd(Scale, f"r{n}-scale-huge", model_key=huge, replicas=2))
            rec.tick(400)  # older than min_deploy_s: evictable by pressure
            await rec.command(_cmd(Scale, f"r{n}-scale-other", model_key=other, replicas=1))
            await rec.command(_cmd(Scale, f"r{n}-scale-giant", model_key=giant, replicas=1))  # CANT_ACCOMMODATE
        await rec.command(_cmd(Evict, f"r{n}-evict-all-cold", all=True, cold=True))
        rec.tick(600)


async def lifecycle(rec: Recorder) -> None:
    """The lifecycle scenario, the policies test, undeploy, a failed load, a lost node and its rejoin."""
    tiny = canonical_model_key("/models/tiny-llama")
    big = canonical_model_key("/models/big")
    gpt2 = canonical_model_key("openai-community/gpt2")
    rec.sizes.update({tiny: 689152, big: 50 * GB, gpt2: 550 * 10**6})
    await rec.join("node-a", gpus=2, gpu_gb=80, cpu_gb=10)
    await rec.join("node-b", gpus=2, gpu_gb=80, cpu_gb=10)
    for n in range(4):
        c = f"l{n}"
        first = _cmd(Deploy, f"{c}-deploy", model_key=tiny) if n == 0 else _cmd(Scale, f"{c}-deploy", model_key=tiny,
                                                                             replicas=1)
        await rec.command(first)
        await rec.command(_cmd(Scale, f"{c}-scale", model_key=tiny, replicas=2))
        await rec.command(_cmd(Scale, f"{c}-scale-up", model_key=tiny, replicas=1, scale_up=True))
        hot = [r.replica_id for r in rec.state.model_replicas(tiny) if r.desired is Level.HOT]
        await rec.command(_cmd(Evict, f"{c}-evict-one", model_key=tiny, replica_id=hot[1]))
        await rec.command(_cmd(Scale, f"{c}-scale-back", model_key=tiny, replicas=3))
        await rec.command(_cmd(Restart, f"{c}-restart", model_key=tiny, replica_id=hot[0]))
        await rec.command(_cmd(ScaleDown, f"{c}-scale-down", model_key=tiny, replicas=1))
        await rec.command(_cmd(Evict, f"{c}-evict-all-cold", all=True, cold=True))
        rec.tick(600)

        # The policies: restart in place, replacement past max_restarts (reason failure), a lost node.
        await rec.command(_cmd(Deploy if n == 0 else Scale, f"{c}-deploy-big", model_key=big, replicas=1,
                               dedicated=n == 1))
        (r0,) = [r for r in rec.state.model_replicas(big) if r.desired is Level.HOT]
        await rec.fail(big, r0.replica_id, "CUDA error: illegal memory access")
        for k in range(rec.settings.max_restarts):
            await rec.fail(big, r0.replica_id, f"CUDA error again ({k})")
        (r1,) = [r for r in rec.state.model_replicas(big) if r.desired is Level.HOT and r.state is S.AVAILABLE]
        await rec.lose(r1.node_id)  # placed again on the other node
        if n % 2:  # both nodes lost: the replica stays wanted (Lost, desired HOT) until a node rejoins
            await rec.lose("node-b" if r1.node_id == "node-a" else "node-a")
            await rec.join("node-a", gpus=2, gpu_gb=80, cpu_gb=10)  # decide_unplaced places it here
            await rec.join("node-b", gpus=2, gpu_gb=80, cpu_gb=10)
        else:
            await rec.join(r1.node_id, gpus=2, gpu_gb=80, cpu_gb=10)
        rec.tick(600)

        # A load that fails, its restart (scheduled again, same id), undeploy, deploy again.
        rec.failing.add(gpt2)
        await rec.command(_cmd(Deploy, f"{c}-deploy-gpt2", model_key=gpt2, replicas=2, size_bytes=rec.sizes[gpt2]))
        rec.failing.discard(gpt2)
        bad = [r.replica_id for r in rec.state.model_replicas(gpt2) if r.state is S.LOAD_FAILED]
        await rec.command(_cmd(Restart, f"{c}-restart-gpt2", model_key=gpt2, replica_id=bad[0]))
        await rec.command(_cmd(Undeploy, f"{c}-undeploy-gpt2", model_key=gpt2))
        await rec.command(_cmd(Undeploy, f"{c}-undeploy-big", model_key=big))
        await rec.command(_cmd(Evict, f"{c}-evict-gone", model_key=gpt2))  # refused: not deployed
        rec.tick(600)


SCENARIOS = {"v1_rec_demo": (demo, Settings()), "v1_rec_lifecycle": (lifecycle, Settings(max_restarts=1))}


async def record(name: str) -> tuple[list[bytes], list[Decision], ClusterState]:
    scenario, settings = SCENARIOS[name]
    rec = Recorder(settings)
    async with rec.committer:
        await scenario(rec)
    lines = [E.encode_event(e) for e in rec.log.events()]
    return lines, rec.decisions, rec.state


def write_history(name: str, lines: list[bytes], decisions: list[Decision], state: ClusterState) -> None:
    """`<name>.jsonl` (one stored body a line), `.decisions.json` and `.expected.json` (the fold's snapshot)."""
    (HERE / f"{name}.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    (HERE / f"{name}.decisions.json").write_bytes(
        b"[\n" + b",\n".join(_decisions_encoder.encode(d) for d in decisions) + b"\n]\n")
    snap = msgspec.json.format(msgspec.json.encode(state.to_snapshot()), indent=1)
    (HERE / f"{name}.expected.json").write_bytes(snap + b"\n")


def main() -> None:
    for name in SCENARIOS:
        lines, decisions, state = asyncio.run(record(name))
        write_history(name, lines, decisions, state)
        print(f"{name}: {len(lines)} events, {len(decisions)} decisions, {state.anomaly_count} anomalies")


if __name__ == "__main__":
    main()
