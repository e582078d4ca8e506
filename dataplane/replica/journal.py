"""Recent log lines, bounded: a replica process's own (`ndif logs`), and the agent's about each replica.

A `Journal` keeps the newest `schemas.logs.MAX_LINES` lines, each a `Line` (when, in Unix seconds,
and the text cut to `MAX_LINE_CHARS` characters, so at most 4 bytes each in UTF-8), safe to write
from any thread. `capture_process_logs(journal)` sends a replica process's own lines into one: every
structlog event of level info or above (the replica's `replica_loaded`, `device_map_unfit`, ...) and
every Python `logging` record the process would print (WARNING and above unless a logger was set
lower: transformers' warnings, `warnings.warn` through `py.warnings`). It is process-wide, so only
a process that runs one replica (a Ray actor's worker) turns it on. The agent asks a replica for its
lines through the runtime (`ReplicaRuntime.recent_lines`) and merges them with its own by time.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from collections.abc import Iterable, MutableMapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog

from schemas import logs as L

_SKIP_KEYS = frozenset({"event", "timestamp", "level", "exc_info", "stack_info"})
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50,
           "fatal": 50, "msg": 20}


class Line(msgspec.Struct, frozen=True, kw_only=True):
    """One log line: `at` (Unix seconds) and its text (no time stamp: `stamp` writes it)."""

    at: float
    text: str


def stamp(line: Line) -> str:
    """`2026-01-31 12:00:00.123Z text`: how `ndif logs` prints a line (UTC, to the millisecond)."""
    return f"{datetime.fromtimestamp(line.at, UTC):%Y-%m-%d %H:%M:%S.%f}"[:-3] + "Z " + line.text


def merge(*journals: Iterable[Line]) -> list[Line]:
    """The lines of several journals in time order (a tie keeps the order the journals were given)."""
    return sorted((x for j in journals for x in j), key=lambda x: x.at)


class Journal:
    """The newest `max_lines` lines, each cut to `L.MAX_LINE_CHARS` characters; thread-safe."""

    def __init__(self, max_lines: int = L.MAX_LINES) -> None:
        self._ring: collections.deque[Line] = collections.deque(maxlen=max_lines)
        self._lock = threading.Lock()

    def add(self, text: str, at: float | None = None) -> None:
        line = Line(at=time.time() if at is None else at, text=L.clip_line(text))
        with self._lock:
            self._ring.append(line)

    def recent(self, n: int) -> list[Line]:
        """The newest `n` lines (at most `max_lines`), oldest first."""
        with self._lock:
            return list(self._ring)[-max(0, n):] if n > 0 else []

    def __len__(self) -> int:
        return len(self._ring)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= L.MAX_LINE_CHARS else text[:L.MAX_LINE_CHARS]


class _Tee:
    """A structlog processor that writes each event of level info or above into a journal and
    passes the event on unchanged (the process still prints it). It never raises."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        try:
            level = str(event_dict.get("level", method_name)).lower()
            if _LEVELS.get(level, 20) >= logging.INFO:
                rest = " ".join(f"{k}={_short(v)}" for k, v in list(event_dict.items()) if k not in _SKIP_KEYS)
                self.journal.add(f"{level} {_short(event_dict.get('event', ''))}" + (f" {rest}" if rest else ""))
        except Exception:  # noqa: BLE001 - a log line that cannot be kept must not break the caller
            pass
        return event_dict


class _Handler(logging.Handler):
    """A `logging` handler that writes each record it is given into a journal (never raises)."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.NOTSET)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        # The handler sits on the root logger and on transformers' library logger; whether a
        # transformers record reaches both depends on the library's version and on who configured
        # its logger first, so a record is kept once, however many of our handlers it passes.
        if getattr(record, "_ndif_journaled", False):
            return
        setattr(record, "_ndif_journaled", True)  # noqa: B010 - LogRecord takes attributes
        try:
            text = f"{record.levelname.lower()} {record.name}: {_short(record.getMessage())}"
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                text += f" ({type(exc).__name__}: {_short(exc)})"
            self.journal.add(text, record.created)
        except Exception:  # noqa: BLE001 - as above
            pass


_captured: Journal | None = None
_capture_lock = threading.Lock()


def capture_process_logs(journal: Journal) -> None:
    """Keep this process's own log lines in `journal` (the first journal given keeps them: once per
    process). transformers' loggers may not propagate to the root logger, so its library logger gets
    the handler too (a record that reaches both is kept once)."""
    global _captured
    with _capture_lock:
        if _captured is not None:
            return
        _captured = journal
        handler = _Handler(journal)
        root = logging.getLogger()
        if not root.handlers:  # what logging's last resort printed, it still prints once ours is there
            printer = logging.StreamHandler(sys.stderr)
            printer.setLevel(logging.WARNING)
            root.addHandler(printer)
        root.addHandler(handler)
        logging.getLogger("transformers").addHandler(handler)
        logging.captureWarnings(True)
        processors = list(structlog.get_config()["processors"])
        # before the renderer, which turns the event into a string
        structlog.configure(processors=[*processors[:-1], _Tee(journal), *processors[-1:]])
