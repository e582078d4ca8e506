"""The dashboard's endpoints over time: plot series, replica lifelines, anomalies, Prometheus metrics.

Each takes the position of the timeline (`until`: a seq or an ISO time; live when absent) and a
window (`window`: seconds, or `all`), so a past position shows that moment's figures. Log-derived
figures are exact at any position; the queue figures are what this dashboard sampled, marked so
(`"sampled": true`, null where it was not sampling). Endpoints: docs/dashboard.md.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from controlplane.core.projections import ClusterState
from controlplane.dashboard.metrics import CONTENT_TYPE, render
from controlplane.dashboard.model import BadQuery, DashboardModel, anomalies_json, int_param, outage_spans
from controlplane.dashboard.past import Past
from controlplane.dashboard.sampler import QueueSamples

DEFAULT_WINDOW_S = 900
MAX_WINDOW_S = 30 * 86400
DEFAULT_POINTS = 300
MAX_POINTS = 2000
_enc = msgspec.json.Encoder()


class Served(Protocol):
    model: DashboardModel
    past: Past | None
    samples: QueueSamples
    metrics: CollectorRegistry


def _json(obj: Any) -> web.Response:
    return web.Response(body=_enc.encode(obj), content_type="application/json")


def query_int(q: Any, name: str, *, lo: int, hi: int, default: int) -> int:
    """`name` from the query, checked to lie in lo..hi; `default` when absent."""
    v = int_param(q, name, lo=lo, hi=hi)
    return default if v is None else v


async def position(d: Served, q: Any) -> tuple[int, bool, float, ClusterState]:
    """(seq, live, the time the window ends, the state there) of `?until=`: now when live, the
    seq's time when past."""
    m = d.model
    until = q.get("until")
    if until is None or until in ("", "live"):
        return m.seq, True, time.time(), m.live
    if len(until) > 64:
        raise BadQuery("until is too long (a sequence number or an ISO time)")
    assert d.past is not None
    seq, st = await d.past.at(m.parse_until(until))
    if seq >= m.seq:
        return m.seq, True, time.time(), m.live
    return seq, False, st.max_ts.timestamp() if st.max_ts is not None else 0.0, st


def window(m: DashboardModel, q: Any, t1: float) -> float:
    """Where the window starts: `window` seconds before `t1` (`all`: all memory keeps), never before
    what memory keeps begins (a young cluster's plots use their whole width)."""
    first = m.start_ts
    if q.get("window") == "all":
        return min(first, t1 - 10) if first is not None else t1 - DEFAULT_WINDOW_S
    t0 = t1 - query_int(q, "window", lo=10, hi=MAX_WINDOW_S, default=DEFAULT_WINDOW_S)
    return max(t0, min(first, t1 - 10)) if first is not None else t0


def add_routes(app: web.Application, d: Served) -> None:
    """Register the endpoints on the dashboard's app."""

    async def series(request: web.Request) -> web.StreamResponse:
        q = request.query
        m = d.model
        seq, live, t1, st = await position(d, q)
        t0 = window(m, q, t1)
        points = query_int(q, "points", lo=10, hi=MAX_POINTS, default=DEFAULT_POINTS)
        outages = outage_spans(st, t0, t1)
        out: dict[str, Any] = {"seq": seq, "live": live, "t0": t0, "t1": t1, "outages": outages}
        model = q.get("model")
        if model:
            mk = m.resolve_model(model[:2000])
            out["model_key"] = mk
            out["replicas"] = m.series.model_window(mk, t0, t1, seq, points, outages)
            out["queue"] = {"sampled": True, **d.samples.series(mk, t0, t1, points)}
        node = q.get("node")
        if node:
            if node not in st.nodes:
                raise BadQuery(f"unknown node {node[:100]!r} at seq {seq}")
            out["node"] = m.series.node_window(st, node, t0, t1, seq, points, outages)
        if not model and not node:
            raise BadQuery("series needs ?model=MODEL and/or ?node=NODE_ID")
        return _json(out)

    async def lifeline(request: web.Request) -> web.StreamResponse:
        q = request.query
        m = d.model
        seq, live, t1, st = await position(d, q)
        t0 = window(m, q, t1)
        body = m.lifeline((q.get("model") or "")[:2000] or None, seq, t0, t1, outage_spans(st, t0, t1))
        body["live"] = live
        return _json(body)

    async def anomalies(request: web.Request) -> web.StreamResponse:
        _, _, _, st = await position(d, request.query)
        return _json(anomalies_json(st))

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(body=render(d.metrics), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/api/series", series)
    app.router.add_get("/api/lifeline", lifeline)
    app.router.add_get("/api/anomalies", anomalies)
    app.router.add_get("/metrics", metrics)
