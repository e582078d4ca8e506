"""The admin commands of `ndif` (NDIF's CLI habits, plus what an event log makes possible).

deploy, scale, scale-down, evict, restart, undeploy, autoscale, status, events, history, replay, init, controller.
Every command takes --nats URL (env NDIF_NATS_URL). Errors print one line to stderr and exit
non-zero: 2 invalid input, 3 unknown model/replica, 4 conflict, 5 infrastructure (no controller,
timeout), 6 replay found anomalies (--strict), 7 deploy/scale placed nothing, 8 placed fewer than asked.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import nats.errors

from controlplane.core.capacity import never_fits
from controlplane.core.placement import PADDING
from controlplane.core.projections import ClusterState
from controlplane.core.reasons import event_reason
from controlplane.ops.extras import require
from controlplane.ops.render import explain_decision, printable, render_model, render_status, status_json
from controlplane.service.logs import configure
from controlplane.service.snapshots import SNAPSHOT_EVERY, SNAPSHOT_EVERY_S
from controlplane.store import history as H
from controlplane.store.admin import AdminClient, resolve_name
from controlplane.store.eventstore.gate import Refusals, refusals
from controlplane.store.heartbeats import JetStreamHeartbeats, ages, last_beats
from schemas import errors as errs
from schemas import logs as L
from schemas.autoscale import AutoscalePolicy
from schemas.commands import MAX_HEADROOM, CommandResult, ReplicaOutcome
from schemas.events import Event, ReplicaEvent, RolloutUpdated, Skipped, event_tag
from schemas.inventory import parse_requirements
from schemas.keys import canonical_model_key, closest_model, display_name
from schemas.status import Level, ReplicaState
from schemas.subjects import REFUSED_STREAM, replica_logs_subject
from schemas.units import GiB, gib

DEFAULT_URL = "nats://127.0.0.1:4222"
# A deploy/scale that placed fewer replicas than asked: its decision is in the log, but it fell short.
EXIT_PLACED_NONE = 7
EXIT_PLACED_SOME = 8
EXIT = {errs.InvalidCommand: 2, errs.NotFound: 3, errs.ConflictError: 4, errs.InfrastructureError: 5,
        errs.ReplayAnomalyError: 6}
_json = msgspec.json.Encoder()
DASHBOARD_HOST, DASHBOARD_PORT = "127.0.0.1", 8470
LONG_RUNNING = {"controller", "up", "agent", "dispatcher", "dashboard"}  # services log at INFO by default
MODEL_HELP = "repo id (org/name[@revision]), checkpoint directory or NDIF model key"
# Memory flags take GiB. A flag that took another unit is refused by its old name, so that a script
# written for it fails at once instead of asking for sizes 7% off (GB) or 2**30 times too large (bytes).
REPLACED_FLAGS = {"--size-bytes": "--size-gib", "--gpu-memory-gb": "--gpu-memory-gib",
                  "--cpu-cache-gb": "--cpu-cache-gib"}
MAX_GIB = 2**20  # 1 PiB: larger than any card, node or model


def gib_arg(text: str) -> int:
    """A `--*-gib` value: a size in GiB (2**30 bytes, fractions allowed), returned in bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB (e.g. 80 or 0.5)") from None
    if not 0 < value <= MAX_GIB:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} GiB: give a size above 0 and at most {MAX_GIB} GiB")
    return max(1, round(value * GiB))


