"""A FUSE filesystem that loses unsynced writes on command, for power-cut tests (after Jepsen's LazyFS).

`python -m tools.lazyfs BACKING MOUNTPOINT` mounts BACKING at MOUNTPOINT, in the foreground, until
`fusermount3 -u MOUNTPOINT` (or SIGTERM). BACKING stands for the disk: what is in it survives a cut.

Semantics:
- File data (writes and size changes: extending writes, truncate, open with O_TRUNC) is kept in
  memory, per file, as dirty 4 KiB pages over the backing file; reads see that view. It reaches
  the backing file only on fsync or fdatasync of that file (through any handle), or with each
  write through a handle opened O_SYNC or O_DSYNC, and then all of that file's data does.
- Metadata (create, mkdir, rename, unlink, rmdir, link, symlink, chmod, chown, utimens) is applied
  to BACKING at once, as if every directory were synced after each change. So a cut never loses a
  directory entry: a file created or renamed and never synced is there after the cut, with the
  data last synced under it (none for a new file). The test is weaker than a real crash there.
- `drop` (the power cut) discards every unsynced write of every file, and every handle opened
  before it answers EIO from then on (its process died in the cut; a write still queued in the
  kernel must not land after it). The caller kills the processes first, then drops.
- Sync writes to BACKING without an fsync of the host's own: the host does not crash.

A control socket (abstract unix socket, `--control @NAME`) takes one command a line and answers a
JSON line once done: `ping`, `stats`, `dirty` (which files have unsynced data), `sync` (every file
written back, as the host's writeback does given time) and `drop`. `LazyMount` is the context
manager tests use; `python -m tools.lazyfs --control @NAME --send drop` sends one from a shell.

One request at a time: libfuse runs single-threaded and one lock covers every operation and the
control commands.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

PAGE = 4096
_ROOT = Path(__file__).resolve().parent.parent  # where `python -m tools.lazyfs` resolves
_STAT_KEYS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_blksize", "st_ino",
              "st_rdev")

F = TypeVar("F", bound=Callable[..., Any])


class FileView:
    """One backing file's cached view: dirty pages over the backing file, and its size as readers see it.

    Invariant: every byte at or past `size` reads as zero (dirty pages are zero there; clean bytes
    at or past `zero_from`, those a truncate cut, read as zero), so a file that grows shows zeros.
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd  # the backing file, read and write, never O_APPEND
        self.path = path  # its name in the mount, as last seen (for reports)
        self.synced = os.fstat(fd).st_size  # the backing file's size
        self.size = self.synced
        self.zero_from = self.synced
        self.pages: dict[int, bytearray] = {}
        self.opens = 0
        self.unsynced = 0  # bytes written or cut since the last sync: what a drop loses

    @property
    def dirty(self) -> bool:
        return bool(self.pages) or self.size != self.synced or self.zero_from < self.synced

    def _clean(self, index: int) -> bytearray:
        """Page `index` as the backing file has it, with what a truncate cut read as zeros."""
        start = index * PAGE
        page = bytearray(os.pread(self.fd, PAGE, start)) if start < self.zero_from else bytearray()
        page.extend(bytes(PAGE - len(page)))
        if self.zero_from < start + PAGE:
            cut = max(self.zero_from - start, 0)
            page[cut:] = bytes(PAGE - cut)
        return page

    def read(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        limit = min(end, self.zero_from)
        buf = bytearray(os.pread(self.fd, limit - offset, offset)) if offset < limit else bytearray()
        buf.extend(bytes(end - offset - len(buf)))
        first, last = offset // PAGE, (end - 1) // PAGE
        indices = range(first, last + 1) if last - first < len(self.pages) else sorted(self.pages)
        for i in indices:
            page = self.pages.get(i)
            if page is None or not first <= i <= last:
                continue
            lo, hi = max(offset, i * PAGE), min(end, (i + 1) * PAGE)
            buf[lo - offset:hi - offset] = page[lo - i * PAGE:hi - i * PAGE]
        return bytes(buf)

    def write(self, offset: int, data: bytes) -> None:
        if not data:
            return
        end = offset + len(data)
        view = memoryview(data)
        for i in range(offset // PAGE, (end - 1) // PAGE + 1):
            start = i * PAGE
            lo, hi = max(offset, start), min(end, start + PAGE)
            if hi - lo == PAGE:  # the whole page: what was there does not matter
                self.pages[i] = bytearray(view[lo - offset:hi - offset])
                continue
            page = self.pages.get(i)
            if page is None:
                page = self.pages[i] = self._clean(i)
            page[lo - start:hi - start] = view[lo - offset:hi - offset]
        self.size = max(self.size, end)
        self.unsynced += len(data)

    def truncate(self, length: int) -> None:
        if length < self.size:
            for i in [i for i in self.pages if i * PAGE >= length]:
                del self.pages[i]
            if length % PAGE:
                i = length // PAGE
                page = self.pages.get(i)
                if page is None:
                    page = self.pages[i] = self._clean(i)
                page[length % PAGE:] = bytes(PAGE - length % PAGE)
            self.zero_from = min(self.zero_from, length)
        self.unsynced += abs(self.size - length)
        self.size = length

    def sync(self) -> None:
        """Write the view to the backing file: cut what a truncate cut, the dirty pages, then the size."""
        if self.zero_from < self.synced:
            os.ftruncate(self.fd, self.zero_from)
        run_start, run = -1, bytearray()
        for i in sorted(self.pages):
            if run and i * PAGE != run_start + len(run):
                os.pwrite(self.fd, run, run_start)
                run = bytearray()
            if not run:
                run_start = i * PAGE
            run += self.pages[i][:min(PAGE, self.size - i * PAGE)]
        if run:
            os.pwrite(self.fd, run, run_start)
        os.ftruncate(self.fd, self.size)
        self.pages.clear()
        self.synced = self.zero_from = self.size
        self.unsynced = 0

    def discard(self) -> int:
        """Forget every unsynced change; the number of bytes it had written or cut."""
        lost = self.unsynced
        self.pages.clear()
        self.synced = self.size = self.zero_from = os.fstat(self.fd).st_size
        self.unsynced = 0
        return lost


@dataclasses.dataclass
class _Handle:
    key: tuple[int, int]  # (st_dev, st_ino) of the backing file: stable across renames
    flags: int
    epoch: int  # the drop count when it was opened


def _locked(fn: F) -> F:
    @functools.wraps(fn)
    def run(self: LazyOps, *args: Any) -> Any:
        with self.mutex:
            return fn(self, *args)

    return run  # type: ignore[return-value]


class LazyOps:
    """The filesystem's operations (mfusepy's `Operations` protocol, paths relative to the mount)."""

    use_ns = True  # utimens and stat times in nanoseconds

    def __init__(self, backing: str) -> None:
        self.backing = os.path.realpath(backing)
        # Not `lock`: mfusepy takes any attribute named like a FUSE operation for that operation.
        self.mutex = threading.Lock()
        self.files: dict[tuple[int, int], FileView] = {}
        self.handles: dict[int, _Handle] = {}
        self.next_fh = 1
        self.epoch = 0
        self.mounted = False
        self.syncs = 0
        self.drops = 0

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    # ---- the cached view --------------------------------------------------------------------

    def _file(self, real: str) -> tuple[tuple[int, int], FileView]:
        """The view of the backing file at `real`, made (its backing file opened) on first use."""
        st = os.lstat(real)
        key = (st.st_dev, st.st_ino)
        f = self.files.get(key)
        if f is None:
            try:
                fd = os.open(real, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except PermissionError:
                fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            f = self.files[key] = FileView(fd, "/" + os.path.relpath(real, self.backing))
        return key, f

    def _handle(self, fh: int) -> tuple[_Handle, FileView]:
        h = self.handles.get(fh)
        if h is None:
            raise OSError(errno.EBADF, "unknown file handle")
        if h.epoch != self.epoch:
            raise OSError(errno.EIO, "opened before the power cut")
        return h, self.files[h.key]

    def _forget(self, key: tuple[int, int] | None) -> None:
        """Let go of a file's view once nothing holds it open and it has nothing to lose (clean, or
        unlinked: its data can never be synced or read again)."""
        f = self.files.get(key) if key is not None else None
        if f is None or f.opens:
            return
        if not f.dirty or os.fstat(f.fd).st_nlink == 0:
            os.close(f.fd)
            del self.files[key]  # type: ignore[arg-type]

    def _open_handle(self, key: tuple[int, int], f: FileView, flags: int) -> int:
        if flags & os.O_TRUNC:
            f.truncate(0)
            if flags & os.O_DSYNC:
                self._sync(f)
        f.opens += 1
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.handles[fh] = _Handle(key, flags, self.epoch)
        return fh

    def _key_of(self, real: str) -> tuple[int, int] | None:
        try:
            st = os.lstat(real)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino)

    # ---- control ----------------------------------------------------------------------------

    def drop(self) -> dict[str, int]:
        """The power cut: every unsynced write is lost, every handle open now is dead."""
        with self.mutex:
            files = lost = 0
            for f in self.files.values():
                if f.dirty:
                    files += 1
                lost += f.discard()
            self.epoch += 1
            self.drops += 1
            for key in list(self.files):
                self._forget(key)
            return {"files": files, "bytes": lost}

    def sync_all(self) -> dict[str, int]:
        """Write every file's view to the disk, as the kernel's writeback does given time (`sync`)."""
        with self.mutex:
            files = written = 0
            for f in self.files.values():
                if f.dirty:
                    files, written = files + 1, written + f.unsynced
                    f.sync()
            for key in list(self.files):
                self._forget(key)
            return {"files": files, "bytes": written}

    def dirty(self) -> dict[str, Any]:
        """The files with unsynced changes now: their names in the mount and unsynced bytes."""
        with self.mutex:
            return {"files": {f.path: f.unsynced for f in self.files.values() if f.dirty}}

    def stats(self) -> dict[str, int]:
        with self.mutex:
            return {"dirty_files": sum(f.dirty for f in self.files.values()),
                    "unsynced_bytes": sum(f.unsynced for f in self.files.values()),
                    "open_handles": len(self.handles), "syncs": self.syncs, "drops": self.drops,
                    "mounted": int(self.mounted)}

    # ---- files ------------------------------------------------------------------------------

    def init(self, path: str) -> None:
        self.mounted = True

    @_locked
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        h = self.handles.get(fh) if fh is not None else None
        st = os.fstat(self.files[h.key].fd) if h is not None else os.lstat(self._real(path))
        out: dict[str, Any] = {k: getattr(st, k) for k in _STAT_KEYS}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        f = self.files.get((st.st_dev, st.st_ino))
        if f is not None:
            out["st_size"] = f.size
            out["st_blocks"] = (f.size + 511) // 512
        return out

    @_locked
    def open(self, path: str, flags: int) -> int:
        key, f = self._file(self._real(path))
        return self._open_handle(key, f, flags)

    @_locked
    def create(self, path: str, mode: int, flags: int) -> int:
        real = self._real(path)
        fd = os.open(real, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | (flags & os.O_EXCL), mode & 0o7777)
        os.close(fd)
        key, f = self._file(real)
        return self._open_handle(key, f, flags)

    @_locked
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        _, f = self._handle(fh)
        return f.read(offset, size)

    @_locked
    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        h, f = self._handle(fh)
        # Appends go where this view ends (the kernel's idea of the size may predate a drop).
        f.write(f.size if h.flags & os.O_APPEND else offset, data)
        if h.flags & os.O_DSYNC:  # O_SYNC and O_DSYNC: each write is on disk when it returns
            self._sync(f)
        return len(data)

    @_locked
    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None:
            h, f = self._handle(fh)
            key = h.key
        else:
            key, f = self._file(self._real(path))
        f.truncate(length)
        self._forget(key)
        return 0

    @_locked
    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._sync(self._handle(fh)[1])
        return 0

    def _sync(self, f: FileView) -> None:
        f.sync()
        self.syncs += 1

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0  # directories are always synced: metadata reaches the backing directory at once

    @_locked
    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) promises nothing about the disk

    @_locked
    def release(self, path: str, fh: int) -> int:
        h = self.handles.pop(fh, None)
        if h is not None and (f := self.files.get(h.key)) is not None:
            f.opens -= 1
            self._forget(h.key)
        return 0

    @_locked
    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        return {k: getattr(sv, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                            "f_ffree", "f_favail", "f_flag", "f_namemax")}

    # ---- metadata: applied to the backing directory at once ---------------------------------

    @_locked
    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise OSError(errno.EACCES, "access")
        return 0

    @_locked
    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    @_locked
    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    @_locked
    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    @_locked
    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    @_locked
    def unlink(self, path: str) -> int:
        real = self._real(path)
        key = self._key_of(real)
        os.unlink(real)
        self._forget(key)
        return 0

    @_locked
    def rename(self, old: str, new: str) -> int:
        real_new = self._real(new)
        replaced = self._key_of(real_new)
        os.rename(self._real(old), real_new)
        moved = self._key_of(real_new)
        if moved in self.files:
            self.files[moved].path = new  # type: ignore[index]
        if replaced != moved:
            self._forget(replaced)
        return 0

    @_locked
    def link(self, target: str, source: str) -> int:
        os.link(self._real(source), self._real(target))
        return 0

    @_locked
    def symlink(self, target: str, source: str) -> int:
        os.symlink(source, self._real(target))
        return 0

    @_locked
    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode & 0o7777)
        return 0

    @_locked
    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._real(path), uid, gid, follow_symlinks=False)
        return 0

    @_locked
    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._real(path), ns=times, follow_symlinks=False) if times else os.utime(self._real(path))
        return 0


