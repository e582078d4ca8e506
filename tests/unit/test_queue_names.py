"""`ndif queue` names a model by its short name, as every other verb does; --json keeps the key."""

from __future__ import annotations

from dataplane.ops.cli import queue_lines
from schemas.keys import canonical_model_key, display_name


def test_queue_names_each_model_by_its_short_name() -> None:
    key = canonical_model_key("openai-community/gpt2")
    assert key != "openai-community/gpt2" and display_name(key) == "openai-community/gpt2"
    state = {"dispatcher": "dispatcher:h", "processors": [{
        "model_key": key, "status": "READY", "queued": 0, "in_flight": 1, "ready_replicas": [0],
        "draining_replicas": [], "starting_replicas": [], "serving_replicas": [0], "completed": 3, "errors": 0}]}
    lines = "\n".join(queue_lines(state))
    assert "  openai-community/gpt2\n    READY: 0 queued, 1 running" in lines
    assert key not in lines


def test_queue_shows_each_users_queued_and_running_counts() -> None:
    state = {"dispatcher": "dispatcher:h", "processors": [{
        "model_key": canonical_model_key("openai-community/gpt2"), "status": "BUSY", "queued": 1203, "in_flight": 8,
        "ready_replicas": [0, 1], "draining_replicas": [], "starting_replicas": [], "serving_replicas": [0, 1],
        "completed": 40, "errors": 0, "users": {"heavy": {"queued": 1200, "running": 6},
                                                "light": {"queued": 3, "running": 2}, "": {"queued": 0, "running": 0}}}]}
    lines = queue_lines(state)
    assert lines[-1] == "    per user: heavy 1200 queued / 6 running, light 3 queued / 2 running, (open) 0 queued / 0 running"
