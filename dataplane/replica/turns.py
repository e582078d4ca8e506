"""Whose request a replica runs next: one run at a time, the next one chosen fairly among the waiting.

A replica runs one request at a time, and several calls can be waiting for it: each dispatcher keeps
`NDIF_REPLICA_LANES` calls at every replica, so under one user's flood up to (dispatchers x lanes)
calls of that user stand in front of the replica. The dispatcher orders its own queue fairly
(dataplane/serving/dispatcher/), but it cannot reorder what it already handed over: a light user's
request first in the dispatcher's line would still wait behind every flood call already at the
replica. `Turns` closes that gap at the replica itself: when a run ends, the next turn goes to the
waiting request whose user was served least recently here (never served first), and within one user
to the one that came first. A light user's request then waits for the run in progress and at most one
run of each other user waiting (not for every flood call ahead of it), and one user's requests keep
the order in which they reach the gate (a batch's next request reaches it when the one before ran).
Only calls that hold a thread of the replica are waiting here: the endpoint gives every call one
(dataplane/replica/endpoint.py, `CALL_THREADS`), so calls beyond that wait unordered before it.

Pure apart from its lock: no I/O, no clock but the waits' timeouts.
"""

from __future__ import annotations

import collections
import itertools
import threading

# Users remembered for "served least recently" (the oldest forgotten first: a forgotten user counts
# as never served, which only moves it forward once), each by at most this many characters.
REMEMBERED_USERS = 1024
USER_CHARS = 128


class Turns:
    """A fair, one-at-a-time gate: `acquire(user)` waits for the turn, `release()` ends it."""

    def __init__(self, remembered: int = REMEMBERED_USERS) -> None:
        self._cv = threading.Condition()
        self._busy = False
        self._waiting: list[tuple[str, int]] = []  # (user, arrival), in arrival order
        self._arrivals = itertools.count()
        self._served: collections.OrderedDict[str, int] = collections.OrderedDict()  # user -> its last turn
        self._turn = 0
        self._remembered = remembered

    def acquire(self, user: str, timeout: float | None = None) -> bool:
        """Wait until this request's turn (True), or `timeout` seconds (False: it gave up its place)."""
        user = user[:USER_CHARS]
        me = (user, next(self._arrivals))
        with self._cv:
            self._waiting.append(me)
            try:
                mine = self._cv.wait_for(lambda: not self._busy and self._next() == me, timeout)
            except BaseException:  # interrupted: out of the line, or everyone behind it waits for good
                self._waiting.remove(me)
                self._cv.notify_all()
                raise
            self._waiting.remove(me)
            if not mine:
                self._cv.notify_all()  # it may have been the one the others waited behind
                return False
            self._busy = True
            self._turn += 1
            self._served[user] = self._turn
            self._served.move_to_end(user)
            while len(self._served) > self._remembered:
                self._served.popitem(last=False)
            return True

    def release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def _next(self) -> tuple[str, int] | None:
        """The waiting request whose user was served least recently; the first to come among equals."""
        if not self._waiting:
            return None
        return min(self._waiting, key=lambda w: (self._served.get(w[0], 0), w[1]))
