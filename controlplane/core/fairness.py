"""Fair serving rules: which queued request of a model runs next, and how many one user may hold.

Pure (no clock, no I/O): start-time fair queueing over users within one model's queue. Each user
has a weight and a priority band (operator-set per user or per tier, `FairnessPolicy`); a request
gets a virtual start tag `max(V, F_user)` and the user's finish tag moves on by `1 / weight`. The
next request is the one with the highest band, then the smallest start tag (ties: arrival). So a
user's share of dispatches while several are backlogged is its weight over the band's total, a
newcomer's first request starts at the band's virtual time (never behind another's backlog), and a
user's own requests keep their order (`FairQueue`; `FifoQueue` is arrival order over every user,
the baseline it is measured against). Running limits make a user ineligible (its requests wait,
others go); queued limits refuse a new request at once, with the limit and the count.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Generic, Literal, Protocol, TypeVar

import msgspec

from schemas.errors import InvalidCommand, decode_bounded

T = TypeVar("T")
K = TypeVar("K")

DEFAULT_MAX_QUEUED: Final = 5_000  # requests one user may have queued per model at one dispatcher
DEFAULT_MAX_RUNNING: Final = 64  # requests of one user running at once per model at one dispatcher
MAX_POLICY_BYTES: Final = 1 << 20

Weight = Annotated[float, msgspec.Meta(gt=0, le=1_000_000)]
Band = Annotated[int, msgspec.Meta(ge=-1_000, le=1_000)]
Limit = Annotated[int, msgspec.Meta(ge=0, le=10_000_000)]


class Share(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a user (or tier) gets; a field left out falls back to the tier's, then the default's."""

    weight: Weight | None = None  # share of dispatches while backlogged, relative to others in the band
    band: Band | None = None  # higher goes first; within a band, fair share
    max_queued: Limit | None = None  # past it, a new request ends ERROR QueueLimitExceeded at once
    max_running: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] | None = None  # its others wait


class FairnessPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The operator's fairness settings (NDIF_FAIRNESS, docs/cli.md): a user's share is its own
    entry, else its tier's (`user_tiers`), else `default`, field by field."""

    default: Share = Share()
    # "fifo": one queue in arrival order over every user (weights and bands unused, limits kept):
    # dispatch as it was before fair queueing, the baseline tools/bench/fairness.py measures against.
    order: Literal["fair", "fifo"] = "fair"
    tiers: dict[str, Share] = {}
    user_tiers: dict[str, str] = {}
    users: dict[str, Share] = {}

    def share(self, user: str) -> Resolved:
        """The user's settings, every field filled."""
        tier = self.tiers.get(self.user_tiers.get(user, ""), Share())
        own = self.users.get(user, Share())

        def pick(name: str, fallback: float) -> float:
            for s in (own, tier, self.default):
                v = getattr(s, name)
                if v is not None:
                    return float(v)
            return fallback

        return Resolved(weight=pick("weight", 1.0), band=int(pick("band", 0)),
                        max_queued=int(pick("max_queued", DEFAULT_MAX_QUEUED)),
                        max_running=int(pick("max_running", DEFAULT_MAX_RUNNING)))


@dataclass(frozen=True, slots=True)
class Resolved:
    weight: float
    band: int
    max_queued: int
    max_running: int


_policy_decoder = msgspec.json.Decoder(FairnessPolicy)


def decode_policy(data: bytes) -> FairnessPolicy:
    """An operator's policy (JSON); InvalidCommand says what is wrong, never another exception."""
    policy = decode_bounded(_policy_decoder, data, limit=MAX_POLICY_BYTES, what="fairness policy")
    missing = sorted(set(policy.user_tiers.values()) - set(policy.tiers))
    if missing:
        raise InvalidCommand(f"fairness policy: user_tiers names tiers that are not defined: {missing[:5]}")
    return policy


@dataclass(frozen=True, slots=True)
class LimitReached:
    """A request refused because its user already holds `count` queued requests (the limit `limit`)."""

    user: str
    limit: int
    count: int

    def message(self, model: str) -> str:
        return (f"user {self.user!r} has {self.count} requests queued for {model}, the limit is {self.limit}: "
                "wait for some to finish, then submit again")


