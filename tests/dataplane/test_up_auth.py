"""`ndif up` with its default users: credentials made on the first start (0600), kept on the next,
and the CLI in another shell finds them by itself; without them the server refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.ops.nats_server import free_port, stop_process
from tests import cli_zygote

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("starts_ray")]  # `ndif up` starts its own Ray


def _up(home: Path, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "NDIF_HOME": str(home), "NDIF_LOG_LEVEL": "WARNING"}
    env.pop("NDIF_CREDS", None)
    proc = subprocess.Popen([sys.executable, "-m", "dataplane.ops.cli", "up", "--gpus", "1", "--gpu-memory-gib", "4",
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += line
        if "dispatcher running" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"ndif up did not start:\n{seen}")


def _ndif(home: Path, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NDIF_HOME": str(home), "NDIF_LOG_LEVEL": "WARNING"}
    env.pop("NDIF_CREDS", None)
    argv = [*args, "--nats", f"nats://127.0.0.1:{port}"]
    return subprocess.CompletedProcess(argv, *cli_zygote.run_sync(argv, env=env))


def test_ndif_up_makes_users_and_local_commands_use_them(tmp_path: Path) -> None:
    home, port = tmp_path / "home", free_port()
    proc = _up(home, port)
    try:
        auth = home / "auth"
        assert (auth / "admin.creds").exists() and (auth / "nats-auth.conf").exists()
        # files 0600; the directory of `nats` CLI contexts 0700 (its files 0600)
        assert all((f.stat().st_mode & 0o777) == (0o700 if f.is_dir() else 0o600) for f in auth.rglob("*"))
        ran = _ndif(home, port, "status")
        assert ran.returncode == 0 and "NODES" in ran.stdout, ran.stdout + ran.stderr
        ran = _ndif(tmp_path / "elsewhere", port, "status")  # no credentials: refused
        assert ran.returncode != 0 and "requires a user and none was found" in ran.stderr, ran.stderr
        first = (auth / "admin.creds").read_bytes()
    finally:
        stop_process(proc, signal.SIGINT, 60)
    proc = _up(home, port)  # the second start keeps the users and the history
    try:
        assert (home / "auth" / "admin.creds").read_bytes() == first
        ran = _ndif(home, port, "status")
        assert ran.returncode == 0, ran.stderr
    finally:
        stop_process(proc, signal.SIGINT, 60)
