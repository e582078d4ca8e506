"""Prometheus metrics of the cluster, served by the dashboard at `/metrics` (docs/dashboard.md).

One custom collector reads, at scrape time, what the dashboard already holds: the fold of the log
(event-log, replica, model and GPU figures) and the dispatcher's last answer (queue and latency
figures). Nothing is counted twice and nothing is kept for Prometheus alone. Its own registry, so
two dashboards in one process (tests) never share metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.dashboard.model import DashboardModel
from controlplane.dashboard.series import PHASES, replica_phase
from schemas.keys import display_name
from schemas.status import Level, ModelStatus, ReplicaState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Source(Protocol):
    model: DashboardModel
    queues: dict[str, Any]


def model_labels(keys: list[str]) -> dict[str, str]:
    """The `model` label of each key: its display name, or the full key where two share a name."""
    names: dict[str, list[str]] = {}
    for k in keys:
        names.setdefault(display_name(k), []).append(k)
    return {k: (n if len(ks) == 1 else k) for n, ks in names.items() for k in ks}


class ClusterCollector(Collector):
    def __init__(self, source: Source) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        m = self.source.model
        st = m.live
        q = self.source.queues
        qmodels: dict[str, dict[str, Any]] = q.get("models") or {}
        keys = sorted(set(st.models) | {k[0] for k in st.replicas} | set(qmodels))
        label = model_labels(keys)

        # ---- the event log
        yield GaugeMetricFamily("ndif_event_log_last_seq", "Sequence of the last event the dashboard folded.",
                                value=st.seq)
        ev = CounterMetricFamily("ndif_events", "Events of NDIF_EVENTS folded since this dashboard started (from its snapshot), by type.", labels=["type"])
        for t, n in sorted(m.type_counts.items()):
            ev.add_metric([t], n)
        yield ev
        yield CounterMetricFamily("ndif_event_log_anomalies", "Events the state machine had no rule for.",
                                  value=st.anomaly_count)
        yield CounterMetricFamily("ndif_event_log_skipped", "Stored messages no reader of this version can use.",
                                  value=st.skipped)
        last_t = m.time_of(st.seq)
        if last_t is not None:
            yield GaugeMetricFamily("ndif_event_log_last_event_timestamp_seconds",
                                    "Time of the latest event folded (epoch seconds).", value=last_t)

        # ---- models and replicas
        status = GaugeMetricFamily("ndif_model_status", "1 for the model's status (Available, Progressing, Failed, ...).",
                                   labels=["model", "status"])
        target = GaugeMetricFamily("ndif_model_target_replicas", "HOT replicas the model is deployed for.",
                                   labels=["model"])
        by_level = GaugeMetricFamily("ndif_replicas", "Replicas by observed level (HOT, WARM, COLD).",
                                     labels=["model", "level"])
        by_state = GaugeMetricFamily("ndif_replicas_by_state", "Replicas by observed state.", labels=["model", "state"])
        by_phase = GaugeMetricFamily("ndif_replicas_by_phase", "Replicas by phase (the dashboard's plots and lifelines).",
                                     labels=["model", "phase"])
        for mk in keys:
            if mk not in st.models and not any(True for _ in st.model_replicas(mk)):
                continue
            lab = label[mk]
            now = st.model_status(mk)
            for s in ModelStatus:
                status.add_metric([lab, s.value], 1.0 if s is now else 0.0)
            mv = st.models.get(mk)
            target.add_metric([lab], mv.target_hot if mv else 0)
            lv = dict.fromkeys(Level, 0)
            ss: dict[ReplicaState, int] = {}
            ph = dict.fromkeys(PHASES, 0)
            for r in st.model_replicas(mk):
                lv[r.level] += 1
                ss[r.state] = ss.get(r.state, 0) + 1
                ph[replica_phase(r)] += 1
            for lvl, n in lv.items():
                by_level.add_metric([lab, lvl.value], n)
            for state, n in sorted(ss.items()):
                by_state.add_metric([lab, state.value], n)
            for p, n in ph.items():
                by_phase.add_metric([lab, p], n)
        yield from (status, target, by_level, by_state, by_phase)

        # ---- nodes and GPU memory
        up = GaugeMetricFamily("ndif_node_up", "1 while the node is alive in the log.", labels=["node"])
        total = GaugeMetricFamily("ndif_gpu_memory_total_bytes", "A card's memory.", labels=["node", "gpu"])
        committed = GaugeMetricFamily("ndif_gpu_memory_committed_bytes",
                                      "Bytes of replicas meant to stay HOT on a card (what placement plans against).",
                                      labels=["node", "gpu"])
        reserved = GaugeMetricFamily("ndif_gpu_memory_reserved_bytes",
                                     "Bytes held or being loaded on a card (leaving replicas included).",
                                     labels=["node", "gpu"])
        cpu = GaugeMetricFamily("ndif_cpu_cache_bytes", "A node's CPU cache: held (WARM) and budget.",
                                labels=["node", "kind"])
        for node_id in sorted(st.nodes):
            node = st.nodes[node_id]
            up.add_metric([node_id], 1.0 if node.alive else 0.0)
            for g in node.gpus:
                gl = [node_id, str(g.index)]
                total.add_metric(gl, g.memory_bytes)
                committed.add_metric(gl, st.card_committed(node_id, g.index))
                reserved.add_metric(gl, st.card_reserved(node_id, g.index))
            cpu.add_metric([node_id, "held"], st.cpu_cached(node_id))
            cpu.add_metric([node_id, "budget"], node.cpu_cache_bytes)
        yield from (up, total, committed, reserved, cpu)

        # ---- queues and latency (the dispatcher's last answer)
        yield GaugeMetricFamily("ndif_dispatcher_up", "1 if a dispatcher answered the dashboard's last ask.",
                                value=1.0 if q.get("dispatcher") else 0.0)
        waiting = GaugeMetricFamily("ndif_queue_waiting_requests",
                                    "Requests waiting: held by the dispatcher plus not yet taken from the stream.",
                                    labels=["model"])
        running = GaugeMetricFamily("ndif_queue_running_requests", "Requests running on replicas.", labels=["model"])
        oldest = GaugeMetricFamily("ndif_queue_oldest_wait_seconds", "How long the oldest waiting request has waited.",
                                   labels=["model"])
        done = CounterMetricFamily("ndif_requests_completed", "Requests answered COMPLETED (since the dispatcher started).",
                                   labels=["model"])
        failed = CounterMetricFamily("ndif_requests_errors", "Requests answered ERROR by a replica (since the dispatcher started).",
                                     labels=["model"])
        lat = HistogramMetricFamily("ndif_request_latency_seconds",
                                    "From the dispatcher taking a request to its terminal answer.", labels=["model"])
        for mk, row in sorted(qmodels.items()):
            lab = label.get(mk, mk)
            queued, pending = row.get("queued"), row.get("pending")
            if queued is not None or pending is not None:
                waiting.add_metric([lab], (queued or 0) + (pending or 0))
            if row.get("in_flight") is not None:
                running.add_metric([lab], row["in_flight"])
            if "completed" in row:  # a processor for it in the dispatcher
                oldest.add_metric([lab], row.get("oldest_wait_s") or 0.0)
                done.add_metric([lab], row.get("completed") or 0)
                failed.add_metric([lab], row.get("errors") or 0)
            h = row.get("latency_s")
            if isinstance(h, dict) and len(h.get("counts", ())) == len(h.get("le", ())) + 1:
                buckets = [(repr(float(b)), c) for b, c in zip(h["le"], h["counts"], strict=False)]
                buckets.append(("+Inf", h["counts"][-1]))
                lat.add_metric([lab], buckets, sum_value=float(h.get("sum") or 0.0))
        yield from (waiting, running, oldest, done, failed, lat)


def registry_for(source: Source) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ClusterCollector(source))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
