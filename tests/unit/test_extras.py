"""A base install (no `cluster` extra) gets one clear line from the verbs that need the extra."""

from __future__ import annotations

import importlib.util

import pytest
import structlog

from controlplane.ops import extras
from dataplane.ops.cli import main


def test_every_service_verb_names_what_it_needs():
    assert set(extras.NEEDS) == {"up", "agent", "dispatcher", "controller", "dashboard"}


def test_a_missing_module_is_refused_with_the_extra_and_the_install_command(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(extras.MissingExtra) as exc:
        extras.require("dispatcher")
    assert "missing: ray" in str(exc.value) and "ndif-controlplane[cluster]" in str(exc.value)
    try:
        assert main(["dispatcher"]) == 5
    finally:
        structlog.reset_defaults()  # main() sent the logs to capsys's stderr, closed after this test
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'cluster' extra" in err


def test_admin_verbs_need_nothing_more():
    for verb in ("deploy", "scale", "status", "events", "history", "replay", "submit", "queue", "kill"):
        extras.require(verb)  # no entry: nothing to check
