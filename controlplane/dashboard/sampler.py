"""Queue figures over time: what the dashboard sampled from the dispatcher, kept while it runs.

Requests are not in the log, so their figures (waiting, running, completed, errors, completion
latency) exist only as the dispatcher answers them (`ndif.dispatcher.state`, asked once a second).
`QueueSamples` keeps each model's answers when they change, with the spans of time it was
sampling, and reads them back as plot series or as the figures at one past time. Anything it did
not sample (before the dashboard started, a gap with no dispatcher) reads as unknown, never as 0.

No I/O, no clock: times come in with each record.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, NamedTuple

FINE = 7200  # changed samples kept per model at poll resolution (2 h at 1 a second when busy)
COARSE = 1440  # ... and one a minute after that (24 h)
COARSE_EVERY_S = 60.0
MAX_MODELS = 2000
MAX_SPANS = 1000
QUANTILES = (0.5, 0.99)


class Sample(NamedTuple):
    t: float
    queued: int | None  # held by the dispatcher, not yet running
    pending: int | None  # in the model's work-queue consumer, not yet taken by the dispatcher
    in_flight: int | None
    completed: int | None  # cumulative, since the dispatcher started
    errors: int | None
    oldest_wait_s: float | None
    latency: tuple[int, ...] | None  # cumulative counts per bound (+Inf last)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _sample(t: float, row: dict[str, Any]) -> Sample:
    lat = row.get("latency_s")
    counts = tuple(lat["counts"]) if isinstance(lat, dict) and isinstance(lat.get("counts"), list) else None
    wait = row.get("oldest_wait_s")
    return Sample(t, _int(row.get("queued")), _int(row.get("pending")), _int(row.get("in_flight")),
                  _int(row.get("completed")), _int(row.get("errors")),
                  float(wait) if isinstance(wait, (int, float)) else None, counts)


def waiting(s: Sample) -> int | None:
    """Requests waiting: in the dispatcher's queue plus those not yet taken from the stream."""
    if s.queued is None and s.pending is None:
        return None
    return (s.queued or 0) + (s.pending or 0)


