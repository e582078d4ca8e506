"""Plain-text views of the cluster projection for people (`ndif status`, the demo, `ndif replay`)."""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Sequence

import msgspec

from controlplane.core.placement import padded
from controlplane.core.projections import ClusterState, ReplicaView
from controlplane.core.projections.cluster import ModelView
from controlplane.core.reasons import event_reason, policy_text
from controlplane.store.heartbeats import STALE_S
from schemas import events as E
from schemas.keys import display_name
from schemas.status import Level, ReplicaState
from schemas.units import GiB, gib

# What a terminal or a line splitter acts on rather than shows: controls (Cc), format characters
# (Cf: direction marks, zero-width and invisible ones) and line and paragraph separators (Zl, Zp).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def printable(text: str) -> str:
    """`text` as one line a terminal shows and never acts on: each control, format character or
    line separator is written as its escape (`\\x1b`, `\\n`, `\\u2028`), so a node's hostname or an
    error cannot clear the screen, move the cursor, hide text or start a fake line."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_escape(c) if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")


def _gib(n: int) -> str:
    """GiB with one decimal, three below 1 GiB (a tiny model's use is not shown as 0.0: the
    dashboard's sizes read the same way), `<0.001` for a use below that."""
    g = n / GiB
    if 0 < g < 0.0005:
        return "<0.001"
    return f"{g:.3f}" if 0 < g < 1 else f"{g:,.1f}"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    rows = [[printable(str(c)) for c in r] for r in rows]  # a cell is what it says, on one line
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def holds(r: ReplicaView) -> bool:
    """Does the replica hold (or is it taking) anything on its node: cards, or CPU memory (WARM)?
    A COLD replica that holds nothing is shown without its old node and cards."""
    return r.on_gpu or r.cpu_bytes > 0


def hot_count(state: ClusterState, model_key: str) -> int:
    """Replicas of a model whose weights are on GPU now (observed), not the ones asked for."""
    return sum(1 for r in state.model_replicas(model_key) if r.level is Level.HOT)


def heartbeat_text(age: float | None, alive: bool) -> str:
    """A node's heartbeat for people: its age, marked STALE past `STALE_S` (or none kept at all)."""
    if age is None:
        return "none (STALE)" if alive else "none"
    return f"{age:.1f}s ago" + (" (STALE)" if age > STALE_S and alive else "")


def gone(r: ReplicaView) -> bool:
    """A replica that no longer exists for an operator: unloaded, holding nothing, not wanted anywhere
    (its id stays in the log and in `--all`)."""
    return r.state is ReplicaState.UNLOADED and r.desired is Level.COLD and not holds(r)


def render_status(state: ClusterState, heartbeats: dict[str, float | None] | None = None, *,
                  show_all: bool = False, pools: dict[str, tuple[int, int]] | None = None) -> str:
    """Nodes and cards (GiB reserved / total), models, replicas (desired vs observed), anomalies.

    With `heartbeats` (node id -> seconds since its last heartbeat; `ndif status`, not `replay`),
    the nodes table has a heartbeat column; with `pools` (node id -> its agent's replica process pool,
    ready and size, from its heartbeat; nodes without one absent) a pool column when any has one. Replicas that no longer exist (`gone`) are counted, not
    listed, unless `show_all`."""
    out = [f"cluster at seq {state.seq}"]
    if state.nodes:
        rows = []
        for node_id in sorted(state.nodes):
            node = state.nodes[node_id]
            cards = " ".join(f"gpu{c.index}:{_gib(c.reserved_bytes)}/{_gib(c.total_bytes)}"
                             for c in state.node_cards(node_id))
            kinds = ",".join(sorted({g.kind for g in node.gpus if g.kind}))
            labels = ",".join(f"{k}={v}" for k, v in sorted(node.labels.items()))
            rows.append([node_id, "up" if node.alive else "LOST", cards or "-",
                         f"{_gib(state.cpu_committed(node_id))}/{_gib(node.cpu_cache_bytes)}",
                         " ".join(x for x in (kinds, labels) if x) or "-", node.ray_node_id[:12] or "-"])
            if heartbeats is not None:
                rows[-1].append(heartbeat_text(heartbeats.get(node_id), node.alive))
            if pools:  # a pool column only where some agent keeps a pool
                pool = pools.get(node_id)
                rows[-1].append(f"{pool[0]}/{pool[1]}" if pool is not None else "-")
        header = (["node", "state", "gpus", "cpu cache committed", "kind labels", "ray node"]
                  + (["heartbeat"] if heartbeats is not None else []) + (["pool"] if pools else []))
        out += ["", "NODES (GiB reserved/total)"] + _table(rows, header)
    if state.models:
        rows = []
        for mk in sorted(state.models):
            m = state.models[mk]
            size = gib(m.registration.size_bytes) if m.registration else "?"
            charge = _charge(state, mk)
            rows.append([display_name(mk), str(state.model_status(mk)), str(hot_count(state, mk)),
                         str(state.replica_count(mk)), str(m.target_hot), size,
                         gib(charge) if charge is not None else "?",
                         f"{m.headroom:.0%}" if m.headroom is not None else "default",
                         str(m.gpus) if m.gpus else "auto", "yes" if m.dedicated else "no", autoscale_cell(m)])
        out += ["", "MODELS (hot: on GPU now; replica count: desired HOT; target_hot: of the last deploy/scale)"] + _table(
            rows, ["model", "status", "hot", "replica count", "target_hot", "size", "charge", "headroom", "gpus",
                   "dedicated", "autoscale"])
    live = [r for r in state.replicas.values() if show_all or not gone(r)]
    hidden = len(state.replicas) - len(live)
    if live:
        rows = []
        for r in sorted(live, key=lambda r: (display_name(r.model_key), r.replica_id)):
            if not holds(r) or not r.node_id:
                where = "-"
            elif r.on_gpu:
                where = f"{r.node_id}:{','.join(map(str, r.gpu_indices))}"
            else:
                where = f"{r.node_id}:cpu"
            rows.append([display_name(r.model_key), str(r.replica_id), str(r.level), str(r.desired), str(r.state),
                         where, str(r.since_seq), r.error or ""])  # last column: the error in full
        out += ["", "REPLICAS"] + _table(rows, ["model", "id", "level", "desired", "state", "node:gpus", "since",
                                                "error"])
    if hidden:
        out += [f"({hidden} replica(s) unloaded and no longer wanted are not listed: `ndif status --all` lists them)"]
    if state.anomaly_count or state.skipped:
        out += ["", f"ANOMALIES: {state.anomaly_count} (unreadable events: {state.skipped})"]
        out += [printable(f"  seq {a.seq} {a.event_type}: {a.message}") for a in state.anomalies[-5:]]
    return "\n".join(map(printable, out))


def autoscale_cell(m: ModelView) -> str:
    """A model's autoscaling in a table cell: off, its bounds, or manual (an operator's count stands)."""
    if m.autoscale is None:
        return "off"
    bounds = f"{m.autoscale.min_replicas}..{m.autoscale.max_replicas}"
    return f"{bounds} manual" if m.autoscale_manual else bounds


def _charge(state: ClusterState, model_key: str) -> int | None:
    """What placement charges one replica of the model: its size plus its recorded headroom (None
    when the model has no size, or no headroom recorded: then the controller's default applies)."""
    m = state.models[model_key]
    if m.registration is None or m.headroom is None:
        return None
    return padded(m.registration.size_bytes, m.headroom)


def status_json(state: ClusterState, heartbeats: dict[str, float | None] | None = None,
                pools: dict[str, tuple[int, int]] | None = None) -> dict[str, object]:
    """`ndif status --json` / `ndif replay --json`: the stable shape documented in docs/cli.md.

    With `heartbeats` (`ndif status` only) each node also has `heartbeat_age_s` (None: no heartbeat
    kept) and `stale` (a node the log says is alive whose heartbeat is older than `STALE_S`)."""
    nodes = []
    for node_id in sorted(state.nodes):
        node = state.nodes[node_id]
        kinds = {g.index: g.kind for g in node.gpus}
        nodes.append({
            "node_id": node_id, "alive": node.alive, "hostname": node.hostname, "ray_node_id": node.ray_node_id,
            "labels": dict(node.labels),
            "cpu_cache_bytes": node.cpu_cache_bytes, "cpu_cached_bytes": state.cpu_cached(node_id),
            "cpu_committed_bytes": state.cpu_committed(node_id),
            "gpus": [{"index": c.index, "kind": kinds.get(c.index, ""), "total_bytes": c.total_bytes, "reserved_bytes": c.reserved_bytes,
                      "committed_bytes": c.committed_bytes, "used_bytes": c.used_bytes, "free_bytes": c.free_bytes,
                      "replicas": [{"model_key": m, "replica_id": r, "bytes": b} for m, r, b in c.replicas]}
                     for c in state.node_cards(node_id)],
        })
        if heartbeats is not None:
            age = heartbeats.get(node_id)
            nodes[-1]["heartbeat_age_s"] = age
            nodes[-1]["stale"] = node.alive and (age is None or age > STALE_S)
        pool = (pools or {}).get(node_id)
        if pool is not None:  # the agent's replica process pool, from its heartbeat (absent: it keeps none)
            nodes[-1]["pool"] = {"ready": pool[0], "size": pool[1]}
    models = []
    for mk in sorted(state.models):
        m = state.models[mk]
        models.append({
            "model_key": mk, "name": display_name(mk), "status": str(state.model_status(mk)),
            "replica_count": state.replica_count(mk), "hot": hot_count(state, mk), "target_hot": m.target_hot,
            "dedicated": m.dedicated,
            "size_bytes": m.registration.size_bytes if m.registration else None,
            "checkpoint": m.registration.checkpoint if m.registration else None,
            "next_replica_id": m.next_replica_id,
            "headroom": m.headroom, "charge_bytes": _charge(state, mk), "gpus": m.gpus,
            "requires": m.requires.terms() if m.requires is not None else [],
            "autoscale": msgspec.to_builtins(m.autoscale) if m.autoscale is not None else None,
            "autoscale_manual": m.autoscale_manual, "autoscale_condition": m.autoscale_condition,
        })
    replicas = [{
        "model_key": r.model_key, "replica_id": r.replica_id, "level": str(r.level), "desired": str(r.desired),
        "state": str(r.state), "node_id": r.node_id if holds(r) else "",
        "gpu_indices": list(r.gpu_indices) if r.on_gpu else [], "last_node_id": r.node_id,
        "bytes_per_gpu": r.bytes_per_gpu, "cpu_bytes": r.cpu_bytes, "dedicated": r.dedicated,
        "restarts": r.restarts, "error": r.error, "since_seq": r.since_seq,
    } for r in sorted(state.replicas.values(), key=lambda r: (r.model_key, r.replica_id))]
    anomalies = [{"seq": a.seq, "event_type": a.event_type, "message": a.message, "model_key": a.model_key,
                  "replica_id": a.replica_id} for a in state.anomalies]
    return {"seq": state.seq, "nodes": nodes, "models": models, "replicas": replicas, "anomalies": anomalies,
            "anomaly_count": state.anomaly_count, "skipped": state.skipped}


def explain_decision(state: ClusterState, decision: Sequence[tuple[int, E.Event]]) -> dict[tuple[str, int], str]:
    """Why each replica a decision placed went where it did, read off the decision's events and the
    cluster as it was just before them (`state`, which this folds forward through them): a WARM copy
    reused, the evictions that made room for it, the fit on its cards (needed vs free there), and
    the spread (how many replicas of the model the node and each of its cards held)."""
    victims: dict[tuple[str, int], list[str]] = {}
    for _, e in decision:
        if isinstance(e, E.ReplicaEvictionRequested) and e.by_model_key is not None and e.by_replica_id is not None:
            victims.setdefault((e.by_model_key, e.by_replica_id), []).append(
                f"{display_name(e.model_key)}#{e.replica_id} ({e.reason} -> {e.target})")
    out: dict[tuple[str, int], str] = {}
    for seq, e in decision:
        if isinstance(e, E.ReplicaScheduled):
            out[(e.model_key, e.replica_id)] = _why_here(state, e, victims.get((e.model_key, e.replica_id), []))
        state.apply(seq, e)
    return out


def _why_here(state: ClusterState, e: E.ReplicaScheduled, victims: list[str]) -> str:
    cards = {c.index: c for c in state.node_cards(e.node_id)}
    per_card: Counter[int] = Counter()
    on_node = 0
    for r in state.model_replicas(e.model_key):
        if r.node_id == e.node_id and r.on_gpu and r.desired is Level.HOT and r.replica_id != e.replica_id:
            on_node += 1
            per_card.update(r.gpu_indices)
    parts = []
    if e.source is Level.WARM:
        parts.append(f"WARM reuse: its weights were in {e.node_id}'s CPU cache")
    if victims:
        parts.append("room made by evicting " + ", ".join(victims))
    free = ", ".join(f"card {g} had {gib(cards[g].free_bytes)} free" for g in e.gpu_indices if g in cards)
    parts.append(f"fit: needs {gib(e.bytes_per_gpu)} on each of {len(e.gpu_indices)} card(s), {free}")
    spread = ", ".join(f"card {i}: {per_card[i]}" for i in sorted(cards))
    parts.append(f"spread: {on_node} other replica(s) of the model on {e.node_id} ({spread})")
    return "; ".join(parts)


def render_model(state: ClusterState, model_key: str, recent: list[tuple[int, E.Event]]) -> str:
    """`ndif status MODEL`: the model, every replica it has had (node, cards, level, state, restarts,
    last error in full), and its recent events with what they say."""
    m = state.models[model_key]
    charge = _charge(state, model_key)
    out = [f"{display_name(model_key)}  (model key {model_key})",
           f"  status {state.model_status(model_key)}; hot {hot_count(state, model_key)} of replica count "
           f"{state.replica_count(model_key)}; size {gib(m.registration.size_bytes) if m.registration else '?'}, "
           f"charged {gib(charge) if charge is not None else '?'} per replica; gpus {m.gpus or 'auto'}; "
           f"dedicated {'yes' if m.dedicated else 'no'}"]
    if m.autoscale is not None:
        state_text = ("manual: an operator's count stands until `ndif autoscale` again" if m.autoscale_manual else
                      f"watching {m.autoscale_condition} since {m.autoscale_since:%H:%M:%S}"
                      if m.autoscale_condition and m.autoscale_since else "steady")
        out.append(f"  autoscale {policy_text(m.autoscale)} ({state_text})")
    if m.rollout:
        out.append(f"  rolling restart: restarting {m.rollout_current}, then {', '.join(map(str, m.rollout))}")
    if m.last_rejection is not None:
        rj = m.last_rejection
        out.append(f"  last refused placement (seq {rj.seq}): {rj.replicas} replica(s), needed {gib(rj.needed_bytes)}, "
                   f"the most any node had free {gib(rj.free_bytes)}")
    rows = []
    for r in sorted(state.model_replicas(model_key), key=lambda r: r.replica_id):
        cards = ",".join(map(str, r.gpu_indices)) if r.on_gpu else ("cpu" if r.cpu_bytes else "-")
        rows.append([str(r.replica_id), r.node_id or "-", cards, str(r.level), str(r.desired), str(r.state),
                     str(r.restarts), str(r.since_seq), r.error or ""])
    out += ["", "REPLICAS"] + (_table(rows, ["id", "node", "gpus", "level", "desired", "state", "restarts", "since",
                                              "last error"]) if rows else ["  (none)"])
    out += ["", f"RECENT EVENTS (last {len(recent)}; `ndif history {display_name(model_key)}` has them all)"]
    for seq, e in recent:
        rid = f"#{e.replica_id}" if isinstance(e, E.ReplicaEvent) else ""
        out.append(f"  {seq:>7}  {e.ts:%Y-%m-%d %H:%M:%S}Z  {E.event_tag(e)}{rid}  {event_reason(e)}".rstrip())
    return "\n".join(map(printable, out))