# ---- the control socket -------------------------------------------------------------------


def _address(control: str) -> str:
    """`@NAME` is an abstract unix socket (no file, no path length limit); anything else a path."""
    return "\0" + control[1:] if control.startswith("@") else control


def _serve(ops: LazyOps, sock: socket.socket) -> None:
    commands: dict[str, Callable[[], dict[str, Any]]] = {"ping": ops.stats, "stats": ops.stats, "drop": ops.drop,
                                                         "sync": ops.sync_all, "dirty": ops.dirty}
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return  # closed: the filesystem is unmounting
        with contextlib.suppress(OSError), conn, conn.makefile("rwb") as io:  # a caller gone mid-answer
            for line in io:
                cmd = line.decode(errors="replace").strip()
                try:
                    reply: dict[str, Any] = {"ok": True, **commands[cmd]()}
                except KeyError:
                    reply = {"ok": False, "error": f"unknown command {cmd!r}: {sorted(commands)}"}
                except Exception as exc:  # noqa: BLE001 - the caller gets the error, the next command is served
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                io.write(json.dumps(reply).encode() + b"\n")
                io.flush()


def send(control: str, command: str, timeout: float = 30.0) -> dict[str, Any]:
    """Send one command to a mounted lazyfs and return its answer (after the command is done)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(_address(control))
        s.sendall(command.encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError(f"lazyfs at {control} closed without answering {command!r}")
            buf += chunk
    out = json.loads(buf)
    if not isinstance(out, dict) or not out.get("ok"):
        raise RuntimeError(f"lazyfs {command!r} failed: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.lazyfs", description=__doc__.split("\n\n")[0])
    p.add_argument("backing", nargs="?", help="the directory that stands for the disk")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--control", help="control socket: @NAME (abstract) or a path; default @lazyfs-<pid>")
    p.add_argument("--send", metavar="COMMAND", help="send ping, stats, dirty, sync or drop to a mounted lazyfs (--control)")
    p.add_argument("--debug", action="store_true", help="libfuse's debug output")
    a = p.parse_args(argv)
    if a.send:
        if not a.control:
            p.error("--send needs --control")
        print(json.dumps(send(a.control, a.send)))
        return 0
    if not a.backing or not a.mountpoint:
        p.error("BACKING and MOUNTPOINT are needed")
    import mfusepy  # here: importing it loads libfuse, which LazyMount's users need not have

    # nats-server keeps many files open; each view holds its backing file open too.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ops = LazyOps(a.backing)
    control = a.control or f"@lazyfs-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(_address(control))
    sock.listen(8)
    threading.Thread(target=_serve, args=(ops, sock), name="lazyfs-control", daemon=True).start()
    print(f"lazyfs: {ops.backing} on {a.mountpoint}, control {control}", file=sys.stderr, flush=True)
    try:
        # No kernel caching of data or attributes: after a drop every read and stat asks the view.
        mfusepy.FUSE(ops, a.mountpoint, foreground=True, nothreads=True, debug=a.debug, fsname="lazyfs",
                     direct_io=True, attr_timeout=0, entry_timeout=0, negative_timeout=0)
    finally:
        sock.close()
    return 0


# ---- for tests ------------------------------------------------------------------------------


def fuse_problem() -> str | None:
    """Why a lazyfs cannot be mounted here (None: it can)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the kernel's FUSE device)"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (Debian's fuse3 package)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # a missing libfuse raises at import
        return f"mfusepy cannot load libfuse3 ({type(exc).__name__}: {exc})"
    return None


