"""The dashboard's figures over time: log-derived series equal the fold at every position, sampled
queue figures give rates and quantiles (and unknown where nothing was sampled), lifelines follow the
replica's history, and `/metrics` parses as Prometheus text."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from controlplane.core.projections import ClusterState
from controlplane.dashboard.metrics import model_labels, registry_for, render
from controlplane.dashboard.model import BadQuery, DashboardModel, Filter, UnknownEntity
from controlplane.dashboard.sampler import QueueSamples, quantile
from controlplane.dashboard.series import MAX_KEPT, PHASES, Steps, replica_phase
from schemas.keys import display_name
from tests.strategies import histories, numbered, scripted_history

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counts(state, model_key):
    c = dict.fromkeys(PHASES, 0)
    for r in state.model_replicas(model_key):
        c[replica_phase(r)] += 1
    return c


def fold_to(items, seq, state=None):
    state = state if state is not None else ClusterState()
    for s, item in items:
        if state.seq < s <= seq:
            state.apply(s, item)
    return state


@SETTINGS
@given(histories(), st.data())
def test_series_at_any_seq_equal_the_fold_at_that_seq(events, data):
    """Replicas by phase per model and each card's bytes, read from the series at a past seq, are
    what the fold up to that seq holds (the timeline's figures are the log's, exactly), also for a
    model that starts from a snapshot (the series begin with what it holds) and keeps a small window."""
    items = numbered(events)
    start = data.draw(st.integers(0, len(items)))
    keep = data.draw(st.sampled_from([1, 2, 5, MAX_KEPT]), label="changes kept per series")
    m = DashboardModel(fold_to(items, start), window=data.draw(st.integers(1, 50)), series_keep=keep)
    m.add_all(items)
    for seq in data.draw(st.lists(st.integers(start, len(items)), min_size=1, max_size=4)):
        state = fold_to(items, seq)
        t = state.max_ts.timestamp() if state.max_ts is not None else 0.0
        for mk in {k[0] for k in m.live.replicas}:
            got = m.series.model_window(mk, t - 3600, t, seq, 50)
            if not got["t"]:  # a position older than the changes kept: said, never a wrong figure
                if got["kept_from"] is None:  # or one before the model had a replica: nothing to draw yet
                    assert not any(k[0] == mk for k in state.replicas), (mk, seq)
                    continue
                assert seq < m.series.models[mk].floor_seq  # type: ignore[operator]
                continue
            assert {p: got[p][-1] for p in PHASES} == counts(state, mk), (mk, seq)
        for node_id in state.nodes:
            w = m.series.node_window(state, node_id, t - 3600, t, seq, 50)
            for card in w["cards"]:
                if not card["t"]:
                    assert card["kept_from"] is not None
                    continue
                assert card["committed"][-1] == state.card_committed(node_id, card["index"])
                assert card["reserved"][-1] == state.card_reserved(node_id, card["index"])


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 5)), max_size=40), st.floats(0, 100),
       st.floats(0, 100), st.integers(2, 30))
def test_a_window_reads_the_step_at_each_of_its_times(changes, a, b, points):
    s = Steps(1)
    t = 0.0
    for i, (dt, v) in enumerate(changes):
        t += dt / 10
        s.put(i + 1, t, [v])
    t0, t1 = min(a, b), max(a, b)
    xs, (vals,), kept_from = s.window(t0, t1, seq_max=len(changes), points=points)
    assert kept_from is None

    def truth(at):
        i = sum(1 for x in s.t if x <= at)
        return s.vals[i - 1] if i else 0

    assert xs[0] == t0 and xs[-1] == t1 and xs == sorted(xs)
    assert len(xs) <= points + 2
    assert vals[0] == truth(t0) and vals[-1] == truth(t1)
    for x, v in zip(xs[1:-1], vals[1:-1], strict=True):
        assert v == truth(x)


def test_a_window_stops_at_its_seq():
    s = Steps(1)
    for i, v in enumerate([1, 2, 3]):
        s.put(i + 1, float(i), [v])
    assert s.window(-1, 10, seq_max=2, points=10) == ([-1, 0.0, 1.0, 10], [[0, 1, 2, 2]], None)


@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 5)), max_size=60), st.integers(1, 8),
       st.floats(0, 700), st.floats(0, 700), st.integers(0, 61))
def test_a_trimmed_series_is_exact_where_it_answers_and_says_where_it_was_clamped(changes, keep, a, b, seq_max):
    """The newest `keep` changes kept: every value a window gives is the full series' at that time, and a
    window reaching before the oldest kept change starts at `kept_from` (none at all before it)."""
    whole, kept = Steps(1, keep=10**9), Steps(1, keep=keep)
    t = 0.0
    for i, (dt, v) in enumerate(changes):
        t += dt / 10
        whole.put(i + 1, t, [v])
        kept.put(i + 1, t, [v])
    assert len(kept.seq) <= keep + keep // 4
    t0, t1 = min(a, b) / 10, max(a, b) / 10
    xs, (vals,), kept_from = kept.window(t0, t1, seq_max, points=1000)
    if kept.floor_t is None:
        assert (xs, [vals], kept_from) == (*whole.window(t0, t1, seq_max, points=1000)[:2], None)
        return
    assert (kept_from is not None) == (t0 < kept.floor_t or seq_max < kept.floor_seq)
    if not xs:
        assert seq_max < kept.floor_seq or t1 < kept.floor_t  # type: ignore[operator]
        return
    assert xs[0] == max(t0, kept.floor_t)
    full_xs, (full_vals,), _ = whole.window(xs[0], t1, seq_max, points=1000)
    assert (xs, vals) == (full_xs, full_vals)


def test_memory_stays_bounded_over_a_long_history():
    """A long generated history (12,000 replicas loaded and evicted, 52,000 events): each series holds
    at most its bound however many events were folded, and the figures at the end are still the fold's."""
    keep = 100
    m = DashboardModel(window=1_000, series_keep=keep)
    items = numbered(scripted_history(12_000))
    m.add_all(items)
    held = [len(s.seq) for s in [*m.series.models.values(), *m.series.cards.values()]]
    assert len(items) > 50_000 and held and max(held) <= keep + keep // 4, max(held)
    assert all(len(s.vals) == len(s.seq) * s.k and len(s.t) == len(s.seq)
               for s in [*m.series.models.values(), *m.series.cards.values()])
    assert len(m.items) <= 1_000 + 100
    t = m.time_of(m.seq) or 0.0
    for mk in m.live.models:
        got = m.series.model_window(mk, t - 10, t, m.seq, 50)
        assert {p: got[p][-1] for p in PHASES} == counts(m.live, mk)
    for node_id in m.live.nodes:
        for card in m.series.node_window(m.live, node_id, t - 10, t, m.seq, 50)["cards"]:
            assert card["committed"][-1] == m.live.card_committed(node_id, card["index"])


