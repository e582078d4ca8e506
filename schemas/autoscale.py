"""Autoscaling vocabulary: a model's policy (set by `ndif autoscale`, recorded in `AutoscalePolicySet`),
and the queue figures dispatchers publish on `ndif.figures.<mtok>` (`FIGURES_PREFIX`), which the
controller sums and the decision that acts on them records (`AutoscaleDecided`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

import msgspec

from schemas.errors import InvalidCommand, decode_bounded
from schemas.status import Level

# Bounds on what a policy may say: beyond them a value is a typo, not a setting.
MAX_DELAY_S: Final = 86_400.0  # upscale / downscale delay, max wait: a day
MAX_IDLE_AFTER_S: Final = 7 * 86_400.0
MAX_IDLE_S: Final = 10 * MAX_IDLE_AFTER_S  # the most idle time figures carry: past any policy's idle-after
MAX_TARGET_QUEUE: Final = 100_000.0
FIGURES_CADENCE_S: Final = 1.0  # how often a dispatcher publishes a model's figures
FIGURES_STALE_S: Final = 3 * FIGURES_CADENCE_S  # a dispatcher not heard from for longer counts for nothing


class AutoscalePolicy(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """How a model's replica count follows its queue.

    Up: when (queued + running) / replicas is above `target_queue_per_replica` for
    `upscale_delay_s`, or the oldest queued request has waited longer than `max_wait_s` (that long,
    also for `upscale_delay_s`), up to `max_replicas`. Down: when the load would fit in fewer
    replicas at 80% of the target for `downscale_delay_s`, never below `max(min_replicas, 1)`.
    Idle (nothing queued or running, as the dispatchers' `idle_s` counts it) for `idle_after_s`:
    down to `min_replicas` (0 allowed). Replicas taken down, idle or not, go to `idle_to` (WARM
    where the node's CPU cache holds them, else COLD). A model at 0 replicas with a request
    queued gets one at once.
    """

    min_replicas: int = 1
    max_replicas: int = 8
    target_queue_per_replica: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    idle_to: Level = Level.WARM
    idle_after_s: float = 300.0
    max_wait_s: float | None = 30.0  # None: the oldest wait is no signal

    def problem(self, max_replicas: int) -> str | None:
        """Why this policy is invalid (None: it is valid); `max_replicas` is the limit per model."""
        if not 0 <= self.min_replicas <= max_replicas:
            return f"--min must be between 0 and {max_replicas}, got {self.min_replicas}"
        if not 1 <= self.max_replicas <= max_replicas:
            return f"--max must be between 1 and {max_replicas} (the limit per model), got {self.max_replicas}"
        if self.min_replicas > self.max_replicas:
            return f"--min ({self.min_replicas}) is above --max ({self.max_replicas})"
        if not 0 < self.target_queue_per_replica <= MAX_TARGET_QUEUE:  # also refuses nan
            return (f"--target-queue-per-replica must be above 0 and at most {MAX_TARGET_QUEUE:g}, "
                    f"got {self.target_queue_per_replica}")
        for flag, v in (("--upscale-delay", self.upscale_delay_s), ("--downscale-delay", self.downscale_delay_s)):
            if not 0 <= v <= MAX_DELAY_S:
                return f"{flag} must be between 0 and {MAX_DELAY_S:g} s, got {v}"
        if not 0 <= self.idle_after_s <= MAX_IDLE_AFTER_S:
            return f"--idle-after must be between 0 and {MAX_IDLE_AFTER_S:g} s, got {self.idle_after_s}"
        if self.idle_to is Level.HOT:
            return "--idle-to must be WARM or COLD"
        if self.max_wait_s is not None and not 0 < self.max_wait_s <= MAX_DELAY_S:
            return f"--max-wait must be above 0 and at most {MAX_DELAY_S:g} s, got {self.max_wait_s}"
        return None

    def check(self, max_replicas: int) -> AutoscalePolicy:
        why = self.problem(max_replicas)
        if why is not None:
            raise InvalidCommand(f"autoscale: {why}")
        return self


class QueueFigures(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One model's queue as one dispatcher sees it (or the sum over dispatchers, `dispatchers` > 1).

    `arrival_rate` is requests per second over the last cadence; `completions` counts requests
    finished (completed or failed) since the dispatcher started; `oldest_wait_s` is how long the
    oldest queued request has waited (0 when none is queued); `idle_s` how long the dispatcher has
    had none of the model's requests queued, running or finishing (0 while it has; since its own
    start at most: a restarted dispatcher's idle clock starts again, which only delays a scale-down).
    The autoscaler's idle delay runs on `idle_s`: a request between two evaluations restarts it
    without an event in the log.
    """

    model_key: str = ""  # "" inside an AutoscaleDecided (the event names the model)
    queued: int = 0
    running: int = 0
    oldest_wait_s: float = 0.0
    arrival_rate: float = 0.0
    completions: int = 0
    dispatcher: str = ""
    ts: datetime | None = None  # when the dispatcher took them
    dispatchers: int = 1
    idle_s: float = 0.0

    @property
    def demand(self) -> int:
        return self.queued + self.running


MAX_FIGURES_BYTES: Final = 4096
_figures_decoder = msgspec.json.Decoder(QueueFigures)


def decode_figures(data: bytes) -> QueueFigures:
    """A dispatcher's published figures; InvalidCommand for anything malformed or out of bounds."""
    f = decode_bounded(_figures_decoder, data, limit=MAX_FIGURES_BYTES, what="queue figures")
    if (min(f.queued, f.running, f.completions) < 0 or not 0 <= f.oldest_wait_s <= 10 * MAX_DELAY_S
            or not 0 <= f.arrival_rate <= 1e9
            or not 0 <= f.idle_s <= MAX_IDLE_S or not f.model_key or len(f.model_key) > 2000):
        raise InvalidCommand("queue figures out of bounds")
    return f


def sum_figures(model_key: str, parts: list[QueueFigures]) -> QueueFigures | None:
    """Several dispatchers' figures of one model as one (None: none given)."""
    if not parts:
        return None
    stamps = [p.ts for p in parts if p.ts is not None]
    return QueueFigures(model_key=model_key, queued=sum(p.queued for p in parts),
                        running=sum(p.running for p in parts),
                        oldest_wait_s=max(p.oldest_wait_s for p in parts),
                        arrival_rate=sum(p.arrival_rate for p in parts),
                        completions=sum(p.completions for p in parts), dispatcher="",
                        ts=max(stamps) if stamps else None, dispatchers=len(parts),
                        idle_s=min(p.idle_s for p in parts))