def _out(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")


def _print_result(verb: str, res: CommandResult, as_json: bool, why: dict[tuple[str, int], str] | None = None,
                  hint: str | None = None) -> None:
    if as_json:
        out = msgspec.to_builtins(res) | ({"hint": hint} if hint else {})
        sys.stdout.write(_json.encode(out).decode() + "\n")
        return
    lines = [f"{verb}: {res.message}" + (f"  [seq {res.first_seq}..{res.last_seq}]" if res.last_seq else "")]
    for r in res.replicas:
        cards = f"gpus {list(r.gpu_indices)}" if r.gpu_indices else "(its cards)"
        lines.append(f"  replica {r.replica_id} of {display_name(r.model_key)}: {r.action} on {r.node_id or '-'} {cards}")
        reason = (why or {}).get((r.model_key, r.replica_id))
        if reason:
            lines.append(f"      why: {reason}")
    lines += [f"  replica {r.replica_id} of {display_name(r.model_key)}: {r.action} -> {r.level}" for r in res.evictions]
    lines += [f"  {j.replicas} replica(s) of {display_name(j.model_key)} not placed: {j.reason} "
              f"(needs {gib(j.needed_bytes)}, at most {gib(j.free_bytes)} free)" for j in res.rejections]
    print("\n".join(map(printable, lines)))


async def _command(a: argparse.Namespace, admin: AdminClient) -> int:
    try:
        return await _command_on(a, admin)
    except (errs.NotFound, errs.UnknownModel) as exc:
        hint = await _short_name_hint(admin, getattr(a, "model", None))
        if hint is None:
            raise
        raise type(exc)(f"{exc}; {hint}") from None


async def _short_name_hint(admin: AdminClient, name: str | None) -> str | None:
    """For a command refused for an unknown model: the model the operator probably meant, when
    the name is a known model's short name (commands take a full repo id or path, as the log keys
    models; `events` and `history` take short names)."""
    if not name:
        return None
    try:
        state = await admin.state()
    except errs.NdifError:
        return None
    try:
        mk: str | None = resolve_name(state, name)
    except errs.NdifError:
        mk = closest_model(name, [k for k in state.models if k not in state.undeployed])
    if mk is None or mk == _canonical_or_none(name):
        return None
    return f"did you mean {display_name(mk)}? (commands take the full repo id or path)"


def _canonical_or_none(name: str) -> str | None:
    try:
        return canonical_model_key(name)
    except errs.InvalidCommand:
        return None


async def _command_on(a: argparse.Namespace, admin: AdminClient) -> int:
    cid = a.command_id
    match a.cmd:
        case "deploy":
            res = await admin.deploy(a.model, a.replicas, dedicated=a.dedicated, size_bytes=a.size_bytes,
                                     command_id=cid, headroom=a.headroom, gpus=a.gpus,
                                     requires=parse_requirements(a.require))
        case "scale":
            res = await admin.scale(a.model, a.replicas, scale_up=a.scale_up, dedicated=a.dedicated, command_id=cid,
                                    gpus=a.gpus)
        case "scale-down":
            res = await admin.scale_down(a.model, a.replicas, command_id=cid)
        case "evict":
            res = await admin.evict(a.model, replica_id=a.replica_id, all=a.all, cold=a.cold, command_id=cid)
        case "restart":
            res = await admin.restart(a.model, replica_id=a.replica_id, rolling=not a.all_at_once, command_id=cid)
        case "undeploy":
            res = await admin.undeploy(a.model, command_id=cid)
        case "autoscale":
            res = await admin.autoscale(a.model, _policy(a), off=a.off, command_id=cid)
        case _:
            raise errs.InvalidCommand(f"unknown command {a.cmd}")
    if res.last_seq:  # appended: an interruption from here on cancels nothing
        a.on_interrupt = (f"the {a.cmd} was appended (seq {res.first_seq}-{res.last_seq}); it stands, and the "
                          "cluster carries it out whether or not this command waits; `ndif status` shows it")
    why = None
    if a.cmd in ("deploy", "scale") and not a.json and res.last_seq and any(r.node_id for r in res.replicas):
        # Where each replica went and why, from the decision's own events and the cluster before them.
        before = await admin.state(until_seq=res.first_seq - 1) if res.first_seq > 1 else ClusterState()
        decision = [(seq, e) async for seq, e in admin.log.read(res.first_seq, stop_seq=res.last_seq)
                    if isinstance(e, Event)]
        why = explain_decision(before, decision)
    # placed fewer than asked: the decision stands, the exit code says it fell short, the hint what would help
    hint = _room_hint(await admin.state(), res) if not res.ok else None
    _print_result(a.cmd, res, a.json, why, hint)
    code = 0
    if not res.ok:
        code = EXIT_PLACED_NONE if res.placed == 0 else EXIT_PLACED_SOME
        if not a.json:
            print(f"error: placed {res.placed} of {res.asked} replica(s); the rest found no room ({hint})",
                  file=sys.stderr)
    if getattr(a, "wait", False) and res.replicas:
        state = await admin.wait(res, timeout=a.wait_timeout)
        rollout = next((e for _, e in [p async for p in admin.log.read(res.first_seq, stop_seq=res.last_seq)]
                        if isinstance(e, RolloutUpdated) and e.remaining), None) if a.cmd == "restart" else None
        if rollout is not None:
            # Every replica of the rollout, once it has ended: those restarted after the first too
            # (their times count from the command, so they include the wait for their turn).
            state = await admin.wait_rollout(rollout.model_key, timeout=a.wait_timeout)
            later = tuple(ReplicaOutcome(model_key=rollout.model_key, replica_id=rid, level=Level.HOT,
                                         action="restarted") for rid in rollout.remaining)
            res = msgspec.structs.replace(res, replicas=res.replicas + later)
        # A restart's duration is from its decision to the replica serving again (the view's
        # load_seconds is the agent's figure for the last load from disk, not for this restart).
        decided = None
        if any(r.action == "restarted" for r in res.replicas):
            decided = next((e.ts for _, e in [p async for p in admin.log.read(res.first_seq, stop_seq=res.first_seq)]
                            if isinstance(e, Event)), None)
        failed = 0
        waited = []
        for r in res.replicas:
            view = state.replicas[(r.model_key, r.replica_id)]
            failed += view.state in (ReplicaState.LOAD_FAILED, ReplicaState.FAILED)
            seconds = view.load_seconds
            if r.action == "restarted":
                seconds = ((view.loaded_at - decided).total_seconds()
                           if decided is not None and view.loaded_at is not None and view.state is ReplicaState.AVAILABLE
                           else None)
            waited.append({"model_key": r.model_key, "replica_id": r.replica_id, "state": str(view.state),
                           "level": str(view.level), "load_seconds": seconds, "error": view.error})
            if not a.json:
                print(f"  replica {r.replica_id} of {display_name(r.model_key)}: {view.state}"
                      + (f" in {seconds:.2f}s" if seconds is not None else "")
                      + (f" ({view.error})" if view.error else ""))
        if a.json:
            _out({"waited": waited, "seq": state.seq})
        if failed:
            return 1
    return code


def _room_hint(state: ClusterState, res: CommandResult) -> str:
    """What would make room for a short placement: evicting only helps where a node could hold it."""
    if not any(n.alive for n in state.nodes.values()):
        return "no node is up: start one with `ndif up` or `ndif agent`; `ndif status` lists the nodes"
    for r in res.rejections:
        never = never_fits(state, r.needed_bytes)
        if never is not None:
            return never
    return "free memory with `ndif evict` / `ndif scale-down`, or add nodes"


def duration_arg(text: str) -> float:
    """A duration: seconds (`300`, `5s`), minutes (`5m`) or hours (`1h`)."""
    t = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale is not None else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 5s, 2m, 1h or 300)") from None
    if not 0 <= value < float("inf"):  # also refuses nan; the policy bounds each delay further
        raise argparse.ArgumentTypeError(f"{text!r}: a duration is 0 or more")
    return value


