"""What an operator runs, run for real: deploy/head.sh for the head (NATS, Ray head, controller,
dispatcher and its own agent) and deploy/worker.sh for two workers, each on an address of its own on
loopback (as dataplane/ops/raynodes.py), with the Ray token and the NATS users the head made. A tiny model
with 3 replicas gets one on each node (asked inside each actor), each node's replica process pool
shows full again in `ndif status`, a request is served, and the scripts' own stop ends every
process they started. A worker without the token, or with a wrong one,
stops with one line naming it and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from dataplane.ops.raynodes import free_port, probe
from schemas.keys import canonical_model_key
from tests.checkpoints import TinyModels

pytestmark = [pytest.mark.timeout(420), pytest.mark.long, pytest.mark.usefixtures("starts_ray")]  # the scripts run `ray start`
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HEAD_IP, WORKERS = "127.0.0.31", {"node-b": "127.0.0.32", "node-c": "127.0.0.33"}
NODES = ("node-a", *WORKERS)


def script(name: str, *args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEPLOY / name), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def node_env(env: dict[str, str]) -> dict[str, str]:
    """Several raylets on one machine: each its own dashboard agent port, small object stores."""
    return {**env, "NDIF_RAY_ARGS": f"--num-cpus 1 --object-store-memory {80 * 2**20} "
                                    f"--dashboard-agent-listen-port {free_port()}"}


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
    try:
        yield d
    finally:
        if not os.environ.get("NDIF_KEEP_RAY_LOGS"):
            shutil.rmtree(d, ignore_errors=True)


def test_head_and_two_workers_from_the_deploy_scripts(tiny_models: TinyModels, root: Path) -> None:
    home, runs = root / "home", {n: root / f"run-{n}" for n in NODES}
    inventory = root / "inventory.json"
    inventory.write_text(json.dumps({"nodes": {n: {"cards": [{"count": 1, "memory_bytes": 16 * 2**30}]}
                                               for n in NODES}}))
    tiny = tiny_models.gpt2(root / "gpt2")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "NDIF_CREDS", "RAY_ADDRESS"))}
    env |= {"PYTHON": sys.executable, "RAY_TMPDIR": str(root), "NDIF_LOG_LEVEL": "WARNING", "NDIF_STOP_WAIT_S": "20"}
    ray_port, nats_port = free_port(), free_port()
    url, ray_address = f"nats://{HEAD_IP}:{nats_port}", f"{HEAD_IP}:{ray_port}"
    started: list[tuple[str, Path]] = []
    groups: set[int] = set()  # every process group the scripts started, for the check after their stop
    try:
        head = script("head.sh", "start", "--address", HEAD_IP, "--node-id", "node-a", "--inventory", str(inventory),
                      "--home", str(home), "--run-dir", str(runs["node-a"]), "--ray-port", str(ray_port),
                      "--nats-port", str(nats_port), "--client", "tester", "--gpus", "1", "--gpu-memory-gib", "16",
                      env=node_env(env))
        started.append(("head.sh", runs["node-a"]))
        assert head.returncode == 0, head.stdout + head.stderr
        token = home / "auth" / "ray_auth_token"
        assert str(token) in head.stdout and "agent-node-b" in head.stdout  # what a worker needs, printed
        assert token.stat().st_mode & 0o777 == 0o600

        creds = {n: next((home / "auth").glob(f"agent-{n}-*.creds")) for n in WORKERS}
        worker = ["start", "--node-id", "node-b", "--address", WORKERS["node-b"], "--head", ray_address,
                  "--nats", url, "--creds", str(creds["node-b"]), "--gpus", "1", "--gpu-memory-gib", "16",
                  "--run-dir", str(root / "refused")]
        missing = script("worker.sh", *worker, env=node_env(env))
        assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1
        assert "--ray-token" in missing.stderr and "InvalidAuthToken" in missing.stderr
        wrong = root / "wrong_token"
        wrong.write_text("0" * 64)
        refused = script("worker.sh", *worker, "--ray-token", str(wrong), env=node_env(env))
        assert refused.returncode != 0 and "refused the auth token" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert not [p for p in psutil.process_iter(["cmdline"]) if WORKERS["node-b"] in " ".join(p.info["cmdline"] or [])]

        for n, ip in WORKERS.items():
            ran = script("worker.sh", "start", "--node-id", n, "--address", ip, "--head", ray_address, "--nats", url,
                         "--creds", str(creds[n]), "--ray-token", str(token), "--gpus", "1", "--gpu-memory-gib", "16",
                         "--run-dir", str(runs[n]), env=node_env(env))
            started.append(("worker.sh", runs[n]))
            assert ran.returncode == 0, ran.stdout + ran.stderr

        admin = {**env, "NDIF_CREDS": str(home / "auth" / "admin.creds")}
        ran = subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "deploy", str(tiny), "--replicas", "3",
                              "--wait", "--wait-timeout", "200", "--nats", url, "--json"],
                             env=admin, capture_output=True, text=True, timeout=260)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        status = json.loads(subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "status", "--json", "--nats", url],
                                           env=admin, capture_output=True, text=True, timeout=60, check=True).stdout)
        # Each agent's pool (default size 1) shows in `ndif status` from its heartbeat, full again
        # after its replica took a pooled process.
        deadline = time.monotonic() + 120
        while {n["node_id"]: n["pool"] for n in status["nodes"]} != {n: {"ready": 1, "size": 1} for n in NODES}:
            assert time.monotonic() < deadline, status["nodes"]
            time.sleep(1)
            status = json.loads(subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "status", "--json", "--nats",
                                                url], env=admin, capture_output=True, text=True, timeout=60,
                                               check=True).stdout)
        text = subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "status", "--nats", url], env=admin,
                              capture_output=True, text=True, timeout=60, check=True).stdout
        assert "pool" in text and all(line.rstrip().endswith("1/1") for line in text.splitlines()
                                      if line.startswith(NODES)), text
        mk = canonical_model_key(str(tiny))
        hot = [r for r in status["replicas"] if r["model_key"] == mk and r["state"] == "Available"]
        assert sorted(r["node_id"] for r in hot) == sorted(NODES), "one replica per node"

        seen = probe(ray_address, {**env, "RAY_AUTH_TOKEN_PATH": str(token), "RAY_AUTH_MODE": "token"})
        labelled = {n["node_id"]: n["ray_node_id"] for n in seen["nodes"] if n["alive"]}
        where = {a["replica_id"]: a["ray_node_id"] for a in seen["actors"]}
        assert {where[r["replica_id"]] for r in hot} == {labelled[n] for n in NODES}  # on three Ray nodes

        client = {**env, "NDIF_CREDS": str(home / "auth" / "client-tester.creds")}
        served = subprocess.run([sys.executable, "-m", "dataplane.ops.cli", "submit", str(tiny), "--input-ids",
                                 "3,1,4,1,5", "--forward", "--json", "--timeout", "120", "--nats", url],
                                env=client, capture_output=True, text=True, timeout=150)
        assert served.returncode == 0, served.stdout + served.stderr
        assert "COMPLETED" in served.stdout, served.stdout
    finally:
        groups |= {int(p.read_text()) for _, run in started for p in run.glob("*.pid")}
        said = ""
        for name, run in reversed(started):
            if run.exists():
                stopped = script(name, "stop", "--run-dir", str(run), env=env, timeout=200)
                assert stopped.returncode == 0, stopped.stderr
                said += stopped.stdout
    assert groups and all(not list(run.glob("*.pid")) for _, run in started)
    # Ray's cluster file named the head: its stop removed it (a later `ray`/`ndif up` would take it for live)
    assert not (root / "ray" / "ray_current_cluster").exists()
    assert "removed Ray's cluster file" in said, said  # it was there, naming the head, until the stop
    assert not [p.pid for p in psutil.process_iter() if _pgid(p.pid) in groups], "a process outlived the stop"
