"""`ndif ARGS` in a process of its own, without paying the CLI's imports each time.

Starting `python -m dataplane.ops.cli` costs about half a second of CPU before `main()` runs
(the interpreter, nats-py, aiohttp, the CLI's modules), and the integration tests run the CLI a
few hundred times. Here one helper process imports the CLI once and forks a child per command:
the child is a process of its own (its pid, its environment and working directory, stdin from
/dev/null, stdout and stderr to files, its exit status), runs `main(ARGS)` as `python -m
dataplane.ops.cli ARGS` would, and exits. Nothing runs in the helper but the imports (no thread,
no event loop, no connection), so a fork copies nothing a command could trip over.

    python -m tests.cli_zygote   (requests and answers: one JSON line each, on stdin / stdout)

The test process's side is `run` (async) and `run_sync`: the helper starts on first use, one per
test process (each xdist worker has its own).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _child(req: dict[str, Any]) -> None:
    """In the forked child: become `python -m dataplane.ops.cli ARGS` and never return."""
    rc = 1
    try:
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        from dataplane.ops import cli

        sys.argv = [cli.__file__, *req["args"]]  # as `python -m dataplane.ops.cli` sets it

        try:
            rc = int(cli.main(req["args"]) or 0)
        except SystemExit as exc:  # what `sys.exit` in `python -m` turns into the exit status
            code = exc.code
            rc = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, status 1
            traceback.print_exc()
            rc = 1
        atexit._run_exitfuncs()  # what the interpreter runs on its way out (os._exit below skips it)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc & 0xFF)


def serve() -> None:
    import dataplane.ops.cli  # noqa: F401 - the imports every child shares

    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    children: dict[int, str] = {}
    pending = b""
    while True:
        events = sel.select(timeout=0.005 if children else None)
        if events:
            chunk = os.read(sys.stdin.fileno(), 1 << 16)
            if not chunk:
                return  # the test process went away
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req)
                children[pid] = req["id"]
                _answer({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _answer({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})


def _answer(msg: dict[str, Any]) -> None:
    os.write(sys.stdout.fileno(), json.dumps(msg).encode() + b"\n")


# ---- the test process's side ------------------------------------------------------------------


@dataclass
class _Call:
    done: concurrent.futures.Future[int] = field(default_factory=concurrent.futures.Future)
    pid: int | None = None
    abandoned: bool = False  # timed out: kill the child as soon as its pid is known


class _Helper:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.calls: dict[str, _Call] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="ndif-cli-"))

    def _started(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote"], cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            threading.Thread(target=self._read, args=(self.proc,), name="cli-zygote", daemon=True).start()
        return self.proc

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            with self.lock:
                call = self.calls.get(msg["id"])
                if call is None:
                    continue
                if "pid" in msg:
                    call.pid = msg["pid"]
                    if call.abandoned:
                        _kill(call.pid)
                    continue
                del self.calls[msg["id"]]
            if not call.done.done():
                call.done.set_result(msg["rc"])
        with self.lock:  # the helper died: nothing more will answer
            calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            if not call.done.done():
                call.done.set_exception(RuntimeError("the CLI helper process (tests/cli_zygote.py) exited"))

    def start(self, args: list[str], env: dict[str, str], cwd: str) -> tuple[str, _Call]:
        cid = uuid.uuid4().hex
        call = _Call()
        req = {"id": cid, "args": args, "env": env, "cwd": cwd, "out": str(self.tmp / f"{cid}.out"),
               "err": str(self.tmp / f"{cid}.err")}
        with self.lock:
            proc = self._started()
            self.calls[cid] = call
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(req).encode() + b"\n")
            proc.stdin.flush()
        return cid, call

    def abandon(self, call: _Call) -> None:
        with self.lock:
            call.abandoned = True
            if call.pid is not None:
                _kill(call.pid)

    def result(self, cid: str, rc: int) -> tuple[int, str, str]:
        out, err = self.tmp / f"{cid}.out", self.tmp / f"{cid}.err"
        try:
            return rc, out.read_text(), err.read_text()
        finally:
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


_helper = _Helper()


async def run(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              timeout: float = 60.0) -> tuple[int, str, str]:
    """`ndif ARGS` in a process of its own: (exit status, stdout, stderr). TimeoutError after
    `timeout` seconds (the process is killed)."""
    cid, call = _helper.start(args, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()))
    try:
        rc = await asyncio.wait_for(asyncio.wrap_future(call.done), timeout)
    except TimeoutError:
        _helper.abandon(call)
        raise
    return _helper.result(cid, rc)


def run_sync(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
             timeout: float = 60.0) -> tuple[int, str, str]:
    """`run` for code without an event loop."""
    cid, call = _helper.start(args, dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()))
    try:
        rc = call.done.result(timeout)
    except concurrent.futures.TimeoutError:
        _helper.abandon(call)
        raise TimeoutError(f"ndif {' '.join(args)} did not finish within {timeout}s") from None
    return _helper.result(cid, rc)


if __name__ == "__main__":
    serve()
