"""README's main command, `ndif up --demo`, end to end (smaller bursts): it must run and succeed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.ops.auth import ensure_local

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("starts_ray")]  # `ndif up --demo` starts its own Ray


def test_ndif_up_demo_runs_end_to_end(tmp_path: Path) -> None:
    # The home holds the credentials an earlier `ndif up` made: the demo's open server gets none of
    # them (a dashboard or client user would ask JetStream under its account's prefix there).
    ensure_local(["vm"], home=tmp_path / "home")
    env = {**os.environ, "NDIF_HOME": str(tmp_path / "home"), "NDIF_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "up", "--demo", "--requests", "24"],
                          env=env, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    # Ray is told its auth mode, so it does not print that it turned token auth on by itself.
    assert "Token authentication is enabled" not in out + proc.stderr
    assert (tmp_path / "home" / "models" / "tiny-gpt2" / "config.json").exists()  # made on the first run
    assert "$ ndif deploy" in out and "$ ndif scale" in out and "$ ndif evict" in out
    assert out.count("24 COMPLETED, 0 ERROR") == 2
    m = re.search(r"served by (replica \d+: \d+(?:, )?)+", out)
    assert m and out.count("replica 0:") >= 1 and "replica 1:" in out  # both replicas served burst 1
    assert re.search(r"Outcome: 48/48 requests COMPLETED, 0 ERROR", out)
    # The replica evicted mid-burst ended WARM, and the log explains it.
    assert re.search(r"tiny-gpt2\s+0\s+WARM\s+WARM\s+Cached", out)
    assert "ReplicaDrained" in out and "ReplicaCached" in out
    for cmd in ("ndif status", "ndif history", "ndif replay", "ndif queue"):
        assert cmd in out
    assert re.search(r"dashboard http://127\.0\.0\.1:\d+/\?token=[A-Za-z0-9_-]{32,} \(read-only", out)  # with its token
