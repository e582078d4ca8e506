"""A watchdog for `ndif up`: when it dies, even by SIGKILL, none of its processes outlive it.

nats-server and Ray's core processes die with `ndif up` through the parent-death signal, but
some of Ray's helpers (its dashboard and runtime-env agents) survive their raylet. This small
process, in a session of its own, notes every descendant of `ndif up` (pid and start time,
every `INTERVAL_S`) and, once `ndif up` is gone, SIGKILLs the ones still running, then exits.
Linux only (it reads /proc); elsewhere `ndif up` runs without it.

    python -m dataplane.node.watchdog PID
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

INTERVAL_S = 0.5


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks


def descendants(pid: int) -> dict[int, int]:
    """Every process under `pid` (children, their children, ...): pid -> start time."""
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        children: list[int] = []
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for c in children:
            st = _start_time(c)
            if st is not None and c not in out:
                out[c] = st
                todo.append(c)
    return out


def watch(parent: int, interval_s: float = INTERVAL_S) -> int:
    """Note `parent`'s descendants until it is gone; then kill those still running. Returns how many."""
    me = os.getpid()
    born = _start_time(parent)
    seen: dict[int, int] = {}
    while born is not None and _start_time(parent) == born:
        seen = {p: st for p, st in descendants(parent).items() if p != me}
        time.sleep(interval_s)
    killed = 0
    for p, st in seen.items():
        if _start_time(p) == st:  # the same process, not a new one with a recycled pid
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def start(parent: int | None = None) -> int | None:
    """Start the watchdog of `parent` (default: this process); its pid, or None off Linux."""
    import subprocess

    if not sys.platform.startswith("linux") or not Path("/proc/self/task").exists():
        return None
    proc = subprocess.Popen([sys.executable, "-m", "dataplane.node.watchdog", str(parent or os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # not in our process group: Ctrl-C must not end it first
    return proc.pid


if __name__ == "__main__":
    watch(int(sys.argv[1]))
