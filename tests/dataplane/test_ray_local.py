"""The embedded Ray (`ray_adapter.start_local`, what `ndif up` and LocalCluster start), seen from outside.

In a fresh process with its own HOME (the test's own Ray, if any, and the developer's ~/.ray are left
alone): every socket any of its processes listens on is a loopback one; Ray's auth token is in a 0600 file in a 0700 directory, nothing
world-readable is left in ~/.ray; a process started from it joins (the legitimate path), one with a
wrong token is refused. (The sockets are the process tree's, read with psutil, as `ss -ltnp` shows
them; another test's Ray on this machine is not in that tree.)
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("starts_ray")]  # the probe starts its own Ray

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, subprocess, sys, time
import psutil
from dataplane.runtime import ray_adapter

gcs = ray_adapter.start_local(0, num_cpus=1)
import ray

@ray.remote
class Probe:  # a worker process, with its own gRPC server
    def pid(self):
        return os.getpid()

p = Probe.remote()
ray.get(p.pid.remote(), timeout=120)
time.sleep(3)  # the agents (dashboard agent, runtime env agent, metrics) open their ports meanwhile
me = psutil.Process()
listening = []
for proc in [me, *me.children(recursive=True)]:
    try:
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append([proc.name(), c.laddr.ip, c.laddr.port])
    except psutil.Error:
        pass

code = "import ray; ray.init(address=%r); print('JOINED')" % gcs
def join(env):
    # Both joins try the GCS 3 times, not Ray's 20 (a refused one would wait out all of them)
    env = {**env, "RAY_NUM_REDIS_GET_RETRIES": "3"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and "JOINED" in r.stdout
wrong = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN_PATH"}
wrong["RAY_AUTH_TOKEN"] = "0" * 64
tp = os.environ.get("RAY_AUTH_TOKEN_PATH")
modes = [os.stat(tp).st_mode, os.stat(os.path.dirname(tp)).st_mode] if tp else [None, None]
out = {"gcs": gcs, "token_modes": modes, "listening": listening,
       "token_path": os.environ.get("RAY_AUTH_TOKEN_PATH"), "auth_mode": os.environ.get("RAY_AUTH_MODE"),
       "joined": join(dict(os.environ)), "joined_wrong_token": join(wrong)}
ray_adapter.shutdown()
print("PROBE " + json.dumps(out))
"""


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_the_embedded_ray_listens_on_loopback_only_and_its_token_is_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # What another cluster left on the machine: its address file in Ray's temp dir (world-writable
    # /tmp/ray by default) naming a Ray that is gone, and RAY_ADDRESS pointing at it. The embedded
    # Ray is its own whatever they say, and the address it was told is said to be ignored.
    raytmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths must fit
    (raytmp / "ray").mkdir()
    (raytmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), NDIF_LOG_LEVEL="WARNING", RAY_TMPDIR=str(raytmp),
               RAY_ADDRESS="127.0.0.1:1")
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=280)
    finally:
        shutil.rmtree(raytmp, ignore_errors=True)
    assert "ray_address_ignored" in proc.stdout + proc.stderr, proc.stderr[-2000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(line[6:])

    # Ray bound to loopback: GCS, raylet, workers, agents, metrics (a wildcard socket, 0.0.0.0 or ::,
    # answers on every address of the machine; the machine's own address would too).
    names = {name for name, _, _ in got["listening"]}
    assert {"gcs_server", "raylet"} <= names, got["listening"]
    wide = [x for x in got["listening"] if not _loopback(x[1])]
    assert wide == [], f"listening beyond loopback: {wide}"
    assert got["gcs"].startswith("127.0.0.1:"), got["gcs"]

    # Its token: a file of this user's only, and nothing readable by others under ~/.ray. Token mode
    # is said outright, so Ray does not warn that it turned token auth on by itself.
    assert got["auth_mode"] == "token"
    assert "Token authentication is enabled" not in proc.stderr + proc.stdout
    token = Path(got["token_path"])
    file_mode, dir_mode = got["token_modes"]
    assert stat.S_IMODE(file_mode) == 0o600 and stat.S_IMODE(dir_mode) == 0o700, got["token_modes"]
    assert not (home / ".ray" / "auth_token").exists()  # Ray's default place, 0644 when Ray writes it
    readable = [p for p in home.rglob("*") if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o044]
    assert not [p for p in readable if "token" in p.name], readable
    assert not token.exists()  # removed when the process that made it ended

    # The legitimate path still works, and the token is the one in force.
    assert got["joined"] and not got["joined_wrong_token"]