_Tag = tuple[int, float, int]  # (-band, virtual start, arrival): the dispatch order


class RequestQueue(Protocol[T]):
    """What a processor needs of its queue: `FairQueue`, or `FifoQueue` (NDIF_FAIRNESS `order`)."""

    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[T]: ...
    def queued(self, user: str) -> int: ...
    def running(self, user: str) -> int: ...
    def users(self) -> dict[str, tuple[int, int]]: ...
    def queued_by(self, group: Callable[[str], K]) -> dict[K, int]: ...
    def admit(self, user: str) -> LimitReached | None: ...
    def position(self, item: T) -> int | None: ...
    def push(self, item: T) -> None: ...
    def push_back(self, item: T) -> None: ...
    def pop(self) -> T | None: ...
    def ready(self) -> bool: ...
    def release(self, item: T) -> None: ...
    def remove(self, item: T) -> bool: ...


def request_queue(policy: FairnessPolicy, user_of: Callable[[T], str]) -> RequestQueue[T]:
    """The queue the policy asks for: fair over users (the default), or FIFO."""
    return FifoQueue(policy, user_of) if policy.order == "fifo" else FairQueue(policy, user_of)


class _Accounts(ABC, Generic[T]):
    """What both queues keep beside their order: each user's settings and running requests (taken
    by `pop`, given back by `release` or `push_back`)."""

    def __init__(self, policy: FairnessPolicy, user_of: Callable[[T], str]) -> None:
        self.policy = policy
        self.user_of = user_of
        self._out: dict[int, tuple[str, _Tag]] = {}  # id(item) of a running request -> (user, its tag)
        self._running: dict[str, int] = {}
        self._shares: dict[str, Resolved] = {}

    def share(self, user: str) -> Resolved:
        s = self._shares.get(user)
        if s is None:
            s = self._shares[user] = self.policy.share(user)
        return s

    def running(self, user: str) -> int:
        return self._running.get(user, 0)

    @abstractmethod
    def queued(self, user: str) -> int:
        """How many of `user`'s requests wait (each queue keeps its own order)."""

    @abstractmethod
    def _queued_users(self) -> set[str]:
        """The users with a request waiting."""

    def queued_by(self, group: Callable[[str], K]) -> dict[K, int]:
        """Queued requests per group of users (`group(user)`), in one pass: no sorting, no tuples."""
        out: dict[K, int] = {}
        for u in self._queued_users():
            k = group(u)
            out[k] = out.get(k, 0) + self.queued(u)
        return out

    def users(self) -> dict[str, tuple[int, int]]:
        """user -> (queued, running), for every user holding either."""
        names = self._queued_users() | {u for u, n in self._running.items() if n}
        return {u: (self.queued(u), self.running(u)) for u in sorted(names)}

    def eligible(self, user: str) -> bool:
        """Under its running limit?"""
        return self.running(user) < self.share(user).max_running

    def admit(self, user: str) -> LimitReached | None:
        """May `user` queue one more request? None, or why not."""
        limit, count = self.share(user).max_queued, self.queued(user)
        return LimitReached(user=user, limit=limit, count=count) if count >= limit else None

    def release(self, item: T) -> None:
        """A request taken by `pop` is done (answered, failed or cancelled)."""
        got = self._out.pop(id(item), None)
        if got is not None:
            self._dec(got[0])

    def _given_back(self, item: T) -> tuple[str, _Tag] | None:
        """A request `pop` took, no longer running: its user and tag (None: it was not taken)."""
        got = self._out.pop(id(item), None)
        if got is not None:
            self._dec(got[0])
        return got

    def _taken(self, user: str, tag: _Tag, item: T) -> None:
        self._out[id(item)] = (user, tag)
        self._running[user] = self.running(user) + 1

    def _dec(self, user: str) -> None:
        n = self._running.get(user, 0) - 1
        if n > 0:
            self._running[user] = n
        else:
            self._running.pop(user, None)
        self._forget(user)

    def _forget(self, user: str) -> None:
        pass


