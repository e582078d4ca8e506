"""The fold is silent: anomalies are data with their seq; the live services log only new ones."""

from __future__ import annotations

import pathlib
import re
from datetime import UTC, datetime

from structlog.testing import capture_logs

from controlplane.core.ports import Stored
from controlplane.core.projections import ClusterState, fold
from schemas.events import NodeLost, Skipped, decode_or_skip

ROOT = pathlib.Path(__file__).resolve().parents[2]
BAD = ROOT / "tests" / "replay" / "histories" / "v1_bad_double_booking.jsonl"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _stored(path: pathlib.Path):
    return [(i, decode_or_skip(line)) for i, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]


def test_projections_import_no_logger():
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "controlplane" / "core" / "projections").rglob("*.py")
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"^\s*(import|from)\s+(structlog|logging)\b|\blog\.(warning|info|error|debug)\(", line)]
    assert not offenders, offenders


def test_a_fold_with_anomalies_and_unreadable_messages_logs_nothing_and_keeps_them():
    items = _stored(BAD)
    n = len(items)
    items.append((n + 1, Skipped(reason="malformed body: x")))
    with capture_logs() as logs:
        state = fold(items, ClusterState())
    assert not logs
    assert state.anomaly_count >= 4 and state.skipped >= 2
    found = state.new_anomalies(0)
    assert [a.seq for a in found] == sorted(a.seq for a in found)
    assert len(found) == state.anomaly_count + state.skipped
    assert [a for a in found if a in state.anomalies] == state.anomalies
    assert found[-1].seq == n + 1 and found[-1].message == "malformed body: x"


def test_new_anomalies_are_only_those_after_the_mark():
    state = fold(_stored(BAD), ClusterState())
    mark = state.seq  # what a restarted service notes after rebuilding: the history is not re-logged
    assert state.new_anomalies(mark) == []
    state.apply(mark + 1, NodeLost(event_id="x1", ts=T0, actor="controller:t", node_id="nowhere"))
    state.apply(mark + 2, Skipped(reason="unknown event type 'X'", type="X"))
    new = state.new_anomalies(mark)
    assert [(a.seq, a.event_type) for a in new] == [(mark + 1, "NodeLost"), (mark + 2, "X")]
    assert state.new_anomalies(mark + 1) == new[1:]
    assert state.copy().new_anomalies(mark) == new  # copies keep them


def test_a_live_service_logs_each_anomaly_once_and_a_restart_logs_none_of_the_history():
    import structlog

    from controlplane.service.logs import log_new_anomalies

    logger = structlog.get_logger("test")
    items = _stored(BAD)
    live = ClusterState()
    with capture_logs() as logs:
        for seq, item in items:  # batches of one, as a follower sees them
            mark = live.seq
            live.apply(seq, item)
            log_new_anomalies(logger, live, mark)
    assert len(logs) == live.anomaly_count + live.skipped
    assert {e["event"] for e in logs} == {"projection_anomaly", "event_skipped"}
    assert [e["seq"] for e in logs] == sorted(e["seq"] for e in logs)
    restarted = fold(items, ClusterState())  # a restart rebuilds from the log ...
    with capture_logs() as again:
        assert log_new_anomalies(logger, restarted, restarted.seq) == 0  # ... and re-logs nothing
        restarted.apply(restarted.seq + 1, NodeLost(event_id="x2", ts=T0, actor="controller:t", node_id="nowhere"))
        assert log_new_anomalies(logger, restarted, restarted.seq - 1) == 1
    assert [(e["event"], e["event_type"]) for e in again] == [("projection_anomaly", "NodeLost")]


async def test_follow_log_logs_each_new_anomaly_once_and_not_the_rebuilt_history():
    """The one follow loop (controller, agent, dispatcher) logs what each batch's fold found; a
    service that rebuilt from the log first and follows from there logs none of the history."""
    import asyncio

    from controlplane.service.follow import follow_log
    from controlplane.store.memlog import MemoryEventLog

    log = MemoryEventLog()
    ghost = NodeLost(event_id="g0", ts=T0, actor="controller:t", node_id="ghost")  # an unknown node: an anomaly
    await log.append([ghost], None)
    state = ClusterState()
    async for seq, item in log.read():  # the rebuild: the history's anomaly is in the fold, not logged
        state.apply(seq, item)
    assert state.anomaly_count == 1

    seen: list[tuple[str, dict[str, object]]] = []

    class Recorder:
        def warning(self, what: str, **kw: object) -> None:
            seen.append((what, kw))

        exception = warning

    def on_batch(batch: list[Stored]) -> None:
        for seq, item in batch:
            state.apply(seq, item)

    task = asyncio.create_task(follow_log(log, lambda: state.seq + 1, on_batch, logger=Recorder(),
                                          fold=lambda: state))
    try:
        await log.append([NodeLost(event_id="g1", ts=T0, actor="controller:t", node_id="ghost2")], None)
        for _ in range(200):
            if state.seq == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(w, kw["seq"]) for w, kw in seen] == [("projection_anomaly", 2)]