def seq_arg(text: str) -> int:
    """A log sequence number: 1 or more (a negative one is not "the last N": `ndif history --limit N` is)."""
    try:
        seq = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence number (1 or more)") from None
    if seq < 1:
        raise argparse.ArgumentTypeError(
            f"{seq} is not a sequence number (they start at 1); for the newest events of a model use "
            "`ndif history MODEL --limit N`, or `ndif status` for the log's last sequence")
    return seq


def _policy(a: argparse.Namespace) -> AutoscalePolicy:
    d = AutoscalePolicy()
    wait = a.max_wait
    return AutoscalePolicy(
        min_replicas=d.min_replicas if a.min is None else a.min,
        max_replicas=d.max_replicas if a.max is None else a.max,
        target_queue_per_replica=a.target_queue_per_replica, upscale_delay_s=a.upscale_delay,
        downscale_delay_s=a.downscale_delay, idle_to=Level(a.idle_to.upper()), idle_after_s=a.idle_after,
        max_wait_s=None if wait.strip().lower() == "off" else _duration(wait, "--max-wait"))


def _duration(text: str, flag: str) -> float:
    try:
        return duration_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise errs.InvalidCommand(f"{flag}: {exc}") from None


WATCH_TICK_S = 1.5  # `status --watch` redraws at least this often (heartbeat ages move without events)
RECENT_EVENTS = 12  # events of a model `ndif status MODEL` shows
HISTORY_LIMIT = 200  # events `ndif history` shows by default (the newest; --before pages back)


async def _status(a: argparse.Namespace, admin: AdminClient) -> int:
    state = await admin.state()
    model = resolve_name(state, a.model) if a.model else None
    view = _Status(a, admin, model)
    await view.show(state)
    if a.watch:
        configure("ERROR")  # the watch says itself, in one line, when the cluster goes and comes back
        while True:
            try:
                await _follow(a, admin, view, state)
            except (nats.errors.Error, errs.InfrastructureError, OSError) as exc:
                state = await _outage(a, admin, view, exc)
    return 0


async def _follow(a: argparse.Namespace, admin: AdminClient, view: _Status, state: ClusterState) -> None:
    """Redraw on every batch of events and on a tick: a dead node's heartbeat age must keep growing
    on screen although nothing is appended. Returns only by raising (the cluster went away)."""
    batches = admin.log.follow_batches(state.seq + 1).__aiter__()
    nxt: asyncio.Task[Any] | None = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(batches.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=WATCH_TICK_S)
            if done:
                for seq, item in nxt.result():
                    state.apply(seq, item)
                    if view.model is not None and isinstance(item, Event) and item.model_key == view.model:
                        view.recent = [*view.recent, (seq, item)][-RECENT_EVENTS:]
                nxt = None
            if not admin.log.nc.is_connected:
                raise errs.InfrastructureError("the connection to NATS is lost")
            _next_view(a)
            await view.show(state, reread=False)
    finally:
        if nxt is not None:
            nxt.cancel()


def _next_view(a: argparse.Namespace) -> None:
    if not a.json:  # clear the screen on a terminal only; a pipe or file gets the views one after another
        sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")


async def _outage(a: argparse.Namespace, admin: AdminClient, view: _Status, exc: BaseException) -> ClusterState:
    """One line when the cluster goes, one when it is back; the log is read again from its start
    then (it may have been restored shorter), and the view drawn anew."""
    since = datetime.now(UTC)
    print(f"ndif: the cluster is unreachable since {since:%H:%M:%S}Z ({str(exc) or type(exc).__name__}); "
          "still watching: the view comes back with it (Ctrl-C to stop)", file=sys.stderr, flush=True)
    while True:
        await asyncio.sleep(WATCH_TICK_S)
        if not admin.log.nc.is_connected:
            continue
        try:
            state = await admin.state()
            _next_view(a)
            await view.show(state)
        except (nats.errors.Error, errs.InfrastructureError, OSError):
            continue
        print(f"ndif: the cluster is back after {(datetime.now(UTC) - since).total_seconds():.0f} s "
              f"(log at seq {state.seq})", file=sys.stderr, flush=True)
        return state


class _Status:
    """One `ndif status` view: the whole cluster, or one model (`ndif status MODEL`)."""

    def __init__(self, a: argparse.Namespace, admin: AdminClient, model: str | None) -> None:
        self.a, self.admin, self.model = a, admin, model
        self.recent: list[tuple[int, Event]] = []

    async def show(self, state: ClusterState, reread: bool = True) -> None:
        if self.model is None:
            beats = JetStreamHeartbeats(self.admin.log.js)
            seen = await last_beats(beats, sorted(state.nodes))
            pools = {n: hb.pool for n, hb in seen.items() if hb is not None and hb.pool is not None}
            _show(state, self.a.json, ages(seen), self.a.all, pools, await refusals(self.admin.log.js))
            return
        if self.model not in state.models:
            raise errs.UnknownModel(f"{display_name(self.model)} is no longer deployed (`ndif history` has its past)")
        if reread:  # the model's newest events by subject, up to the state shown (not its whole history)
            found, _ = await H.newest_events(self.admin.log, self.model, before=state.seq + 1, limit=RECENT_EVENTS,
                                             last_seq=state.seq)
            self.recent = [(seq, e) for seq, e in found if isinstance(e, Event)]
        if self.a.json:
            full = status_json(state)
            _out({"seq": state.seq, "model": next(m for m in full["models"] if m["model_key"] == self.model),  # type: ignore[attr-defined]
                  "replicas": [r for r in full["replicas"] if r["model_key"] == self.model],  # type: ignore[attr-defined]
                  "recent_events": [{"seq": seq, "type": event_tag(e), "reason": event_reason(e)}
                                    for seq, e in self.recent]})
        else:
            print(render_model(state, self.model, self.recent))
        sys.stdout.flush()


