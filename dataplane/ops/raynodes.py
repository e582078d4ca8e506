"""A real multi-node Ray cluster on loopback for tests and benchmarks: one `ray start --block` process per node (the
head and workers, each its own raylet), every node labelled with the ndif node id it is
(`ndif.node_id`, what an agent finds its Ray node by), with token auth on (this process's token).

Each node is stopped through its own `ray start` process (SIGTERM, which stops what it started);
`kill(node)` SIGKILLs that node's raylet, `kill_group(node)` its whole process group (the `ray
start`, raylet and the workers on it at once), as a machine dying would; `restart(node)` starts it
again on its address with its label (a fresh raylet: a new Ray node id). Nothing here uses `ray stop`
(it stops every Ray of the user on the machine, other test processes' included).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from dataplane.runtime import ray_adapter

# Every node on an address of its own on loopback, none on 127.0.0.1: Ray replaces 127.0.0.1 (and
# `localhost`) by the machine's routable address (`resolve_ip_for_localhost`), other 127.x it keeps.
HEAD_IP = "127.0.0.11"
RAY = str(Path(sys.executable).with_name("ray"))
STOP_WAIT_S = 10.0  # after SIGTERM, how long the nodes' `ray start` may take to stop theirs before SIGKILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayNode:
    node_id: str
    ip: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_s: float = 0.0
    lines: list[str] = field(default_factory=list)

    def raylet_pid(self) -> int | None:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((k.pid for k in kids if k.name() == "raylet"), None)


class RayNodes:
    """Start with `head(node_id)`, then `worker(node_id)`; `stop()` ends every node it started."""

    def __init__(self, *, cpus: float = 1, env: dict[str, str] | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
        self.cpus = cpus
        token = ray_adapter.auth_token_path()  # the one this process's Ray reads (Ray caches the first)
        # No Ray drain on SIGTERM (for Ray Serve's proxies, 30 s by default) unless one is asked for:
        # an agent drains its replicas itself (as deploy/lib.sh).
        self.env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **os.environ, "RAY_TMPDIR": str(self.root),
                    "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        if token:
            self.env["RAY_AUTH_TOKEN_PATH"] = token
        self.port = 0
        self.workers = 0  # worker nodes started: the next one's address
        self.nodes: dict[str, RayNode] = {}
        self.dead: list[RayNode] = []

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.port}"

    def _start(self, node_id: str, ip: str, args: list[str]) -> RayNode:
        log = self.root / f"{node_id}.{len(self.dead)}.log"
        cmd = [RAY, "start", "--block", "--num-cpus", str(self.cpus),
               "--num-gpus", "0", "--labels", f"{ray_adapter.NODE_LABEL}={node_id}",
               "--object-store-memory", str(80 * 2**20), "--disable-usage-stats",
               "--dashboard-agent-listen-port", str(free_port()), "--node-ip-address", ip, *args]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        node = RayNode(node_id, ip, proc, log, started_s=time.monotonic())
        threading.Thread(target=_pump, args=(proc.stdout, log, node.lines), daemon=True).start()
        self.nodes[node_id] = node
        return node

    def head(self, node_id: str) -> RayNode:
        self.port = free_port()
        return self._start(node_id, HEAD_IP, ["--head", "--port", str(self.port), "--include-dashboard", "false"])

    def worker(self, node_id: str) -> RayNode:
        """A worker node on an address of its own on loopback (127.0.0.12, .13, ...)."""
        assert self.port, "start the head first"
        self.workers += 1
        return self._start(node_id, f"127.0.0.{11 + self.workers}", ["--address", self.address])

    def start(self, head: str, *workers: str, tries: int = 2) -> None:
        """The head, then each worker once the one before it is up (raylets registering at once on
        a loaded machine miss Ray's 30 s registration wait); a node that did not start is tried again."""
        for i, node_id in enumerate((head, *workers)):
            for attempt in range(tries):
                self.head(node_id) if i == 0 else self.worker(node_id)
                try:
                    self.wait_started()
                    break
                except RuntimeError:
                    node = self.nodes.pop(node_id)
                    node.proc.send_signal(signal.SIGTERM)
                    _end(node.proc, time.monotonic() + STOP_WAIT_S)
                    if attempt == tries - 1:
                        raise

    def wait_started(self, timeout_s: float = 90.0) -> None:
        """Until every node this started says `Ray runtime started` (RuntimeError with its output if one ended)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes.values():
            while not any("Ray runtime started" in line for line in node.lines):
                if node.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray node {node.node_id} did not start:\n" + "".join(node.lines[-40:]))
                time.sleep(0.2)

    def alive(self) -> dict[str, str]:
        """ndif node id -> Ray node id of every live labelled node, as the GCS says (`probe`)."""
        return {n["node_id"]: n["ray_node_id"] for n in probe(self.address, self.env)["nodes"]
                if n["alive"] and n["node_id"]}

    def kill(self, node_id: str) -> float:
        """SIGKILL the node's raylet (a machine dying): its `ray start` process then stops the rest.
        The monotonic time of the kill."""
        node = self.nodes.pop(node_id)
        pid = node.raylet_pid()
        assert pid is not None, f"no raylet for {node_id}"
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        self.dead.append(node)
        return at

    def kill_group(self, node_id: str) -> float:
        """SIGKILL the node's whole process group at once (its `ray start`, raylet and every worker on
        it: a machine dying, nothing of it left to clean up). The monotonic time of the kill."""
        node = self.nodes.pop(node_id)
        try:
            kids = psutil.Process(node.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        os.killpg(node.proc.pid, signal.SIGKILL)  # its own session's group (start_new_session)
        at = time.monotonic()
        for kid in kids:  # any that left the group (a process of its own session) goes too
            with contextlib.suppress(psutil.NoSuchProcess):
                kid.kill()
        node.proc.wait()
        self.dead.append(node)
        return at

    def restart(self, node_id: str) -> RayNode:
        """A killed worker node started again on its address with its label (a fresh raylet, a new
        Ray node id), once it says it started."""
        old = next(n for n in reversed(self.dead) if n.node_id == node_id)
        node = self._start(node_id, old.ip, ["--address", self.address])
        self.wait_started()
        return node

    def stop(self) -> None:
        procs = [node.proc for node in [*self.nodes.values(), *self.dead]]
        for proc in procs:  # all at once: each stops its own node's processes
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S  # one wait for them all, not one each
        for proc in procs:
            _end(proc, deadline)
        self.nodes.clear()
        self.dead.clear()
        if not os.environ.get("NDIF_KEEP_RAY_LOGS"):
            shutil.rmtree(self.root, ignore_errors=True)


def _pump(stream: IO[bytes] | None, log: Path, lines: list[str]) -> None:
    if stream is None:
        return
    with open(log, "ab") as f:
        for raw in stream:
            f.write(raw)
            lines.append(raw.decode(errors="replace"))
            del lines[:-200]


def _end(proc: subprocess.Popen[bytes], deadline: float) -> None:
    """After its SIGTERM: wait until `deadline` (monotonic) for the node's `ray start --block` (it stops
    its node's processes), then SIGKILL what is left of its process group."""
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of that node's session is left (its own group only)
    except ProcessLookupError:
        pass
    proc.wait()


def probe(address: str, env: dict[str, str]) -> dict[str, Any]:
    """What the Ray cluster at `address` says, asked from a process of its own (the test process keeps
    out of Ray: its session's local Ray may be up): every node (id, alive, ndif label) and, for every
    replica actor, the Ray node it runs on (`info()` inside the actor)."""
    out = subprocess.run([sys.executable, "-m", "dataplane.ops.raynodes", "probe", address], env=env, capture_output=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"probe failed: {out.stderr.decode(errors='replace')[-2000:]}")
    got: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return got


def _probe_main(address: str) -> None:
    ray_adapter.join(address)
    actors = []
    for mk, rid, _ in ray_adapter.list_replica_actors():
        handle = ray_adapter.get_actor(mk, rid)
        if handle is not None:
            info = ray_adapter.get(handle.info.remote(), 30)
            actors.append({"model_key": mk, "replica_id": rid, "ray_node_id": info["ray_node_id"]})
    print(json.dumps({"nodes": ray_adapter.ray_nodes(), "actors": actors}))
    ray_adapter.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        _probe_main(sys.argv[2])