def row(completed, errors, queued=0, lat=None):
    return {"status": "READY", "queued": queued, "in_flight": 1, "completed": completed, "errors": errors,
            "pending": 2, "latency_s": {"le": [0.1, 1.0], "counts": lat or [0, 0, 0], "sum": 0.0, "count": 0}}


def test_sampled_rates_quantiles_resets_and_gaps():
    q = QueueSamples(poll_s=1.0)
    q.record(100.0, {"dispatcher": "d1", "models": {"m": row(0, 0, lat=[0, 0, 0])}})
    q.record(101.0, {"dispatcher": "d1", "models": {"m": row(10, 1, queued=3, lat=[5, 11, 11])}})
    q.record(102.0, {"dispatcher": "d1", "models": {"m": row(10, 1, queued=3, lat=[5, 11, 11])}})  # no change: not kept
    assert len(q.fine["m"]) == 2
    q.record(103.0, {"dispatcher": "d2", "models": {"m": row(4, 0, lat=[4, 4, 4])}})  # a new dispatcher: counters restart
    s = q.series("m", 99.0, 107.0, points=4)
    assert s["t"] == [101.0, 103.0, 105.0, 107.0]
    # (99, 101]: what was sampled from 100 on; (105, 107] ends after sampling stopped: unknown, not 0.
    # (101, 103]: the restart counts as 4 more (not -6).
    assert s["completed_per_s"] == [5.0, 2.0, 0.0, None]
    assert s["waiting"][1] == 2  # pending 2 + queued 0 after the restart
    assert s["p50_s"][1] == pytest.approx(0.05)  # 4 in (0, 0.1]
    assert q.at(101.5)["models"]["m"]["completed"] == 10
    assert q.at(50.0) is None  # not sampling then: unknown, not zero
    assert q.at(110.0) is None


def test_a_model_first_seen_mid_stretch_counts_from_zero():
    """Its processor was made since the last poll: what it did by the next one is all new; a model
    there at the first poll is a baseline (its past is unknown)."""
    q = QueueSamples(poll_s=1.0)
    q.record(10.0, {"dispatcher": "d", "models": {"old": row(50, 0)}})
    q.record(11.0, {"dispatcher": "d", "models": {"old": row(50, 0), "new": row(6, 0, lat=[6, 6, 6])}})
    new = q.series("new", 10.0, 12.0, points=1)
    assert new["completed_per_s"] == [3.0] and new["p50_s"] == [pytest.approx(0.05)]
    assert q.series("old", 10.0, 12.0, points=1)["completed_per_s"] == [0.0]