def _show(state: ClusterState, as_json: bool, heartbeats: dict[str, float | None] | None = None,
          show_all: bool = False, pools: dict[str, tuple[int, int]] | None = None,
          refused: Refusals | None = None) -> None:
    """`refused`: the fact gate's refusals (`ndif status` only: they are not in the log)."""
    if as_json:
        out = status_json(state, heartbeats, pools)
        if refused is not None:
            out["refused_facts"] = msgspec.to_builtins(refused)
        _out(out)
    else:
        print(render_status(state, heartbeats, show_all=show_all, pools=pools))
        if refused is not None and refused.count:
            last = refused.last
            print(f"\n{refused.count} observed facts refused by the fact gate (not in the log)"
                  + (f"; newest: from {last.source!r}: {last.reason}" if last is not None else "")
                  + f"; all of them, as the admin: `nats --context ndif-admin stream view {REFUSED_STREAM}` "
                  f"(or `python tools/natslook.py view --stream {REFUSED_STREAM}`)")
    sys.stdout.flush()


def _event_line(seq: int, item: Event | Skipped) -> str:
    if isinstance(item, Skipped):
        return f"{seq:>7}  (unreadable: {item.reason})"
    who = display_name(item.model_key) if item.model_key else getattr(item, "node_id", "")
    rid = f"#{item.replica_id}" if isinstance(item, ReplicaEvent) else ""
    node = f" @{item.node_id}" if isinstance(item, ReplicaEvent) and item.node_id else ""
    cause = f" cmd={item.command_id}" if item.command_id else ""
    reason = event_reason(item)
    return printable(f"{seq:>7}  {item.ts.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}  {event_tag(item):<26} {who}{rid}{node}  "
                     f"by {item.actor}{cause}" + (f"  [{reason}]" if reason else ""))


async def _events(a: argparse.Namespace, admin: AdminClient) -> int:
    model = resolve_name(await admin.state(), a.model) if a.model else None  # as `history` does
    async for seq, item in admin.events(model=model, start_seq=a.since, follow=a.follow):
        if a.json:
            body = msgspec.json.decode(_json.encode(item)) if isinstance(item, Event) else {"skipped": item.reason}
            _out({"seq": seq, "event": body})
        else:
            print(_event_line(seq, item))
        sys.stdout.flush()
    return 0


async def _history(a: argparse.Namespace, admin: AdminClient) -> int:
    """One model's (or replica's) timeline: each event, the state it left, and who caused it; the newest
    `--limit` events below `--before`, folded from the newest snapshot before them (controlplane/store/history.py)."""
    if not 1 <= a.limit <= H.MAX_LIMIT:
        raise errs.InvalidCommand(f"--limit must be 1..{H.MAX_LIMIT:,}, got {a.limit}")
    if a.before is not None and a.before < 1:
        raise errs.InvalidCommand(f"--before must be a sequence number (1 or more), got {a.before}")
    state = await admin.state()
    mk = resolve_name(state, a.model)
    page = await H.model_history(admin.log, mk, replica_id=a.replica_id, before=a.before, limit=a.limit)
    if not page.steps:
        raise errs.NotFound(f"no events for {display_name(mk)}" + (f" replica {a.replica_id}" if a.replica_id is not None
                                                                    else "")
                            + (f" before seq {a.before}" if a.before is not None else ""))
    if page.before is not None:
        more = " ".join(["ndif history", shlex.quote(a.model)]
                        + ([f"--replica-id {a.replica_id}"] if a.replica_id is not None else [])
                        + [f"--limit {a.limit}", f"--before {page.before}"])
        print(f"note: older events left out; `{more}` shows them", file=sys.stderr)
    # The cluster's outages within the page's span are this model's too: its replicas ran through none.
    downs = [o.seq for o in state.outages if page.steps and o.seq > page.steps[0].seq
             and (a.before is None or o.seq < a.before)]
    outages = [(seq, item) for o in downs async for seq, item in admin.log.read(o, stop_seq=o)]
    for step in page.steps:
        while outages and outages[0][0] < step.seq:
            print(_event_line(*outages.pop(0)))
        after = ""
        if step.row is not None:
            _, st, level, desired, _anomaly = step.row
            # No replica left after it: refused (an anomaly) or, with none, the last of a replica the
            # fold no longer keeps (its model undeployed, or past the gone replicas it keeps).
            after = (f"-> {st} ({level}, desired {desired})" if st else
                     "-> (not a replica: refused)" if step.anomaly else "-> gone (unloaded, no longer kept)")
        print(_event_line(step.seq, step.item) + printable(f"  {after}" + (f"  ANOMALY: {step.anomaly}" if step.anomaly else "")))
    for seq, item in outages:
        print(_event_line(seq, item))
    return 0