def quantile(q: float, bounds: list[float], counts: list[int]) -> float | None:
    """Prometheus' `histogram_quantile`: cumulative `counts` (one per bound, +Inf last), linear within
    the bucket the rank falls in; None without observations."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    i = bisect.bisect_left(counts, rank)
    if i >= len(bounds):  # in the +Inf bucket: the largest finite bound is all that is known
        return bounds[-1] if bounds else None
    lo_b = bounds[i - 1] if i > 0 else 0.0
    lo_c = counts[i - 1] if i > 0 else 0
    width = counts[i] - lo_c
    return lo_b + (bounds[i] - lo_b) * ((rank - lo_c) / width if width else 1.0)


class QueueSamples:
    """Each model's dispatcher figures as sampled, and when sampling ran."""

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        # How long after an answered poll the next answer still continues the stretch: one interval
        # plus the ask itself (the dispatcher has 1 s to answer, then the stream's consumers are listed).
        self.slack = max(2 * poll_s, poll_s + 2.5)
        self.fine: dict[str, collections.deque[Sample]] = {}
        self.coarse: dict[str, collections.deque[Sample]] = {}
        self.bounds: dict[str, list[float]] = {}
        self.spans: list[list[float]] = []  # [start, end] of each stretch of answered polls
        self.dispatcher: str | None = None

    # ---- recording ------------------------------------------------------------------------------

    def record(self, t: float, body: dict[str, Any]) -> None:
        """One poll's answer (the dashboard's `/api/queues` body) at time `t`."""
        if not body.get("dispatcher"):
            return  # no dispatcher answered: this stretch is unknown
        if body["dispatcher"] != self.dispatcher:
            self.dispatcher = body["dispatcher"]  # another dispatcher: its counters start over
        spans = self.spans
        prev_poll: float | None = None  # the previous answered poll of this stretch
        if spans and t - spans[-1][1] <= self.slack:
            prev_poll = spans[-1][1]
            spans[-1][1] = t
        else:
            spans.append([t, t])
            del spans[:-MAX_SPANS]
        for mk, row in body.get("models", {}).items():
            if "completed" not in row:
                continue  # no processor for it in the dispatcher (only the stream's counts)
            fine = self.fine.get(mk)
            if fine is None:
                if len(self.fine) >= MAX_MODELS:
                    continue
                fine = self.fine[mk] = collections.deque()
                self.coarse[mk] = collections.deque(maxlen=COARSE)
            lat = row.get("latency_s")
            if isinstance(lat, dict) and isinstance(lat.get("le"), list):
                self.bounds[mk] = [float(b) for b in lat["le"]]
            s = _sample(t, row)
            if not fine and prev_poll is not None:
                # A processor made since the last poll: its counters started at 0 then (a model
                # already there on the first poll is a baseline: what it did before is unknown).
                zero = tuple(0 for _ in s.latency) if s.latency is not None else None
                fine.append(Sample(prev_poll, 0, s.pending, 0, 0, 0, None, zero))
            if fine and fine[-1][1:] == s[1:]:
                continue  # nothing moved: the step holds
            fine.append(s)
            if len(fine) > FINE:
                old = fine.popleft()
                coarse = self.coarse[mk]
                if not coarse or old.t - coarse[-1].t >= COARSE_EVERY_S:
                    coarse.append(old)

    # ---- reading ---------------------------------------------------------------------------------

    def covered(self, t: float, starts: list[float] | None = None) -> bool:
        """Was the dashboard sampling at time `t`? (`starts`: the spans' starts, when asked often.)"""
        i = bisect.bisect_right(starts if starts is not None else [s[0] for s in self.spans], t) - 1
        return i >= 0 and t <= self.spans[i][1] + self.slack

    def _span(self, t: float, starts: list[float]) -> int:
        """The index of the stretch of sampling `t` falls in, or -1."""
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t <= self.spans[i][1] + self.slack else -1

    def _samples(self, mk: str) -> list[Sample]:
        return [*self.coarse.get(mk, ()), *self.fine.get(mk, ())]

    def at(self, t: float) -> dict[str, Any] | None:
        """Every model's figures as last sampled at or before `t`; None if not sampling then."""
        if not self.covered(t):
            return None
        out: dict[str, Any] = {}
        for mk in self.fine:
            got = self._at(mk, t)
            if got is not None:
                out[mk] = {"queued": got.queued, "pending": got.pending, "in_flight": got.in_flight,
                           "completed": got.completed, "errors": got.errors, "oldest_wait_s": got.oldest_wait_s,
                           "sampled_at": got.t}
        return {"t": t, "models": out}

    def _at(self, mk: str, t: float) -> Sample | None:
        samples = self._samples(mk)
        i = bisect.bisect_right([s.t for s in samples], t)
        return samples[i - 1] if i else None

    def series(self, mk: str, t0: float, t1: float, points: int) -> dict[str, Any]:
        """Plot series over [t0, t1]: one value per slice (at least two polls wide) ending at `t`;
        null where the dashboard was not sampling at the slice's end. Rates and latency quantiles are
        over what was sampled in each slice (the first slice of a stretch: since sampling began)."""
        width = max((t1 - t0) / max(points, 1), 2 * self.poll_s)
        n = max(1, int((t1 - t0) / width))
        ends = [t0 + (j + 1) * width for j in range(n)]
        samples = self._samples(mk)
        bounds = self.bounds.get(mk, [])
        cols: dict[str, list[Any]] = {k: [] for k in ("waiting", "running", "completed_per_s", "errors_per_s",
                                                      *(f"p{round(q * 100)}_s" for q in QUANTILES))}
        starts = [s[0] for s in self.spans]
        i = bisect.bisect_right([s.t for s in samples], t0)
        prev = samples[i - 1] if i else None
        for end in ends:
            done = errs = 0
            lat: list[int] | None = None
            while i < len(samples) and samples[i].t <= end:
                s = samples[i]
                # Across a gap in sampling, when the counters moved is unknown: not counted.
                if prev is not None and self._span(prev.t, starts) == self._span(s.t, starts) >= 0:
                    done += _increase(prev.completed, s.completed)
                    errs += _increase(prev.errors, s.errors)
                    if s.latency is not None and prev.latency is not None and len(s.latency) == len(prev.latency):
                        grew = s.latency[-1] >= prev.latency[-1]
                        d = [a - b if grew else a for a, b in zip(s.latency, prev.latency, strict=True)]
                        lat = d if lat is None else [x + y for x, y in zip(lat, d, strict=True)]
                prev = s
                i += 1
            if not self.covered(end, starts):
                for c in cols.values():
                    c.append(None)
                continue
            if prev is None:  # nothing sampled of this model yet (its queue began later): not drawn
                for c in cols.values():
                    c.append(None)
                continue
            cols["waiting"].append(waiting(prev))
            cols["running"].append(prev.in_flight)
            cols["completed_per_s"].append(round(done / width, 3))
            cols["errors_per_s"].append(round(errs / width, 3))
            for q in QUANTILES:
                cols[f"p{round(q * 100)}_s"].append(quantile(q, bounds, lat) if lat and bounds else None)
        return {"t": ends, **cols, "slice_s": width, "sampled_since": self.spans[0][0] if self.spans else None}


def _increase(a: int | None, b: int | None) -> int:
    """A counter's increase between two samples; a drop means it started over (a new dispatcher)."""
    if a is None or b is None:
        return 0
    return b - a if b >= a else b