class FairQueue(_Accounts[T]):
    """One model's queued requests, fair over users (`user_of`); it also counts each user's running
    ones (taken by `pop`, given back by `release` or `push_back`)."""

    def __init__(self, policy: FairnessPolicy, user_of: Callable[[T], str]) -> None:
        super().__init__(policy, user_of)
        self._queues: dict[str, deque[tuple[_Tag, T]]] = {}  # user -> its queued requests, in tag order
        self._tags: dict[int, _Tag] = {}  # id(item) of a queued request -> its tag (positions in O(log n))
        self._finish: dict[str, float] = {}  # user -> finish tag of its last request
        self._vtime: dict[int, float] = {}  # band -> start tag of the last request dispatched in it
        self._seq = 0
        self._len = 0

    # ---- what is held ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """The queued requests in dispatch order (running limits aside)."""
        return (item for _, item in heapq.merge(*self._queues.values(), key=lambda e: e[0]))

    def queued(self, user: str) -> int:
        q = self._queues.get(user)
        return len(q) if q else 0

    def _queued_users(self) -> set[str]:
        return {u for u, q in self._queues.items() if q}

    def position(self, item: T) -> int | None:
        """How many queued requests go before `item` (0: next), running limits aside; None if not queued."""
        tag = self._tags.get(id(item))
        if tag is None:
            return None
        # Tags are unique (arrival breaks ties): what sorts at or before it, less itself.
        return sum(bisect_right(_Keys(q), tag) for q in self._queues.values()) - 1

    # ---- in and out --------------------------------------------------------------------------

    def push(self, item: T) -> None:
        """A new request, behind its user's others."""
        user = self.user_of(item)
        s = self.share(user)
        start = max(self._vtime.get(s.band, 0.0), self._finish.get(user, 0.0))
        self._finish[user] = start + 1.0 / s.weight
        self._seq += 1
        tag = (-s.band, start, self._seq)
        self._queues.setdefault(user, deque()).append((tag, item))
        self._tags[id(item)] = tag
        self._len += 1

    def push_back(self, item: T) -> None:
        """A request taken by `pop` that did not run (its replica left): back where its tag puts it,
        ahead of its user's later ones; no longer running."""
        got = self._given_back(item)
        if got is None:
            self.push(item)
            return
        user, tag = got
        q = self._queues.setdefault(user, deque())
        i = bisect_right(_Keys(q), tag)
        q.insert(i, (tag, item))
        self._tags[id(item)] = tag
        self._len += 1

    def pop(self) -> T | None:
        """The next request to run: highest band, then smallest start tag, among users under their
        running limit (None: nothing such). It counts as running until `release` or `push_back`."""
        best: tuple[_Tag, str] | None = None
        for user, q in self._queues.items():
            if q and self.eligible(user) and (best is None or q[0][0] < best[0]):
                best = (q[0][0], user)
        if best is None:
            return None
        tag, user = best
        _, item = self._queues[user].popleft()
        del self._tags[id(item)]
        self._len -= 1
        self._vtime[-tag[0]] = max(self._vtime.get(-tag[0], 0.0), tag[1])
        self._taken(user, tag, item)
        return item

    def ready(self) -> bool:
        """Would `pop` give a request?"""
        return any(q and self.eligible(u) for u, q in self._queues.items())

    def remove(self, item: T) -> bool:
        """Take a queued request out (cancelled, expired); whether it was queued."""
        tag = self._tags.pop(id(item), None)
        if tag is None:
            return False
        user = self.user_of(item)
        q = self._queues[user]
        del q[bisect_right(_Keys(q), tag) - 1]
        self._len -= 1
        # A request that never ran leaves no debt: the user's next one starts where its last queued
        # one finishes (or where the band is, when none is left).
        s = self.share(user)
        self._finish[user] = q[-1][0][1] + 1.0 / s.weight if q else self._vtime.get(s.band, 0.0)
        self._forget(user)
        return True

    def _forget(self, user: str) -> None:
        # Users holding nothing leave no state behind (the finish tag stays: bounded by users seen).
        if not self._queues.get(user) and user not in self._running:
            self._queues.pop(user, None)