async def _logs(a: argparse.Namespace, admin: AdminClient) -> int:
    """A replica's (or each of a model's replicas') recent log lines, asked of the agent of its node
    (schemas/logs.py): 0 every agent answered; 3 no such replica; 5 an agent did not answer."""
    import nats.errors

    lines = L.check_lines(a.lines)
    state = await admin.state()
    mk = resolve_name(state, a.model)
    name = display_name(mk)
    reps = sorted((r for r in state.replicas.values() if r.model_key == mk and r.node_id
                   and (a.replica_id is not None or r.state is not ReplicaState.UNLOADED)),
                  key=lambda r: r.replica_id)
    if a.replica_id is not None:
        reps = [r for r in reps if r.replica_id == a.replica_id]
        if not reps:
            raise errs.NotFound(f"no such replica: {name} has no replica {a.replica_id} "
                                "(`ndif status MODEL --all` lists them)")
    if not reps:
        raise errs.NotFound(f"{name} has no replica on any node (`ndif status MODEL --all` lists them)")
    answers: list[dict[str, Any]] = []
    worst = 0
    for r in reps:
        row: dict[str, Any] = {"replica_id": r.replica_id, "node_id": r.node_id, "state": str(r.state)}
        try:
            msg = await admin.log.nc.request(replica_logs_subject(r.node_id, mk, r.replica_id), L.encode_ask(lines),
                                             timeout=min(a.timeout, 10.0))
            got = L.decode_reply(msg.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            got = L.LogsReply(ok=False, error="InfrastructureError",
                              message=f"no agent answered for node {r.node_id} (is its agent running?)")
        except errs.InvalidCommand as exc:
            got = L.LogsReply(ok=False, error="InfrastructureError", message=f"the agent's answer cannot be read: {exc}")
        row.update(ok=got.ok, lines=got.lines, truncated=got.truncated)
        if got.missing:
            row.update(missing=got.missing)
        if not got.ok:
            row.update(error=got.error, message=got.message)
            worst = max(worst, 5 if got.error != "NotFound" else 3)
        answers.append(row)
    if a.json:
        _out({"ok": worst == 0, "model_key": mk, "replicas": answers})
        return worst
    for row in answers:  # what an agent answered is shown, never acted on by the terminal
        print(printable(f"==> {name} replica {row['replica_id']} on {row['node_id']} ({row['state']}) <=="))
        if not row["ok"]:
            print(printable(f"error: replica {row['replica_id']}: {row['message']}"), file=sys.stderr)
            continue
        if row["truncated"]:
            print(f"(older lines left out; the newest {len(row['lines'])} shown)")
        if row.get("missing"):
            print(printable(f"({row['missing']})"))
            print(printable(f"note: replica {row['replica_id']}: {row['missing']}"), file=sys.stderr)
        for line in row["lines"]:
            print(printable(line))
    return worst


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
    if until_seq is not None:
        last = await admin.log.last_seq()
        if until_seq > last:  # the log has no such sequence (yet): show where it ends, never wait for it
            print(f"note: the log ends at seq {last}; --until {until_seq} is past it: showing the state at seq "
                  f"{last}", file=sys.stderr)
            until_seq = last
    state = await admin.state(until_seq=until_seq, until_time=until_time, strict=a.strict)
    if until_time is not None:  # a time outside the log: say what is shown, never let it pass as a match
        if state.seq == 0:
            print(f"note: no event is at or before {a.until}: the log starts later; the state is empty",
                  file=sys.stderr)
        elif state.seq == await admin.log.last_seq():
            print(f"note: the log's last event is at or before {a.until}: showing the state at its end, seq {state.seq}",
                  file=sys.stderr)
    _show(state, a.json, show_all=True)  # the past in full: every replica, gone ones too
    return 0


async def _controller(a: argparse.Namespace) -> int:
    from controlplane.service.controller import run_controller

    if not 0.0 <= a.headroom <= MAX_HEADROOM:
        raise errs.InvalidCommand(f"--headroom must be between 0 and {MAX_HEADROOM:g}, got {a.headroom}")
    if a.min_deploy_s < 0:
        raise errs.InvalidCommand(f"--min-deploy-s must be 0 or more, got {a.min_deploy_s}")
    from controlplane.service.registry import ModelRoots
    from schemas.inventory import decode_inventory

    snapshots = snapshot_options(a)
    inventory = None
    if a.inventory:
        try:
            raw = Path(a.inventory).read_bytes()
        except OSError as exc:
            raise errs.InvalidCommand(f"--inventory {a.inventory}: {exc.strerror or exc}") from None
        inventory = decode_inventory(raw)
    roots = ModelRoots.from_env({**os.environ, **({"NDIF_MODEL_ROOTS": a.model_roots} if a.model_roots else {})})
    await run_controller(a.nats, heartbeat_grace_s=a.heartbeat_grace, max_restarts=a.max_restarts,
                         min_deploy_s=a.min_deploy_s, stream_replicas=a.stream_replicas, headroom=a.headroom,
                         max_replicas_per_model=a.max_replicas_per_model,
                         max_replicas_per_command=a.max_replicas_per_command, inventory=inventory, model_roots=roots,
                         **snapshots)
    return 0


def snapshot_options(a: argparse.Namespace) -> dict[str, Any]:
    """The controller's snapshot settings from `add_snapshot_flags`' flags, checked."""
    if a.snapshot_every < 0 or a.snapshot_every_s < 0:
        raise errs.InvalidCommand("--snapshot-every and --snapshot-every-s must be 0 (off) or more")
    if a.snapshot_keep is not None and a.snapshot_keep < 1:
        raise errs.InvalidCommand(f"--snapshot-keep must be 1 or more, got {a.snapshot_keep}")
    return {"snapshot_every": a.snapshot_every, "snapshot_every_s": a.snapshot_every_s,
            "snapshot_keep": a.snapshot_keep}


def add_snapshot_flags(p: argparse.ArgumentParser) -> None:
    """The controller's snapshots of the fold (`ndif controller`, `ndif up`): on by default."""
    snapshot_flags: list[tuple[str, type, object, str]] = [
        ("--snapshot-every", int, SNAPSHOT_EVERY, "events between snapshots of the fold (0: not by count; "
         "default %(default)s)"),
        ("--snapshot-every-s", float, SNAPSHOT_EVERY_S, "seconds between snapshots when the log moved (0: not by "
         "time; default %(default)s)"),
        ("--snapshot-keep", int, None, "snapshots kept, the newest (default: every one, so any past seq is one "
         "snapshot away)")]
    for flag, kind, default, text in snapshot_flags:
        p.add_argument(flag, type=kind, default=default, help=text)


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
            p.add_argument("--wait-timeout", type=float, default=600.0,
                           help="seconds --wait follows the log before giving up (default %(default)s)")

    p = sub.add_parser("deploy", help="create N replicas of a model that has none")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replicas", type=int, default=1, help="HOT replicas to create (default %(default)s)")
    p.add_argument("--dedicated", action="store_true", help="never evicted by pressure")
    p.add_argument("--size-gib", type=gib_arg, dest="size_bytes", metavar="GIB",
                   help="override the measured model size, in GiB (2**30 bytes)")
    p.add_argument("--headroom", type=float,
                   help="fraction charged over the model's size, e.g. 0.15 (default: the controller's --headroom)")
    p.add_argument("--gpus", type=int, help="place each replica on exactly N cards of one node, each charged "
                   "ceil(charge / N) (default: as few cards as hold the charge)")
    p.add_argument("--require", action="append", default=[], metavar="KEY=VALUE",
                   help="only nodes meeting this hold the replicas (kept for the model; repeatable): gpu=KIND "
                        "(every card of that kind), gpu-memory-gib=N (every card at least N GiB), any other "
                        "KEY=VALUE a label of the node (the operator's inventory says all three)")
    mutating(p)
    p = sub.add_parser("scale", help="at least N HOT replicas (or N more with --scale-up); never scales down")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replicas", type=int, required=True, help="HOT replicas the model should have at least")
    p.add_argument("--scale-up", action="store_true", help="add --replicas more instead of reaching --replicas")
    p.add_argument("--dedicated", action="store_true", help="the new replicas are never evicted by pressure")
    p.add_argument("--gpus", type=int, help="exactly N cards of one node per new replica (kept for the model)")
    mutating(p)
    p = sub.add_parser("scale-down", help="at most N HOT replicas: drain, then unload the highest ids")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replicas", type=int, required=True, help="HOT replicas to keep at most (0 for none)")
    mutating(p, wait=False)
    p = sub.add_parser("evict", help="HOT -> WARM where the CPU cache allows, else COLD")
    p.add_argument("model", nargs="?", help=MODEL_HELP + " (not with --all)")
    p.add_argument("--replica-id", type=int, help="only this replica of MODEL (default: every one of MODEL)")
    p.add_argument("--all", action="store_true", help="every HOT replica of every model")
    p.add_argument("--cold", action="store_true", help="down to COLD (also WARM ones)")
    mutating(p, wait=False)
    p = sub.add_parser("restart", help="restart a replica (or all of a model's) keeping ids")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replica-id", type=int, help="only this replica (default: every one of MODEL)")
    p.add_argument("--all-at-once", action="store_true",
                   help="restart every replica of MODEL at once (default: one at a time, each after the previous "
                        "is Available again, so the model keeps serving)")
    mutating(p)
    p = sub.add_parser("undeploy", help="remove a model: drain and unload every replica, then forget it and its ids")
    p.add_argument("model", help=MODEL_HELP)
    mutating(p, wait=False)
    d = AutoscalePolicy()
    p = sub.add_parser("autoscale", help="set a model's autoscaling policy (replicas follow its queue), or --off")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--min", type=int, help=f"fewest replicas (0: idle to zero; default {d.min_replicas})")
    p.add_argument("--max", type=int, help=f"most replicas (default {d.max_replicas})")
    p.add_argument("--target-queue-per-replica", type=float, default=d.target_queue_per_replica,
                   help="requests queued or running per replica the autoscaler aims at (default %(default)s)")
    p.add_argument("--upscale-delay", type=duration_arg, default=d.upscale_delay_s, metavar="DURATION",
                   help="how long the queue must stay above target before adding replicas (default %(default)ss)")
    p.add_argument("--downscale-delay", type=duration_arg, default=d.downscale_delay_s, metavar="DURATION",
                   help="how long it must stay below before removing replicas, and since the last change "
                        "(default %(default)ss)")
    p.add_argument("--idle-to", choices=["WARM", "COLD", "warm", "cold"], default=str(d.idle_to),
                   help="where replicas the autoscaler takes down go, idle or not (default %(default)s; WARM where "
                        "the node's CPU cache holds them, else COLD)")
    p.add_argument("--idle-after", type=duration_arg, default=d.idle_after_s, metavar="DURATION",
                   help="nothing queued or running for this long: down to --min (default %(default)ss)")
    p.add_argument("--max-wait", default=f"{d.max_wait_s:g}s", metavar="DURATION",
                   help="add a replica when the oldest queued request has waited longer (default %(default)s; "
                        "'off': no such signal)")
    p.add_argument("--off", action="store_true", help="turn autoscaling off (the replica count stays as it is)")
    mutating(p, wait=False)
    p = sub.add_parser("status", help="nodes, cards, models and replicas, folded from the log; "
                                      "with MODEL: that model, every replica and its recent events")
    p.add_argument("model", nargs="?", help="one model's view: " + MODEL_HELP)
    common(p)
    p.add_argument("--watch", action="store_true",
                   help=f"print again on every event, and at least every {WATCH_TICK_S:g} s")
    p.add_argument("--all", action="store_true", help="also list replicas unloaded and no longer wanted")
    p = sub.add_parser("events", help="the event log, readable")
    common(p)
    p.add_argument("--model", help="only this model's events: " + MODEL_HELP)
    p.add_argument("--since", type=seq_arg, default=1, metavar="SEQ", help="first sequence (default %(default)s)")
    p.add_argument("--follow", action="store_true", help="keep printing new events as they are appended")
    p = sub.add_parser("history", help="one model's or replica's timeline with causes")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replica-id", type=int, help="only this replica's events")
    p.add_argument("--limit", type=int, default=HISTORY_LIMIT,
                   help=f"the newest N events, 1-{H.MAX_LIMIT:,} (default %(default)s)")
    p.add_argument("--before", type=int, metavar="SEQ", help="only events before this sequence (the next older page)")
    common(p, json_flag=False)
    p = sub.add_parser("logs", help="a replica's recent log lines, from the agent of its node (bounded)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--replica-id", type=int, help="only this replica (default: each replica on a node)")
    p.add_argument("--lines", type=int, default=L.DEFAULT_LINES,
                   help=f"the newest N lines of each replica, 1-{L.MAX_LINES} (default %(default)s)")
    common(p)
    p = sub.add_parser("replay", help="the cluster as it was at a sequence or time")
    common(p)
    p.add_argument("--until", required=True, help="sequence number or ISO time (with timezone)")
    p.add_argument("--strict", action="store_true", help="fail on any anomaly in the history")
    p = sub.add_parser("init", help="create (or check) the streams and buckets of a deployment (admin)")
    common(p, json_flag=False)
    p.add_argument("--stream-replicas", type=int, default=None,
                   help="replicas of the streams and buckets (3 on a NATS cluster; default env NDIF_STREAM_REPLICAS, "
                        "else 1)")
    p.add_argument("--new-history", action="store_true",
                   help="start an empty event stream even where the rest of a deployment exists (the history "
                        "was deleted on purpose); without it that is an error")
    p = sub.add_parser("controller", help="run a controller (several may run: queue group)")
    common(p, json_flag=False)
    p.add_argument("--heartbeat-grace", type=float, default=20.0,
                   help="seconds without a node heartbeat before NodeLost (default %(default)s)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="in-place restarts of a failed replica before it is placed elsewhere (default %(default)s)")
    p.add_argument("--stream-replicas", type=int, default=None,
                   help="replicas of the streams and buckets it creates (3 on a NATS cluster; "
                        "default env NDIF_STREAM_REPLICAS, else 1)")
    p.add_argument("--min-deploy-s", type=float, default=300.0,
                   help="seconds a replica stays before pressure may evict it (default %(default)s)")
    p.add_argument("--headroom", type=float, default=PADDING,
                   help="fraction charged over a model's measured size, unless its deploy gave one "
                   "(default %(default)s)")
    p.add_argument("--max-replicas-per-model", type=int, default=None,
                   help="most replicas one model may have (env NDIF_MAX_REPLICAS_PER_MODEL; default 128)")
    p.add_argument("--max-replicas-per-command", type=int, default=None,
                   help="most replicas one deploy/scale may ask (env NDIF_MAX_REPLICAS_PER_COMMAND; default 64)")
    p.add_argument("--inventory", default=os.environ.get("NDIF_INVENTORY") or None,
                   help="the operator's inventory (JSON: node id -> cards, labels; schemas/inventory.py), recorded "
                        "in the log; a node then offers only what it declares (env NDIF_INVENTORY)")
    p.add_argument("--model-roots", default=None,
                   help="directories (separated by ':') under which a model a request names may live "
                        "(env NDIF_MODEL_ROOTS; default $NDIF_HOME/models); the operator's own deploys are not limited")
    add_snapshot_flags(p)


def add_dashboard_command(sub: Any) -> None:
    """`ndif dashboard`: the read-only web view of the log (docs/dashboard.md). The defaults are the
    dashboard server's (controlplane/dashboard/server.py), spelled here so that building the parser
    imports no web server (a base install has none)."""
    p = sub.add_parser("dashboard", help="the read-only web dashboard: the cluster live and at any past seq")
    p.add_argument("--nats", default=os.environ.get("NDIF_NATS_URL", DEFAULT_URL),
                   help="NATS URL (env NDIF_NATS_URL; default %(default)s)")
    p.add_argument("--host", default=DASHBOARD_HOST,
                   help="address to listen on (default %(default)s; another one shows the cluster to whoever reaches it)")
    p.add_argument("--port", type=int, default=DASHBOARD_PORT, help="port (default %(default)s; 0 = a free one)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name (or address) the page is reached by, besides the loopback names and --host; "
                        "any other Host header is refused (repeat)")


async def _dashboard(a: argparse.Namespace) -> int:
    from controlplane.dashboard.server import serve

    if not 0 <= a.port <= 65535:
        raise errs.InvalidCommand(f"--port must be 0..65535, got {a.port}")
    from controlplane.store.credentials import ensure_dashboard_token, resolve

    # The operator token `ndif up` keeps ($NDIF_HOME/auth/dashboard.token), made here where there is none.
    await serve(a.nats, host=a.host, port=a.port, creds=resolve("dashboard", url=a.nats),
                token=ensure_dashboard_token(), allowed_hosts=tuple(a.allowed_host))
    return 0


ADMIN: dict[str, Callable[[argparse.Namespace, AdminClient], Coroutine[Any, Any, int]]] = {
    "deploy": _command, "scale": _command, "scale-down": _command, "evict": _command, "restart": _command,
    "undeploy": _command, "autoscale": _command, "status": _status, "events": _events, "history": _history, "logs": _logs, "replay": _replay,
}


async def _init(a: argparse.Namespace) -> int:
    """Create (or check) the streams and buckets of a deployment, as its admin (deploy/head.sh runs it
    before the services, which may only check that they exist)."""
    from controlplane.store.eventstore import JetStreamEventLog

    log = await JetStreamEventLog.open(a.nats, timeout=a.timeout, ensure=False, replicas=a.stream_replicas)
    try:
        await log.ensure(start_new_history=a.new_history)
    finally:
        await log.close()
    print(f"streams and buckets ready on {a.nats}")
    return 0


async def run_admin(a: argparse.Namespace) -> int:
    if a.cmd == "controller":
        return await _controller(a)
    if a.cmd == "init":
        return await _init(a)
    if a.cmd == "dashboard":
        return await _dashboard(a)
    async with await AdminClient.open(a.nats, timeout=a.timeout) as admin:
        return await ADMIN[a.cmd](a, admin)


def exit_code(exc: BaseException) -> int:
    for cls, code in EXIT.items():
        if isinstance(exc, cls):
            return code
    return 1


def json_error(kind: str, message: str, code: int) -> None:
    """What a command run with --json prints on stdout when it fails (stderr stays for logs)."""
    _out({"ok": False, "error": kind, "message": message, "exit_code": code})


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ndif-controlplane")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one JSON line on stdout when the command line has --json."""

    json_errors = False  # set by main() from the command line, before parsing

    def error(self, message: str) -> NoReturn:
        if Parser.json_errors:
            json_error("InvalidCommand", f"{self.prog}: {message}", 2)
            sys.exit(2)
        super().error(message)


def build_parser(extra: Callable[[Any], None] | None = None) -> tuple[Parser, Any]:
    """The `ndif` parser and its subparsers object (tests walk it to check every flag's help and docs)."""
    parser = Parser(prog="ndif", description="ndif control plane: admin commands, services and requests "
                                             "(docs/cli.md has every command, its --json shape and exit codes)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    add_admin_commands(sub)
    add_dashboard_command(sub)
    if extra:
        extra(sub)
    return parser, sub


def main(argv: list[str] | None = None, extra: Callable[[Any], None] | None = None,
         runners: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    parser, sub = build_parser(extra)
    Parser.json_errors = "--json" in args
    if not args:  # bare `ndif`: the help, and exit 2 because no command ran
        parser.print_help()
        return 2
    for arg in args:
        old = arg.split("=", 1)[0]
        if old in REPLACED_FLAGS:
            msg = f"{old} is no longer taken: use {REPLACED_FLAGS[old]} (GiB, 2**30 bytes)"
            if Parser.json_errors:
                json_error("InvalidCommand", f"ndif: {msg}", 2)
            else:
                print(f"ndif: error: {msg}", file=sys.stderr)
            return 2
    if not args[0].startswith("-") and args[0] not in sub.choices:
        near = difflib.get_close_matches(args[0], list(sub.choices), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        parser.error(f"unknown command {args[0]!r}{hint} (`ndif --help` lists them)")
    a, unknown = parser.parse_known_args(args)
    if unknown:  # said by the command's own parser: its usage, and where its flags are listed
        (sub.choices.get(a.cmd) or parser).error(
            f"unrecognized arguments: {' '.join(unknown)[:300]}" + (f" (`ndif {a.cmd} -h` lists its flags)" if a.cmd else ""))
    if a.cmd is None:  # only options, no command (`ndif --json`)
        parser.print_help()
        return 2
    as_json = bool(getattr(a, "json", False))
    configure("INFO" if a.cmd in LONG_RUNNING else "WARNING")
    runner = (runners or {}).get(a.cmd, run_admin)
    try:
        require(a.cmd)
        return asyncio.run(runner(a))
    except KeyboardInterrupt:
        # Ctrl-C: say what was already done (a stored request runs on; an appended command stands),
        # so that nobody takes the interruption for a cancellation.
        note = getattr(a, "on_interrupt", None)
        print(f"ndif: interrupted{': ' + note if note else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ndif status | head`): not an error of ours. Quiet, and the exit
        # status a shell gives a command killed by SIGPIPE (141); stdout is pointed at /dev/null so
        # that Python's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except errs.NdifError as exc:
        if as_json:
            json_error(type(exc).__name__, str(exc), exit_code(exc))
        else:
            print(printable(f"error: {exc}"), file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:
        if not as_json:
            raise
        traceback.print_exc(file=sys.stderr)
        json_error(type(exc).__name__, str(exc) or type(exc).__name__, 1)
        return 1
