"""Decide-and-append with optimistic concurrency and group commit (docs/architecture.md §5).

Callers submit a pure `decide(state) -> events`. Each loop turn takes every pending decision,
runs them one after another against a working copy of the folded state (each sees the ones before
it), and appends all their events as one atomic batch expecting the sequence that state was folded
to. All or nothing: on a conflict the tail is folded and every decision of the turn is taken again
from the new state. A batch never exceeds MAX_BATCH events.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import msgspec
import structlog

from controlplane.core.ports import EventLog
from controlplane.core.projections.base import Projection, afold_batches
from controlplane.service.tasks import cancel_and_wait
from schemas.errors import ConflictError, InfrastructureError, NdifError
from schemas.events import MAX_BATCH, AnyEvent, Event, Skipped

logger = structlog.get_logger("ndif.committer")  # `log` is the event log

CATCH_UP_RETRY_S = 0.5  # pause before the next turn when folding the tail failed

P = TypeVar("P", bound=Projection)
Decide = Callable[[P], Sequence[Event]]


class Committed(msgspec.Struct, frozen=True, kw_only=True):
    """A decision in the log: its events are first_seq..last_seq (0..0 when it decided nothing)."""

    first_seq: int
    last_seq: int
    events: tuple[Event, ...]
    already_appended: bool = False
    attempts: int = 1


class _Pending:
    __slots__ = ("attempts", "decide", "future")

    def __init__(self, decide: Callable[..., Sequence[Event]], future: asyncio.Future[Committed]) -> None:
        self.decide = decide
        self.future = future
        self.attempts = 0


class GroupCommitter(Generic[P]):
    """Owns the authoritative folded state of one writer; `observe()` feeds it events from a follower."""

    def __init__(self, log: EventLog, state: P, *, max_attempts: int = 100, max_events: int = MAX_BATCH) -> None:
        self.log = log
        self.state = state
        self.max_attempts = max_attempts
        self.max_events = max_events
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.turns = 0
        self.conflicts = 0
        self._streak = 0  # consecutive conflicts
        self._jitter = random.Random()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> GroupCommitter[P]:
        await self.catch_up()
        self._task = asyncio.create_task(self._run(), name="group-committer")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], owner="group-committer")  # bounded, names where it is stuck
            self._task = None
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(NdifError("committer stopped before the decision was appended"))
        self._pending.clear()

    async def __aenter__(self) -> GroupCommitter[P]:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- API ---------------------------------------------------------------------------------

    async def submit(self, decide: Callable[[P], Sequence[Event]]) -> Committed:
        """Decide against the latest state and append; returns once the events are in the log.

        `decide` must be pure: it may run more than once (after a conflict). An `NdifError` it
        raises is the caller's answer, with nothing appended.
        """
        fut: asyncio.Future[Committed] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(decide, fut))
        self._wake.set()
        return await fut

    def observe(self, seq: int, item: AnyEvent | Skipped) -> None:
        """Apply an event seen by a follower (ours are already applied: seq <= state.seq skips)."""
        self.state.apply(seq, item)

    async def catch_up(self, upto: int | None = None) -> None:
        await afold_batches(self.log.read_batches(self.state.seq + 1, stop_seq=upto), self.state)

    # ---- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                try:
                    await self._turn()
                except Exception:  # a bug, not the network (its failures are answered in _turn): keep serving
                    logger.exception("committer_turn_failed")
                    await asyncio.sleep(CATCH_UP_RETRY_S)

    async def _turn(self) -> None:
        self.turns += 1
        base = self.state.seq
        # The first decision reads the folded state itself (decide is pure); a copy is made only
        # when a second decision joins the turn and must see the first one's events. A lone command
        # (the common case) never pays for copying a large state.
        working: P | None = None
        taken: list[tuple[_Pending, int, tuple[Event, ...]]] = []  # (item, offset, events)
        events: list[Event] = []
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # the caller gave up (cancelled)
                self._pending.pop(0)
                continue
            if taken and working is None:
                working = self.state.copy()
                for i, ev in enumerate(events, start=1):
                    working.apply(base + i, ev)
            try:
                evs = tuple(item.decide(working if working is not None else self.state))
            except NdifError as exc:
                self._pending.pop(0)
                item.future.set_exception(exc)
                continue
            except Exception as exc:
                logger.exception("decide_failed")
                self._pending.pop(0)
                item.future.set_exception(exc)
                continue
            if events and len(events) + len(evs) > self.max_events:
                break  # next turn
            self._pending.pop(0)
            item.attempts += 1
            if working is not None:
                for i, ev in enumerate(evs, start=len(events) + 1):
                    working.apply(base + i, ev)
            taken.append((item, len(events), evs))
            events.extend(evs)
        if not taken:
            return
        if not events:
            for item, _, _ in taken:
                item.future.set_result(Committed(first_seq=0, last_seq=0, events=(), attempts=item.attempts))
            return
        try:
            res = await self.log.append(events, base)
        except ConflictError as exc:
            self.conflicts += 1
            logger.info("append_conflict", expected=exc.expected_last_seq, actual=exc.actual_last_seq,
                     decisions=len(taken))
            retry = []
            for item, _, _ in taken:
                if item.attempts >= self.max_attempts:
                    item.future.set_exception(ConflictError(
                        f"gave up after {item.attempts} conflicting attempts; the log is too busy, try again",
                        expected_last_seq=exc.expected_last_seq, actual_last_seq=exc.actual_last_seq))
                else:
                    retry.append(item)
            self._pending[:0] = retry
            self._streak += 1
            try:
                await self.catch_up(exc.actual_last_seq)
            except Exception as err:  # noqa: BLE001 - the loop must outlive a server loss
                # Folding the tail needs the log (a server lost, a leader being elected). The
                # decisions stay queued and are taken again next turn (each turn is an attempt, so
                # bounded by max_attempts). Letting the exception end the loop would leave every
                # submit() waiting forever.
                logger.warning("catch_up_failed", error=str(err) or type(err).__name__, pending=len(self._pending))
                await asyncio.sleep(CATCH_UP_RETRY_S)
                return
            # Another writer is mid-burst: back off a jittered, growing moment so that it drains
            # instead of both folding and losing in lockstep (bounded: ~50 ms).
            await asyncio.sleep(self._jitter.uniform(0, min(0.001 * 2 ** self._streak, 0.05)))
            return
        except NdifError as exc:
            for item, _, _ in taken:
                item.future.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a NATS error the adapter does not translate
            # Answered as what it is (the append may or may not have landed: the caller resends with
            # the same ids), never left unanswered by a dead loop.
            logger.warning("append_failed", error=str(exc) or type(exc).__name__, decisions=len(taken))
            for item, _, _ in taken:
                item.future.set_exception(InfrastructureError(
                    f"append failed ({type(exc).__name__}: {exc}); retry with the same command id"))
            return
        self._streak = 0
        if working is None:
            # Our events are base+1..base+n (the expectation held); the follower may have applied
            # some already, and the projection skips any sequence it has passed.
            for i, ev in enumerate(events, start=1):
                self.state.apply(base + i, ev)
        elif self.state.seq < working.seq:
            self.state = working
        # else: the follower applied base+1.. to the state meanwhile, in log order: it got past our
        # events, so it holds them and what followed; it is kept. (Swapping in `working` there and
        # catching up from the log let the follower's next event land on it with a gap, and needed
        # the network where nothing else did.)
        for item, offset, evs in taken:
            if item.future.done():
                continue
            first = base + offset + 1
            item.future.set_result(Committed(
                first_seq=first if evs else 0, last_seq=first + len(evs) - 1 if evs else 0, events=evs,
                already_appended=res.already_appended, attempts=item.attempts,
            ))
