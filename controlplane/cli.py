"""The admin commands of `ndif` (NDIF's CLI habits, plus what an event log makes possible).

deploy, scale, scale-down, evict, restart, status, events, history, replay, controller.
Every command takes --nats URL (env NDIF_NATS_URL). Errors print one line to stderr and exit
non-zero: 2 invalid input, 3 unknown model/replica, 4 conflict, 5 infrastructure (no controller,
timeout), 6 replay found anomalies (--strict).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from datetime import datetime
from typing import Any

import msgspec

from controlplane.admin import AdminClient
from controlplane.heartbeats import heartbeat_ages
from controlplane.logs import configure
from controlplane.projections import ClusterState
from controlplane.render import render_status, status_json
from schemas import errors as errs
from schemas.commands import CommandResult
from schemas.events import Event, ReplicaEvent, Skipped, event_tag
from schemas.keys import canonical_model_key, display_name

DEFAULT_URL = "nats://127.0.0.1:4222"
EXIT = {errs.InvalidCommand: 2, errs.NotFound: 3, errs.ConflictError: 4, errs.InfrastructureError: 5,
        errs.ReplayAnomalyError: 6}
_json = msgspec.json.Encoder()
LONG_RUNNING = {"controller", "up", "agent", "dispatcher"}  # services log at INFO by default


def _out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")


def _print_result(verb: str, res: CommandResult, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(_json.encode(res).decode() + "\n")
        return
    print(f"{verb}: {res.message}" + (f"  [seq {res.first_seq}..{res.last_seq}]" if res.last_seq else ""))
    for r in res.replicas:
        print(f"  replica {r.replica_id} of {display_name(r.model_key)}: {r.action} on {r.node_id or '-'} "
              f"gpus {list(r.gpu_indices)}")
    for r in res.evictions:
        print(f"  replica {r.replica_id} of {display_name(r.model_key)}: {r.action} -> {r.level}")
    for j in res.rejections:
        print(f"  {j.replicas} replica(s) of {display_name(j.model_key)} not placed: {j.reason} "
              f"(needs {j.needed_bytes / 2**30:.1f} GiB, at most {j.free_bytes / 2**30:.1f} GiB free)")


async def _command(a: argparse.Namespace, admin: AdminClient) -> int:
    cid = a.command_id
    match a.cmd:
        case "deploy":
            res = await admin.deploy(a.model, a.replicas, dedicated=a.dedicated, size_bytes=a.size_bytes,
                                     command_id=cid)
        case "scale":
            res = await admin.scale(a.model, a.replicas, scale_up=a.scale_up, dedicated=a.dedicated, command_id=cid)
        case "scale-down":
            res = await admin.scale_down(a.model, a.replicas, command_id=cid)
        case "evict":
            res = await admin.evict(a.model, replica_id=a.replica_id, all=a.all, cold=a.cold, command_id=cid)
        case "restart":
            res = await admin.restart(a.model, replica_id=a.replica_id, command_id=cid)
        case _:
            raise errs.InvalidCommand(f"unknown command {a.cmd}")
    _print_result(a.cmd, res, a.json)
    if getattr(a, "wait", False) and res.replicas:
        state = await admin.wait(res, timeout=a.wait_timeout)
        failed = 0
        waited = []
        for r in res.replicas:
            view = state.replicas[(r.model_key, r.replica_id)]
            failed += view.state in ("LoadFailed", "Failed")
            waited.append({"model_key": r.model_key, "replica_id": r.replica_id, "state": str(view.state),
                           "level": str(view.level), "load_seconds": view.load_seconds, "error": view.error})
            if not a.json:
                print(f"  replica {r.replica_id} of {display_name(r.model_key)}: {view.state}"
                      + (f" in {view.load_seconds:.2f}s" if view.load_seconds else "")
                      + (f" ({view.error})" if view.error else ""))
        if a.json:
            _out({"waited": waited, "seq": state.seq})
        return 1 if failed else 0
    return 0


async def _status(a: argparse.Namespace, admin: AdminClient) -> int:
    state = await admin.state()
    _show(state, a.json, await heartbeat_ages(admin.log.js, sorted(state.nodes)))
    if a.watch:
        async for batch in admin.log.follow_batches(state.seq + 1):
            for seq, item in batch:
                state.apply(seq, item)
            if not a.json:
                sys.stdout.write("\x1b[2J\x1b[H")
            _show(state, a.json, await heartbeat_ages(admin.log.js, sorted(state.nodes)))
    return 0


def _show(state: ClusterState, as_json: bool, heartbeats: dict[str, float | None] | None = None) -> None:
    if as_json:
        _out(status_json(state, heartbeats))
    else:
        print(render_status(state, heartbeats))
    sys.stdout.flush()


def _event_line(seq: int, item: Event | Skipped) -> str:
    if isinstance(item, Skipped):
        return f"{seq:>7}  (unreadable: {item.reason})"
    who = display_name(item.model_key) if item.model_key else getattr(item, "node_id", "")
    rid = f"#{item.replica_id}" if isinstance(item, ReplicaEvent) else ""
    node = f" @{item.node_id}" if isinstance(item, ReplicaEvent) and item.node_id else ""
    cause = f" cmd={item.command_id}" if item.command_id else ""
    return f"{seq:>7}  {item.ts:%Y-%m-%d %H:%M:%S}  {event_tag(item):<26} {who}{rid}{node}  by {item.actor}{cause}"


async def _events(a: argparse.Namespace, admin: AdminClient) -> int:
    async for seq, item in admin.events(model=a.model, start_seq=a.since, follow=a.follow):
        if a.json:
            body = msgspec.json.decode(_json.encode(item)) if isinstance(item, Event) else {"skipped": item.reason}
            _out({"seq": seq, "event": body})
        else:
            print(_event_line(seq, item))
        sys.stdout.flush()
    return 0


async def _history(a: argparse.Namespace, admin: AdminClient) -> int:
    """One model's (or replica's) timeline: each event, the state it left, and who caused it."""
    mk = canonical_model_key(a.model)
    state = ClusterState()
    rows = 0
    async for batch in admin.log.read_batches():
        for seq, item in batch:
            state.apply(seq, item)
            if not isinstance(item, Event) or item.model_key != mk:
                continue
            if a.replica_id is not None and not (isinstance(item, ReplicaEvent) and item.replica_id == a.replica_id):
                continue
            after = ""
            if isinstance(item, ReplicaEvent):
                r = state.replicas.get((mk, item.replica_id))
                after = f"-> {r.state} ({r.level}, desired {r.desired})" if r else "-> (not a replica: refused)"
            line = _event_line(seq, item)
            anomaly = next((x.message for x in reversed(state.anomalies) if x.seq == seq), None)
            print(f"{line}  {after}" + (f"  ANOMALY: {anomaly}" if anomaly else ""))
            rows += 1
    if not rows:
        raise errs.NotFound(f"no events for {display_name(mk)}" + (f" replica {a.replica_id}" if a.replica_id is not None
                                                                    else ""))
    return 0


async def _replay(a: argparse.Namespace, admin: AdminClient) -> int:
    until_seq, until_time = None, None
    if a.until.isdigit():
        until_seq = int(a.until)
    else:
        try:
            until_time = datetime.fromisoformat(a.until.replace("Z", "+00:00"))
        except ValueError:
            raise errs.InvalidCommand(f"--until takes a sequence number or an ISO time, got {a.until!r}") from None
        if until_time.tzinfo is None:
            raise errs.InvalidCommand("--until time needs a timezone, e.g. 2026-11-22T14:00:00Z")
    state = await admin.state(until_seq=until_seq, until_time=until_time, strict=a.strict)
    _show(state, a.json)
    return 0


async def _controller(a: argparse.Namespace) -> int:
    from controlplane.controller import run_controller

    await run_controller(a.nats, heartbeat_grace_s=a.heartbeat_grace, max_restarts=a.max_restarts,
                         min_deploy_s=a.min_deploy_s, stream_replicas=a.stream_replicas)
    return 0


def add_admin_commands(sub: Any) -> None:
    """Register the admin subcommands on an argparse subparsers object (dataplane adds its own)."""

    def common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
        p.add_argument("--nats", default=os.environ.get("NDIF_NATS_URL", DEFAULT_URL),
                       help="NATS URL (env NDIF_NATS_URL; default %(default)s)")
        p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a controller")
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output (docs/cli.md)")

    def mutating(p: argparse.ArgumentParser, wait: bool = True) -> None:
        common(p)
        p.add_argument("--command-id", help="idempotency key (default: a new one); re-send to get the first result")
        if wait:
            p.add_argument("--wait", action="store_true", help="follow events until each replica is loaded or failed")
            p.add_argument("--wait-timeout", type=float, default=600.0)

    p = sub.add_parser("deploy", help="create N replicas of a model that has none")
    p.add_argument("model")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--dedicated", action="store_true", help="never evicted by pressure")
    p.add_argument("--size-bytes", type=int, help="override the measured model size")
    mutating(p)
    p = sub.add_parser("scale", help="at least N HOT replicas (or N more with --scale-up); never scales down")
    p.add_argument("model")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--scale-up", action="store_true")
    p.add_argument("--dedicated", action="store_true")
    mutating(p)
    p = sub.add_parser("scale-down", help="at most N HOT replicas: drain, then unload the highest ids")
    p.add_argument("model")
    p.add_argument("--replicas", type=int, required=True)
    mutating(p, wait=False)
    p = sub.add_parser("evict", help="HOT -> WARM where the CPU cache allows, else COLD")
    p.add_argument("model", nargs="?")
    p.add_argument("--replica-id", type=int)
    p.add_argument("--all", action="store_true", help="every HOT replica of every model")
    p.add_argument("--cold", action="store_true", help="down to COLD (also WARM ones)")
    mutating(p, wait=False)
    p = sub.add_parser("restart", help="restart a replica (or all of a model's) keeping ids")
    p.add_argument("model")
    p.add_argument("--replica-id", type=int)
    mutating(p)
    p = sub.add_parser("status", help="nodes, cards, models and replicas, folded from the log")
    common(p)
    p.add_argument("--watch", action="store_true", help="print again on every event")
    p = sub.add_parser("events", help="the event log, readable")
    common(p)
    p.add_argument("--model")
    p.add_argument("--since", type=int, default=1, help="first sequence")
    p.add_argument("--follow", action="store_true")
    p = sub.add_parser("history", help="one model's or replica's timeline with causes")
    p.add_argument("model")
    p.add_argument("--replica-id", type=int)
    common(p, json_flag=False)
    p = sub.add_parser("replay", help="the cluster as it was at a sequence or time")
    common(p)
    p.add_argument("--until", required=True, help="sequence number or ISO time (with timezone)")
    p.add_argument("--strict", action="store_true", help="fail on any anomaly in the history")
    p = sub.add_parser("controller", help="run a controller (several may run: queue group)")
    common(p, json_flag=False)
    p.add_argument("--heartbeat-grace", type=float, default=20.0,
                   help="seconds without a node heartbeat before NodeLost (default %(default)s)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="in-place restarts of a failed replica before it is placed elsewhere (default %(default)s)")
    p.add_argument("--stream-replicas", type=int, default=1,
                   help="replicas of the streams and buckets it creates (3 on a NATS cluster)")
    p.add_argument("--min-deploy-s", type=float, default=300.0,
                   help="seconds a replica stays before pressure may evict it (default %(default)s)")


ADMIN: dict[str, Callable[[argparse.Namespace, AdminClient], Coroutine[Any, Any, int]]] = {
    "deploy": _command, "scale": _command, "scale-down": _command, "evict": _command, "restart": _command,
    "status": _status, "events": _events, "history": _history, "replay": _replay,
}


async def run_admin(a: argparse.Namespace) -> int:
    if a.cmd == "controller":
        return await _controller(a)
    async with await AdminClient.open(a.nats, timeout=a.timeout) as admin:
        return await ADMIN[a.cmd](a, admin)


def exit_code(exc: BaseException) -> int:
    for cls, code in EXIT.items():
        if isinstance(exc, cls):
            return code
    return 1


def main(argv: list[str] | None = None, extra: Callable[[Any], None] | None = None,
         runners: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ndif", description="ndif control plane")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_admin_commands(sub)
    if extra:
        extra(sub)
    a = parser.parse_args(argv)
    configure("INFO" if a.cmd in LONG_RUNNING else "WARNING")
    runner = (runners or {}).get(a.cmd, run_admin)
    try:
        return asyncio.run(runner(a))
    except KeyboardInterrupt:
        return 130
    except errs.NdifError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