def test_no_dispatcher_answer_is_a_gap():
    q = QueueSamples(poll_s=1.0)
    q.record(1.0, {"dispatcher": "d", "models": {"m": row(0, 0)}})
    q.record(2.0, {"dispatcher": None, "error": "no dispatcher answered", "models": {}})
    q.record(9.0, {"dispatcher": "d", "models": {"m": row(5, 0)}})
    assert q.covered(1.5) and not q.covered(6.0) and q.covered(9.0)
    assert q.series("m", 0.0, 10.0, points=5)["completed_per_s"][2] is None  # (4, 6]: a gap


def test_quantile_is_prometheus_histogram_quantile():
    bounds, cum = [0.1, 1.0, 10.0], [10, 20, 20, 20]
    assert quantile(0.5, bounds, cum) == pytest.approx(0.1)
    assert quantile(0.75, bounds, cum) == pytest.approx(0.55)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 10.0  # in +Inf: the largest bound
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_lifeline_follows_the_history_and_stops_at_the_seq():
    items = numbered(scripted_history(6))
    m = DashboardModel()
    m.add_all(items)
    mk = next(iter(m.replica_rows))[0]
    t1 = m.time_of(m.seq) or 0.0
    line = m.lifeline(mk, m.seq, t1 - 3600, t1)
    assert line["replicas"] and all(r["model_key"] == mk for r in line["replicas"])
    for r in line["replicas"]:
        segs = r["segments"]
        assert all(a["t1"] == b["t0"] for a, b in zip(segs, segs[1:], strict=False))  # one unbroken line
        assert segs[-1]["phase"] == replica_phase(m.live.replicas[(mk, r["replica_id"])])
        assert all(s["type"] and s["actor"] for s in segs)  # each has the event that began it
    mid = items[len(items) // 2][0]
    past = m.lifeline(mk, mid, t1 - 3600, m.time_of(mid) or 0.0)
    for r in past["replicas"]:
        assert all(s["seq"] <= mid for s in r["segments"])
        assert r["segments"][-1]["phase"] == replica_phase(fold_to(items, mid).replicas[(mk, r["replica_id"])])


def test_short_names_resolve_as_the_cli_does():
    items = numbered(scripted_history(2))
    m = DashboardModel()
    m.add_all(items)
    mk = next(iter(m.live.models))
    short = display_name(mk).rstrip("/").rsplit("/", 1)[-1]
    assert m.resolve_model(short) == mk
    with pytest.raises(UnknownEntity):
        m.resolve_model("no-such-model")
    with pytest.raises(BadQuery):
        Filter(None, None, "NoSuchEvent", None)


class Source:
    def __init__(self, model, queues):
        self.model, self.queues = model, queues


def test_metrics_parse_as_prometheus_text_with_the_fold_and_queue_figures():
    items = numbered(scripted_history(6))
    m = DashboardModel()
    m.add_all(items)
    mk = next(iter(m.live.models))
    queues = {"dispatcher": "d", "models": {mk: {**row(7, 1, queued=2, lat=[3, 8, 8]), "oldest_wait_s": 0.5}}}
    text = render(registry_for(Source(m, queues))).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    label = model_labels([mk])[mk]
    assert fams["ndif_event_log_last_seq"].samples[0].value == m.seq
    assert sum(s.value for s in fams["ndif_events"].samples if s.name == "ndif_events_total") == len(items)
    hot = [s.value for s in fams["ndif_replicas"].samples if s.labels == {"model": label, "level": "HOT"}]
    assert hot == [sum(1 for r in m.live.model_replicas(mk) if r.level.value == "HOT")]
    assert [s.value for s in fams["ndif_requests_completed"].samples if s.name.endswith("_total")] == [7]
    assert [s.value for s in fams["ndif_queue_waiting_requests"].samples] == [4]  # queued 2 + pending 2
    lat = {s.labels.get("le"): s.value for s in fams["ndif_request_latency_seconds"].samples if s.name.endswith("_bucket")}
    assert lat == {"0.1": 3, "1.0": 8, "+Inf": 8}
    for node_id in m.live.nodes:
        for g in m.live.nodes[node_id].gpus:
            got = [s.value for s in fams["ndif_gpu_memory_committed_bytes"].samples
                   if s.labels == {"node": node_id, "gpu": str(g.index)}]
            assert got == [m.live.card_committed(node_id, g.index)]
    status = [s for s in fams["ndif_model_status"].samples if s.labels["model"] == label and s.value == 1]
    assert [s.labels["status"] for s in status] == [str(m.live.model_status(mk))]
    assert not any(math.isnan(s.value) for f in fams.values() for s in f.samples)


def test_two_keys_with_one_display_name_keep_their_full_keys():
    a = 'nnsight.modeling.language.LanguageModel:{"repo_id": "org/x", "revision": null}'
    b = 'other.Class:{"repo_id": "org/x", "revision": null}'
    assert model_labels([a, b]) == {a: a, b: b}
    assert model_labels([a]) == {a: "org/x"}


def test_the_grafana_dashboard_asks_only_for_metrics_that_are_exported():
    """deploy/grafana/ndif-dashboard.json: every metric its queries name is one `/metrics` serves."""
    items = numbered(scripted_history(4))
    m = DashboardModel()
    m.add_all(items)
    mk = next(iter(m.live.models))
    queues = {"dispatcher": "d", "models": {mk: {**row(1, 0), "oldest_wait_s": 0.1}}}
    text = render(registry_for(Source(m, queues))).decode()
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    board = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ndif-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    asked = {n for e in exprs for n in re.findall(r"\bndif_[a-z_]+", e)}
    assert asked and asked <= exported, asked - exported


def test_a_lifeline_is_down_through_an_outage_and_unbroken_around_it():
    from controlplane.dashboard.model import _cut_outages

    seg = lambda a, b, ph: [a, b, ph, "Available", "HOT", "HOT", 7, None, None]  # noqa: E731
    segs = [seg(0.0, 10.0, "HOT"), seg(10.0, 10.0, "draining"), seg(10.0, 30.0, "COLD")]
    assert _cut_outages(segs, []) == segs  # no outage: every segment as it was, zero-width ones too
    cut = _cut_outages(segs, [[5.0, 8.0], [12.0, 20.0]])
    assert [(s[0], s[1], s[2]) for s in cut] == [(0.0, 5.0, "HOT"), (5.0, 8.0, "down"), (8.0, 10.0, "HOT"),
                                                 (10.0, 10.0, "draining"), (10.0, 12.0, "COLD"), (12.0, 20.0, "down"),
                                                 (20.0, 30.0, "COLD")]
    assert all(a[1] == b[0] for a, b in zip(cut, cut[1:], strict=False)) and cut[1][3] == "cluster down"


def test_a_models_counts_begin_when_it_does_not_as_zeros_before():
    from controlplane.dashboard.series import Steps

    s = Steps(2)
    s.put(5, 100.0, (1, 0))
    s.put(6, 150.0, (2, 0))
    xs, cols, _ = s.window(0.0, 200.0, 6, from_first=True)
    assert xs[0] == 100.0 and cols[0][0] == 1 and cols[0][-1] == 2  # nothing drawn before its first change
    xs, cols, _ = s.window(0.0, 200.0, 6)  # a card's memory: zero before its first change is true
    assert xs[0] == 0.0 and cols[0][0] == 0
    assert s.window(0.0, 50.0, 6, from_first=True)[0] == []  # a window before the model: no points
    assert s.window(0.0, 200.0, 4, from_first=True)[0] == []  # a seq before its first change: none either


def test_a_step_plot_is_a_gap_through_an_outage_and_resumes_at_its_end():
    from controlplane.dashboard.series import gap_outages

    xs, cols = [0.0, 10.0, 30.0], [[2, 1, 1], [0, 1, 1]]
    assert gap_outages(xs, cols, []) == (xs, cols)
    gx, gc = gap_outages(xs, cols, [[5.0, 20.0]])
    # 2 HOT up to when the cluster stopped at 5; nothing drawn until it was back at 20; then what held.
    assert gx == [0.0, 5.0, 5.001, 20.0, 30.0] and gc == [[2, 2, None, 1, 1], [0, 0, None, 1, 1]]
    gx, gc = gap_outages(xs, cols, [[-5.0, 3.0], [25.0, 30.0]])  # at the window's two ends
    assert gx == [0.0, 3.0, 10.0, 25.0, 25.001, 30.0] and gc[0] == [None, 2, 1, 1, None, 1]


def test_a_model_sampled_only_later_has_no_zeros_before_its_queue_began():
    q = QueueSamples(poll_s=1.0)
    for t in (10.0, 11.0, 12.0, 13.0):
        q.record(t, {"dispatcher": "d", "models": {"old": row(0, 0)}})
    q.record(14.0, {"dispatcher": "d", "models": {"old": row(0, 0), "new": row(2, 0)}})
    s = q.series("new", 10.0, 16.0, points=3)
    assert s["waiting"][0] is None and s["completed_per_s"][0] is None  # (10, 12]: before its processor
    assert s["completed_per_s"][1] == 1.0  # (12, 14]: its first two requests, counted from its start at 13