def _term_with_parent() -> None:
    """`preexec_fn`: SIGTERM when the parent dies, so libfuse unmounts on its way out (Linux)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class LazyMount:
    """A lazyfs of its own process: ``with LazyMount(backing, mountpoint) as fs: ... fs.drop()``.

    `start` returns once the filesystem answers on `mountpoint`; `close` (also on an exception)
    unmounts it, lazily if something still holds it, and ends the process: stop what uses the
    mount first, or the unmount waits for it in vain and detaches it. Start it from the
    thread that lives longest (its process is told to stop when that thread ends).
    """

    def __init__(self, backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *,
                 ready_timeout: float = 15.0) -> None:
        self.backing = Path(backing).resolve()
        self.mountpoint = Path(mountpoint).resolve()
        self.log_path = self.backing.with_name(self.backing.name + ".lazyfs.log")  # beside it, not in it
        self.ready_timeout = ready_timeout
        self.control = f"@lazyfs-{uuid.uuid4().hex[:16]}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LazyMount:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        # Its output to a file: a pipe nobody reads would fill and stop the filesystem mid-request.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.lazyfs", str(self.backing), str(self.mountpoint),
                 "--control", self.control],
                cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                preexec_fn=_term_with_parent)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if (rc := self.proc.poll()) is not None:
                self.proc = None
                raise RuntimeError(f"lazyfs exited with {rc}: {self.log_tail()}")
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                if send(self.control, "ping", timeout=1.0).get("mounted") and os.path.ismount(self.mountpoint):
                    return self
            time.sleep(0.02)
        self.close()
        raise RuntimeError(f"lazyfs did not mount {self.mountpoint} within {self.ready_timeout}s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the filesystem's process wrote (its errors)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def drop(self) -> dict[str, Any]:
        """Lose every unsynced write now: `{"files": N, "bytes": B}` of what was lost."""
        return send(self.control, "drop")

    def sync(self) -> dict[str, Any]:
        """Write every file's unsynced data to the disk (what the host's writeback does given time)."""
        return send(self.control, "sync")

    def dirty(self) -> dict[str, int]:
        """The files with unsynced changes: name in the mount -> unsynced bytes."""
        files = send(self.control, "dirty")["files"]
        assert isinstance(files, dict)
        return files

    def stats(self) -> dict[str, Any]:
        """`dirty_files`, `unsynced_bytes`, `open_handles`, `syncs` (fsyncs so far), `drops`."""
        return send(self.control, "stats")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for _ in range(20):  # busy while a killed process's files are still being released
                if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.05)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.mounted():  # its process gone or the unmount refused: detach it anyway
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def mounted(self) -> bool:
        """Whether the mount is there, live or not (a dead one fails `stat`, so `os.path.ismount` misses it)."""
        try:
            table = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return os.path.ismount(self.mountpoint)
        # the fifth field is the mount point, with space, tab, newline and backslash in octal escapes
        want = str(self.mountpoint).replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")
        return any(len(f := line.split(" ")) > 4 and f[4] == want for line in table.splitlines())

    def __enter__(self) -> LazyMount:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
