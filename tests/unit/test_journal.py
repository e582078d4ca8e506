"""A replica process's journal (dataplane/replica/journal.py): bounded in lines and per line, and,
once captured, it holds the process's structlog events and printed `logging` records (transformers'
among them) while the process still prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dataplane.replica.journal import Journal, Line, merge, stamp
from schemas import logs as L


def test_a_journal_keeps_the_newest_lines_each_cut() -> None:
    j = Journal(max_lines=5)
    for i in range(12):
        j.add(f"line {i}" + ("é" * (3 * L.MAX_LINE_CHARS) if i == 11 else ""), at=float(i))
    got = j.recent(100)
    assert len(got) == 5 and [x.at for x in got] == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert len(got[-1].text) == L.MAX_LINE_CHARS and len(got[-1].text.encode()) <= 4 * L.MAX_LINE_CHARS
    assert [x.at for x in j.recent(2)] == [10.0, 11.0] and j.recent(0) == []
    assert len(Journal().recent(10**6)) == 0
    full = Journal()
    for i in range(L.MAX_LINES + 50):
        full.add("x", at=float(i))
    assert len(full) == L.MAX_LINES


def test_merge_orders_by_time_and_stamp_is_utc_to_the_millisecond() -> None:
    a = [Line(at=1.0, text="a1"), Line(at=3.0, text="a3")]
    b = [Line(at=2.0, text="b2"), Line(at=3.0, text="b3")]
    assert [x.text for x in merge(a, b)] == ["a1", "b2", "a3", "b3"]
    assert stamp(Line(at=1.5, text="hi")) == "1970-01-01 00:00:01.500Z hi"


CHILD = """
import json, logging, warnings
import structlog
import transformers
from dataplane.replica.journal import Journal, capture_process_logs
j = Journal()
capture_process_logs(j)
capture_process_logs(Journal())  # once per process: the first journal keeps the lines
structlog.get_logger("ndif.model").bind(replica_id=3).info("replica_loaded", seconds=0.5)
structlog.get_logger("ndif.model").debug("too_fine")
logging.getLogger("ndif.x").warning("disk %s", "slow")
logging.getLogger("ndif.x").info("not printed, not kept")
tlog = transformers.logging.get_logger("transformers.modeling_utils")
logging.getLogger("transformers").propagate = True  # as some versions and configurations leave it
tlog.warning("weights not initialised")
warnings.warn("old api")
print(json.dumps([x.text for x in j.recent(100)]))
"""


def test_capture_keeps_the_processs_own_lines_and_still_prints_them() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ran = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr
    kept = json.loads(ran.stdout.strip().splitlines()[-1])
    assert kept[0] == "info replica_loaded replica_id=3 seconds=0.5", kept
    assert "warning ndif.x: disk slow" in kept
    assert "warning transformers.modeling_utils: weights not initialised" in kept
    assert any(x.startswith("warning py.warnings:") and "old api" in x for x in kept), kept
    assert not any("too_fine" in x or "not printed" in x for x in kept), kept
    assert len(kept) == 4, kept
    # the process still prints what it printed before
    assert "replica_loaded" in ran.stdout + ran.stderr
    assert "disk slow" in ran.stderr and "weights not initialised" in ran.stderr and "old api" in ran.stderr


async def test_an_answer_cut_to_the_lines_asked_says_it_was_cut() -> None:
    """`truncated` is true exactly when the agent held more lines than asked, whichever source
    had them (here the agent's own, the replica having no process on this node)."""
    from tests.memory_stack import memory_stack
    from tests.unit.test_dispatcher_memlog import EchoCaller

    async with memory_stack(EchoCaller) as s:
        key = ("m", 0)
        for i in range(3):
            s.agent.note(key, f"line {i}")
        exact = await s.agent.replica_lines("m", 0, 3)
        cut = await s.agent.replica_lines("m", 0, 2)
    assert exact.ok and len(exact.lines) == 3 and not exact.truncated, exact
    assert cut.ok and len(cut.lines) == 2 and cut.truncated and cut.lines[-1].endswith("line 2"), cut
    assert "no process" in cut.missing
