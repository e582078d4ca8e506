"""`ndif`: the admin commands (controlplane/ops/cli.py) plus the data-plane ones.

    ndif up [--port 4222] [--store DIR] [--gpus N --gpu-memory-gib G] [--cpu-cache-gib C] [--dashboard-port 8470]
        embedded NATS + local Ray + controller + one node agent + dispatcher + dashboard, until Ctrl-C
    ndif up --demo [--requests 200] [--stay] [--dashboard-port 8470]
        the same, driven end to end: deploy, request bursts through the SDK, scale, evict mid-burst
    ndif agent --nats URL [--ray-address ADDR] [--node-id ID] [--gpus N --gpu-memory-gib G] [--pool-size K]
        one node agent (run one per Ray node), keeping K pre-started replica processes ready
    ndif dispatcher --nats URL [--ray-address ADDR]      the request dispatcher
    ndif submit MODEL (--prompt TEXT | --input-ids 1,2,3) [--max-new-tokens N] [--forward] [--json]
    ndif queue [--json]                                  each processor's state
    ndif kill REQUEST_ID                                 cancel a queued or running request
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from controlplane.ops.cli import add_snapshot_flags, build_parser, gib_arg, json_error, snapshot_options
from controlplane.ops.cli import main as admin_main
from schemas import errors as errs
from schemas.keys import display_name
from schemas.requests import payload_problem
from schemas.subjects import DISPATCHER_STATE, kill_subject
from schemas.units import GiB


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-id", help="this node's id in the log (default: the hostname)")
    p.add_argument("--gpus", type=int, help="declare N GPUs (CPU-only machines, tests); default: the real CUDA devices")
    p.add_argument("--gpu-memory-gib", type=gib_arg, default=80 * GiB, dest="gpu_memory_bytes", metavar="GIB",
                   help="memory of each declared GPU, in GiB (2**30 bytes; default 80)")
    p.add_argument("--cpu-cache-gib", type=gib_arg, dest="cpu_cache_bytes", metavar="GIB",
                   help="CPU memory for WARM replicas, in GiB (2**30 bytes; default: half the RAM)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait for the dispatcher's drain report before unloading anyway")
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval in seconds")
    p.add_argument("--pool-size", type=int, default=1,
                   help="idle replica processes kept ready on this node, torch and transformers imported, so a "
                        "cold start costs the weight load only (0: none; default %(default)s)")


def _nats(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", default=os.environ.get("NDIF_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS URL (env NDIF_NATS_URL)")


def _ray_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray cluster to join (env RAY_ADDRESS; default: auto, the cluster of this machine)")


def add_dataplane_commands(sub: Any) -> None:
    p = sub.add_parser("up", help="embedded NATS + local Ray + controller + agent on this machine")
    p.add_argument("--port", type=int, help="NATS port (default 4222; a free one with --demo)")
    p.add_argument("--store", type=Path,
                   help="JetStream store directory, kept across runs (default $NDIF_HOME/nats, ~/.ndif/nats; "
                        "a fresh temp one with --demo)")
    p.add_argument("--demo", action="store_true",
                   help="run the end-to-end demo: deploy, bursts of requests, scale, evict while requests flow")
    p.add_argument("--requests", type=int, default=200, help="requests per burst in the demo (default 200)")
    p.add_argument("--stay", action="store_true", help="after the demo, keep the cluster up until Ctrl-C")
    p.add_argument("--dashboard-port", type=int, default=8470,
                   help="port of the read-only dashboard on 127.0.0.1 (default 8470; a free one if taken)")
    p.add_argument("--open", action="store_true",
                   help="no users or permissions (loopback-only development); default: a user per role, "
                        "credentials made on first start under $NDIF_HOME/auth/")
    p.add_argument("--host", default="127.0.0.1",
                   help="address NATS listens on (default 127.0.0.1; anything else with --open is warned about)")
    p.add_argument("--new-history", action="store_true",
                   help="start an empty event stream even where the rest of a deployment exists (the history "
                        "was deleted on purpose); without it that is an error")
    add_snapshot_flags(p)
    _node_args(p)
    p = sub.add_parser("agent", help="run the node agent of this Ray node")
    _nats(p)
    _ray_address(p)
    p.add_argument("--ray-node-id", help="the Ray node this agent's replicas run on (default: the Ray node "
                                         "labelled ndif.node_id=<node id>, else the one this process joined)")
    _node_args(p)
    p = sub.add_parser("dispatcher", help="run the request dispatcher (processors per model)")
    _nats(p)
    _ray_address(p)
    p = sub.add_parser("submit", help="send a request to a model and show its statuses")
    p.add_argument("model", help="repo id (org/name[@revision]), checkpoint directory or NDIF model key")
    _nats(p)
    p.add_argument("--prompt", help="text (the checkpoint needs a tokenizer)")
    p.add_argument("--input-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default %(default)s)")
    p.add_argument("--forward", action="store_true", help="one forward pass (next-token logprobs) instead of generate")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the request to end (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print each status as a JSON line")
    p = sub.add_parser("queue", help="each model processor's state")
    _nats(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (docs/cli.md)")
    p = sub.add_parser("kill", help="cancel a queued or running request")
    p.add_argument("request_id", help="the id `ndif submit` or the SDK printed")
    _nats(p)


def _agent_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    from dataplane.node.agent import declared_gpus
    from dataplane.runtime.pool import check_size

    try:
        pool_size = check_size(a.pool_size)
    except ValueError as exc:
        raise errs.InvalidCommand(f"--pool-size: {exc}") from None
    kw: dict[str, Any] = {"node_id": a.node_id, "drain_timeout_s": a.drain_timeout, "heartbeat_s": a.heartbeat,
                          "pool_size": pool_size}
    if a.gpus is not None:
        kw["gpus"] = declared_gpus(a.gpus, a.gpu_memory_bytes)
    if a.cpu_cache_bytes is not None:
        kw["cpu_cache_bytes"] = a.cpu_cache_bytes
    return kw


def _join_ray(address: str) -> None:
    """Join the Ray cluster at `address` (agent, dispatcher); a clear error when there is none."""
    from dataplane.runtime import ray_adapter

    try:
        ray_adapter.join(address)
    except ConnectionError as exc:
        raise errs.InfrastructureError(
            f"cannot join a Ray cluster at {address!r} ({str(exc).splitlines()[0]}): start one with "
            "deploy/head.sh (docs/deploy.md; or `ray start --head`), pass --ray-address / set RAY_ADDRESS, "
            "or run everything on one machine with `ndif up`") from None


async def _agent(a: argparse.Namespace) -> int:
    from dataplane.node.agent import NodeAgent
    from dataplane.ops.local import until_signal

    _join_ray(a.ray_address)
    kw = _agent_kwargs(a)
    async with await NodeAgent.open(a.nats, kw.pop("node_id"), ray_node_id=a.ray_node_id, **kw):
        await until_signal()
    return 0


async def _up(a: argparse.Namespace) -> int:
    snapshots = snapshot_options(a)  # checked before anything starts
    if a.demo:
        from dataplane.ops.demo import run_demo

        if a.requests < 1:
            raise errs.InvalidCommand("--requests must be at least 1")
        return await run_demo(port=a.port, store=a.store, gpus=_agent_kwargs(a).get("gpus"), requests=a.requests,
                              stay=a.stay, dashboard_port=a.dashboard_port)
    import socket

    from controlplane.ops.auth import AccountLimits, LocalAuth, ensure_local
    from controlplane.store.credentials import ndif_home
    from dataplane.node.agent import detect_gpus
    from dataplane.ops.local import LocalCluster, until_signal

    home = ndif_home()  # the demo's and README's paths too
    store = a.store or home / "nats"
    port = a.port or 4222
    kw = _agent_kwargs(a)
    node_id = kw.pop("node_id") or socket.gethostname()
    auth: LocalAuth | None = None
    if a.open:
        if a.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"ndif up: WARNING: --open on {a.host}: anyone who can reach port {port} can append events, "
                  "read every prompt and delete the history; use --open on loopback only", file=sys.stderr,
                  flush=True)
    else:
        auth = ensure_local([node_id], limits=AccountLimits.from_env(os.environ))
    # Nothing of ours outlives this process, even on SIGKILL: nats-server and Ray's core processes
    # get the parent-death signal, and the watchdog kills what remains (Ray's helper agents).
    from dataplane.node import watchdog

    watchdog.start()
    gpus = kw.pop("gpus", None) or detect_gpus()
    cluster = LocalCluster(store=store, port=port, host=a.host, auth=auth, new_history=a.new_history, gpus=gpus,
                           node_id=node_id, agent=kw, controller=snapshots, dashboard_port=a.dashboard_port,
                           die_with_parent=True)
    url = cluster.start_nats()  # from the main thread: the parent-death signal follows the thread that forked it
    try:
        await cluster.ensure_log()
        if not gpus:
            print("ndif up: warning: no GPU found, so no model can be placed on this node; on a CPU-only "
                  "machine declare GPUs with --gpus N [--gpu-memory-gib G] (e.g. `ndif up --gpus 2`)",
                  file=sys.stderr, flush=True)
        mode = f"users per role, credentials in {auth.config_path.parent}" if auth else "OPEN: no users"
        print(f"ndif up: NATS {url} (store {store}; {mode}); starting Ray with {len(gpus)} GPU(s)...", flush=True)
        async with cluster:
            assert cluster.agent is not None and cluster.dashboard is not None
            print(f"ndif up: dashboard {cluster.dashboard.url} (read-only, this machine only)", flush=True)
            print(f"ndif up: controller, agent {cluster.agent.node_id} and dispatcher running. In another shell:\n"
                  f"  export NDIF_NATS_URL={url}"
                  + (f" NDIF_HOME={home}  # its commands find their credentials there\n" if auth else "\n") +
                  f"  python -m dataplane.node.tiny_models {home / 'models'}   # once; `ndif up --demo` makes them too\n"
                  + (f"  ndif deploy {home / 'models' / 'tiny-gpt2'} --replicas 2 --wait\n" if gpus else
                     "  # no GPU on this node, so a deploy would be refused for room: stop (Ctrl-C) and start\n"
                     "  # again with declared GPUs, e.g. `ndif up --gpus 2`, to deploy here\n") +
                  "  ndif status\n"
                  f"  ndif submit {home / 'models' / 'tiny-gpt2'} --prompt 'Hello'\n"
                  "Ctrl-C stops everything.", flush=True)
            await until_signal()
        print("ndif up: stopping", flush=True)
    finally:
        await cluster.stop()
    return 0


async def _dispatcher(a: argparse.Namespace) -> int:
    from dataplane.ops.local import until_signal
    from dataplane.serving.dispatcher import Dispatcher

    _join_ray(a.ray_address)
    async with Dispatcher.from_url(a.nats):
        await until_signal()
    return 0


async def _submit(a: argparse.Namespace) -> int:
    import msgspec

    from dataplane.client.sdk import Client, RequestFailed

    payload: dict[str, Any] = {"op": "forward" if a.forward else "generate", "max_new_tokens": a.max_new_tokens}
    if a.prompt is not None:
        payload["prompt"] = a.prompt
    elif a.input_ids:
        try:
            payload["input_ids"] = [[int(x) for x in a.input_ids.split(",")]]
        except ValueError:
            raise errs.InvalidCommand("--input-ids takes comma-separated integers, e.g. 1,2,3") from None
    else:
        raise errs.InvalidCommand("give --prompt TEXT or --input-ids 1,2,3")
    problem = payload_problem(payload)  # the replica's own rules, before connecting (the SDK checks again)
    if problem is not None:
        raise errs.InvalidCommand(f"invalid request: {problem}")
    async with Client(a.nats) as c:
        job = await c.submit(a.model, payload)
        a.on_interrupt = (f"request {job.request_id} is stored and runs without this wait; cancel it with "
                          f"`ndif kill {job.request_id}` (the SDK: `Client.kill`), or read its outcome with the "
                          "SDK's `Client.job(...)`")
        t0 = time.perf_counter()
        if not a.json:
            print(f"request {job.request_id}", flush=True)
        async for s in job.statuses(timeout=a.timeout):
            if s.terminal:
                a.on_interrupt = f"request {job.request_id} had ended {s.status}"
            if a.json:
                print(msgspec.json.encode(s).decode(), flush=True)
                continue
            extra = f" (position {s.queue_position})" if s.queue_position is not None else ""
            if s.wait_estimate_s is not None:
                extra += f" (about {s.wait_estimate_s:g}s to wait)"
            extra += f" on replica {s.replica_id}" if s.replica_id is not None and not s.terminal else ""
            print(f"  {time.perf_counter() - t0:6.2f}s  {s.status}{extra}" + (f"  {s.message}" if s.message else ""),
                  flush=True)
        try:
            result = await job.result()
        except RequestFailed as exc:
            if a.json:
                json_error(type(exc).__name__, str(exc), 1)
            else:
                print(f"error: {exc}", file=sys.stderr)
            return 1
        if not a.json:
            # A generated text as it is; anything else (forward's logprobs, ...) as JSON, never a Python repr.
            text = result.get("text") if isinstance(result, dict) else None
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                text = "\n".join(text)  # a batch of one prompt (or several): each generated text on its own
            print(text if isinstance(text, str) else msgspec.json.encode(result).decode())
    return 0


async def _admin_nc(url: str) -> Any:
    """A connection as the local admin (auth.resolve), like every other admin verb."""
    from controlplane.store.credentials import resolve
    from controlplane.store.eventstore import connect

    return await connect(url, name="ndif-cli", creds=resolve("admin", url=url))


def queue_lines(state: dict[str, Any]) -> list[str]:
    """`ndif queue` for people: each processor's model by its short name (as every other verb names
    a model; the full key is in --json) and its state."""
    out = [f"dispatcher {state['dispatcher']}"]
    for p in state["processors"]:
        out.append(f"  {display_name(p['model_key'])}\n    {p['status']}: {p['queued']} queued, {p['in_flight']} running, "
                   f"serving {p.get('serving_replicas', p.get('workers'))} (ready {p['ready_replicas']}, draining "
                   f"{p['draining_replicas']}, starting {p['starting_replicas']}), {p['completed']} completed, "
                   f"{p['errors']} errors; {p.get('replica_calls', 0)} replica calls, "
                   f"{p.get('endpoint_calls', 0)} of them over NATS")
        users = p.get("users") or {}
        if users:
            out.append("    per user: " + ", ".join(f"{u or '(open)'} {c['queued']} queued / {c['running']} running"
                                                for u, c in users.items()))
    return out


# A request the server refuses to pass on (a client's credentials: `ndif queue` and `ndif kill` are
# the admin's) reads as no answer, as does a dispatcher too busy to answer.
_UNANSWERED = ("no dispatcher answered `ndif {verb}` within {s} s: these take the admin's credentials (a "
               "client cancels its own request with the SDK's `Client.kill`), or the dispatcher is overloaded; "
               "try again")


async def _queue(a: argparse.Namespace) -> int:
    import json

    import nats as nats_mod

    nc = await _admin_nc(a.nats)
    try:
        msg = await nc.request(DISPATCHER_STATE, b"", timeout=5)
    except nats_mod.errors.NoRespondersError:
        raise errs.InfrastructureError("no dispatcher is answering: start one (`ndif up` or `ndif dispatcher`)") from None
    except nats_mod.errors.TimeoutError:
        raise errs.InfrastructureTimeout(_UNANSWERED.format(verb="queue", s=5)) from None
    finally:
        await nc.close()
    state = json.loads(msg.data)
    if a.json:
        print(json.dumps(state, sort_keys=True))
        return 0
    print("\n".join(queue_lines(state)))
    return 0


async def _kill(a: argparse.Namespace) -> int:
    import json

    import nats as nats_mod

    nc = await _admin_nc(a.nats)
    try:
        msg = await nc.request(kill_subject(), a.request_id.encode(), timeout=10)
    except nats_mod.errors.NoRespondersError:
        raise errs.InfrastructureError("no dispatcher is answering: start one (`ndif up` or `ndif dispatcher`)") from None
    except nats_mod.errors.TimeoutError:
        raise errs.InfrastructureTimeout(_UNANSWERED.format(verb="kill", s=10)) from None
    finally:
        await nc.close()
    ans = json.loads(msg.data)
    if not ans.get("ok"):
        raise errs.NotFound(ans.get("message", "not found"))
    print(f"killed {a.request_id}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The whole `ndif` parser, admin and data-plane commands (for tests and docs checks)."""
    return build_parser(add_dataplane_commands)[0]


def main(argv: list[str] | None = None) -> int:
    return admin_main(argv, extra=add_dataplane_commands,
                      runners={"up": _up, "agent": _agent, "dispatcher": _dispatcher, "submit": _submit,
                               "queue": _queue, "kill": _kill})


if __name__ == "__main__":
    sys.exit(main())