class FifoQueue(_Accounts[T]):
    """One model's queued requests in arrival order over every user (NDIF_FAIRNESS `order: fifo`):
    the head goes first unless its user is at its running limit (then the first request of a user
    that is not). Queued limits hold as in `FairQueue`; weights and bands are not used."""

    def __init__(self, policy: FairnessPolicy, user_of: Callable[[T], str]) -> None:
        super().__init__(policy, user_of)
        self._q: deque[tuple[_Tag, T]] = deque()  # in arrival order (a pushed-back request: its own place)
        self._tags: dict[int, _Tag] = {}  # id(item) of a queued request -> its tag
        self._counts: dict[str, int] = {}  # user -> its queued requests
        self._seq = 0

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in self._q)

    def queued(self, user: str) -> int:
        return self._counts.get(user, 0)

    def _queued_users(self) -> set[str]:
        return set(self._counts)

    def position(self, item: T) -> int | None:
        tag = self._tags.get(id(item))
        return None if tag is None else bisect_right(_Keys(self._q), tag) - 1

    def push(self, item: T) -> None:
        self._seq += 1
        tag = (0, float(self._seq), self._seq)
        self._q.append((tag, item))
        self._held(item, tag)

    def push_back(self, item: T) -> None:
        got = self._given_back(item)
        if got is None:
            self.push(item)
            return
        tag = got[1]
        self._q.insert(bisect_right(_Keys(self._q), tag), (tag, item))
        self._held(item, tag)

    def pop(self) -> T | None:
        for i, (tag, item) in enumerate(self._q):
            user = self.user_of(item)
            if self.eligible(user):
                del self._q[i]
                self._unheld(item, user)
                self._taken(user, tag, item)
                return item
        return None

    def ready(self) -> bool:
        return any(self.eligible(self.user_of(item)) for _, item in self._q)

    def remove(self, item: T) -> bool:
        tag = self._tags.get(id(item))
        if tag is None:
            return False
        del self._q[bisect_right(_Keys(self._q), tag) - 1]
        self._unheld(item, self.user_of(item))
        return True

    def _held(self, item: T, tag: _Tag) -> None:
        self._tags[id(item)] = tag
        user = self.user_of(item)
        self._counts[user] = self.queued(user) + 1

    def _unheld(self, item: T, user: str) -> None:
        del self._tags[id(item)]
        n = self._counts[user] - 1
        if n:
            self._counts[user] = n
        else:
            del self._counts[user]


class _Keys:
    """A user's queue seen as its tags, for bisect."""

    __slots__ = ("q",)

    def __init__(self, q: deque[tuple[_Tag, Any]]) -> None:
        self.q = q

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, i: int) -> _Tag:
        return self.q[i][0]


def wait_estimate_s(position: int, run_s: float | None, parallel: int) -> float | None:
    """Seconds until a request `position` places from the head starts: the requests ahead of it and
    itself, at `parallel` at a time, each `run_s` long (None when either is unknown)."""
    if run_s is None or parallel <= 0:
        return None
    return round((position + 1) * run_s / parallel, 1)


def position_update_due(last: int | None, now: int, since_s: float, min_interval_s: float) -> bool:
    """Send a QUEUED status again? When the position moved, at most every `min_interval_s`, and only
    when the move tells the user something: near the head, or by a tenth of the position or more."""
    if last is None:
        return True
    if now == last or since_s < min_interval_s:
        return False
    return now < 10 or abs(now - last) * 10 >= last


