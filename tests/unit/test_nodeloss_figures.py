"""The node-loss scenario's counts (dataplane/ops/nodeloss.py): what `lost` and `run_twice` count,
and the parts of the recovery as differences of the times from the kill."""

from __future__ import annotations

from collections import Counter

from dataplane.ops.nodeloss import NodeLossRun


def test_lost_and_run_twice_count_from_the_statuses() -> None:
    run = NodeLossRun(nodes=3, victim="node-b", heartbeat_grace_s=5.0, submitted=["r1", "r2", "r3", "r4"],
                      completed=Counter({"r1": 1, "r2": 2, "r4": 1}), terminal=Counter({"r1": 1, "r2": 2, "r3": 1,
                                                                                        "r4": 1}))
    # r3 ended ERROR (not COMPLETED): lost; r2 completed twice: run twice, though not lost.
    assert run.lost == 1 and run.run_twice == 1
    run.completed["r3"] += 1
    run.terminal["r3"] += 1  # completed after an error: no longer lost, but two terminal statuses
    assert run.lost == 0 and run.run_twice == 2


def test_the_parts_add_up_to_the_recovery() -> None:
    run = NodeLossRun(nodes=3, victim="node-b", heartbeat_grace_s=5.0, detect_s=5.1, scheduled_s=5.1,
                      loaded_s=12.7, first_result_s=12.9)
    f = run.figures()
    assert f["node_loss_recovery_s"] == 12.9
    assert (f["detect_s"], f["place_s"], f["load_s"], f["first_result_s"]) == (5.1, 0.0, 7.6, 0.2)
    assert round(f["detect_s"] + f["place_s"] + f["load_s"] + f["first_result_s"], 2) == f["node_loss_recovery_s"]
    unseen = NodeLossRun(nodes=3, victim="node-b", heartbeat_grace_s=5.0, detect_s=5.1).figures()
    assert unseen["node_loss_recovery_s"] is None and unseen["place_s"] is None and unseen["detect_s"] == 5.1