@dataclass(eq=False)
class TriagePlaces:
    """Who may look at a model name the log does not know, now, and who waits: a dispatcher's
    triages (each reads the stream and may ask for a deployment) are `places` at most at once, and
    one user holds at most `share` of them; the names past that wait in their user's line (at most
    `waiting_share` each, `waiting_limit` in all, past which a name is left to the sweep), and the
    lines are served in turn. So one client storing junk on thousands of new names keeps at most
    `share` places and its own line full, never another user's first request waiting behind it; with
    every line together at `waiting_limit` (16 full lines, say), a user whose line is shorter than
    the longest takes the longest line's newest place (that name is left to the sweep). Not
    work-conserving: a lone user has `share` places while the others stand idle (a triage takes
    milliseconds; a flood of new names is what the places are bounded against).

    A name is keyed by its model token; its user is the one whose publish (or stored subject)
    named it first (a triage reads every user's requests on the name). `fresh`: a publish woke it
    (the stream may not have stored the request yet), kept while it waits."""

    places: int = 16
    share: int = 4
    waiting_limit: int = 10_000
    waiting_share: int = 625
    deferred: int = 0  # names that waited (every place, or the user's share, taken)
    given_up: int = 0  # waiting names left to the sweep to make room for a shorter line
    running: dict[str, str] = field(default_factory=dict)  # token -> user, triages under way
    waiting: dict[str, bool] = field(default_factory=dict)  # token -> fresh, names waiting
    _held: dict[str, int] = field(default_factory=dict)  # user -> places held
    _lines: dict[str, deque[str]] = field(default_factory=dict)  # user -> names, oldest first (turn order)
    # Names that left `waiting` other than from their line's head (so lines may hold stale entries),
    # and how many had when each line was last compacted: a full line is compacted only when it may
    # have changed, not on every name a full line is asked for (a sweep asks for thousands).
    _left: int = 0
    _compacted: dict[str, int] = field(default_factory=dict)

    def ask(self, token: str, user: str, fresh: bool) -> bool | None:
        """A name to triage: True (with its freshness) when it may start now, None when it waits or
        is left to the sweep. Not for a name under way (its triage is told to read again)."""
        if len(self.running) < self.places and self._held.get(user, 0) < self.share:
            if token in self.waiting:
                fresh |= self.waiting.pop(token)  # routed (by the sweep) ahead of its turn
                self._left += 1
            self.running[token] = user
            self._held[user] = self._held.get(user, 0) + 1
            return fresh
        line = self._lines.get(user)
        if token in self.waiting:
            self.waiting[token] |= fresh
            if line is not None and token in line:
                return None  # waiting in this user's line already (in another's, it joins this one too)
        if line is not None and len(line) >= self.waiting_share and len(self._compact(user)) >= self.waiting_share:
            return None  # this user's line is full: left to the sweep
        if token not in self.waiting:
            if len(self.waiting) >= self.waiting_limit and not self._make_room(user):
                return None  # left to the sweep
            self.waiting[token] = fresh
            self.deferred += 1
        self._lines.setdefault(user, deque()).append(token)
        return None

    def _compact(self, user: str) -> deque[str]:
        """`user`'s line without the names started meanwhile from another's line (or ahead of
        their turn), which would otherwise count against its share until they reached its head."""
        line = self._lines[user]
        if self._compacted.get(user) != self._left:
            line = self._lines[user] = deque(t for t in line if t in self.waiting)
            self._compacted[user] = self._left
        return line

    def _make_room(self, user: str) -> bool:
        """Every line together at `waiting_limit`: the longest line gives up its newest name (left to
        the sweep) when it is longer than `user`'s would be with one more."""
        own = len(self._lines.get(user, ()))
        heavy = max(self._lines, key=lambda u: len(self._lines[u]), default=None)
        if heavy is None or heavy == user or len(self._compact(heavy)) <= own + 1:
            return False
        del self.waiting[self._lines[heavy].pop()]
        self._left += 1  # it may stand in other lines too
        self.given_up += 1
        return True

    def done(self, token: str) -> list[tuple[str, str, bool]]:
        """A triage ended: its place goes to the next names, a line at a time in turn; each
        (token, user, fresh) returned is under way now."""
        user = self.running.pop(token, None)
        if user is not None:
            held = self._held[user] - 1
            if held:
                self._held[user] = held
            else:
                del self._held[user]
        started: list[tuple[str, str, bool]] = []
        while len(self.running) < self.places:
            nxt = self._next()
            if nxt is None:
                break
            tok, who = nxt
            fresh = self.waiting.pop(tok)
            self._left += 1  # it may stand in other users' lines too
            self.running[tok] = who
            self._held[who] = self._held.get(who, 0) + 1
            started.append((tok, who, fresh))
        return started

    def _next(self) -> tuple[str, str] | None:
        """The oldest waiting name of the first user in turn who holds less than its share; that
        user goes to the end of the turn."""
        for who in list(self._lines):
            if self._held.get(who, 0) >= self.share:
                continue
            line = self._lines.pop(who)
            while line and line[0] not in self.waiting:
                line.popleft()  # started from another user's line, or ahead of its turn
            if not line:
                self._compacted.pop(who, None)
                continue
            tok = line.popleft()
            if line:
                self._lines[who] = line  # to the end of the turn
            else:
                self._compacted.pop(who, None)
            return tok, who
        return None
