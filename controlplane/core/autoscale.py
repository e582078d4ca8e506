"""The autoscaler, pure: a model's policy, the fold and the queue figures in; a decision out.

`evaluate` says what to do (or None); `decide_autoscale` turns that into events: an
`AutoscaleDecided` with the figures, the rule and the target, then the placement or eviction events
`ndif scale` / `ndif scale-down` would append. Everything the autoscaler remembers between two
evaluations is in the log (the condition it watches and since when, when it last changed the
count) or in the figures (how long the model has been idle), so a restarted controller decides as
one that never stopped, and no figures (none heard from any dispatcher) means no decision, never a
scale-down.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Final

import msgspec

from controlplane.core.context import DecisionContext
from controlplane.core.decide import grow, shrink
from controlplane.core.placement import MIN_DEPLOY_S, PADDING
from controlplane.core.projections.cluster import ClusterState, ModelView
from schemas.autoscale import AutoscalePolicy, QueueFigures
from schemas.events import AutoscaleDecided, Event
from schemas.status import Level

# Scale down only to a count that keeps the load at or below this share of the target: a count
# reached by scaling up never looks like one to scale down (hysteresis, no flapping).
DOWN_FRACTION: Final = 0.8

UP, DOWN, IDLE = "up", "down", "idle"
# After a scale-up the cluster could not place, the next try waits at least this long (and at
# least the upscale delay): a full cluster is not asked again on every tick.
REFUSED_RETRY_S: Final = 30.0


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the autoscaler decided for one model: a new count (`target` != `current`), or only a
    condition it starts or stops watching (`target` == `current`)."""

    model_key: str
    rule: str
    current: int
    target: int
    condition: str  # what it watches after this decision
    since: datetime | None
    held_s: float = 0.0
    level: Level = Level.COLD
    note: str = ""

    @property
    def scales(self) -> bool:
        return self.target != self.current


def classify(p: AutoscalePolicy, n: int, f: QueueFigures) -> tuple[str, str, int]:
    """(condition, rule, the count it asks for) from the figures alone: with the fold's view of the
    model, all `evaluate` reads of the figures besides `queued` at zero and `idle_s` while idle."""
    demand = f.demand
    t = p.target_queue_per_replica
    if demand == 0:
        return (IDLE, "idle", p.min_replicas) if n > p.min_replicas else ("", "", n)
    floor = max(p.min_replicas, 1)
    up = min(p.max_replicas, max(floor, math.ceil(demand / t)))
    if p.max_wait_s is not None and f.queued and f.oldest_wait_s > p.max_wait_s and n < p.max_replicas:
        if up <= n:
            return UP, "oldest-wait", n + 1
        return UP, "queue-above-target", up
    if up > n:
        return UP, "queue-above-target", up
    down = min(p.max_replicas, max(floor, math.ceil(demand / (t * DOWN_FRACTION))))
    if down < n:
        return DOWN, "queue-below-target", down
    return "", "", n


def evaluate(state: ClusterState, model_key: str, figures: QueueFigures | None, now: datetime) -> Decision | None:
    """The autoscaler's decision for one model, or None (nothing to do or to record).

    None without a policy, after a manual count (until the policy is set again), while the model
    is undeployed, and without figures. The policy's bounds first (a count below `min_replicas` or
    above `max_replicas` is corrected at once); from zero with a request queued, one replica at
    once; otherwise a condition must hold for its delay (up: `upscale_delay_s`; down:
    `downscale_delay_s`, counted also from the last change of the count; idle, as the figures'
    `idle_s` counts it: down to `max(min, 1)` after `downscale_delay_s`, to `min_replicas` after
    `idle_after_s`).
    """
    m = state.models.get(model_key)
    if m is None or m.autoscale is None or m.autoscale_manual or m.undeployed or m.registration is None:
        return None
    d = _evaluate(state, m, m.autoscale, figures, now)
    if d is not None and d.target > d.current and _refused_lately(m, now, m.autoscale):
        return None
    return d


def _refused_lately(m: ModelView, now: datetime, p: AutoscalePolicy) -> bool:
    """The last scale-up of the autoscaler found no room, and not long ago."""
    rej, last = m.last_rejection, m.autoscale_last_at
    return (rej is not None and rej.seq > m.autoscale_scaled_seq > 0 and last is not None
            and (now - last).total_seconds() < max(REFUSED_RETRY_S, p.upscale_delay_s))


def _evaluate(state: ClusterState, m: ModelView, p: AutoscalePolicy, figures: QueueFigures | None,
              now: datetime) -> Decision | None:
    model_key = m.model_key
    n = state.replica_count(model_key)

    def act(rule: str, target: int, condition: str = "", since: datetime | None = None, held: float = 0.0,
            level: Level = Level.COLD) -> Decision:
        return Decision(model_key=model_key, rule=rule, current=n, target=target, condition=condition,
                        since=since, held_s=held, level=level)

    if n < p.min_replicas:
        return act("min", p.min_replicas)
    if n > p.max_replicas:
        return act("max", p.max_replicas)
    if figures is None:
        return None  # nothing heard: no window, no decision (never a scale-down on silence)
    condition, rule, want = classify(p, n, figures)
    if n == 0 and figures.queued:
        return act("from-zero", max(1, min(want, p.max_replicas)))
    if condition == IDLE:
        return _idle(m, p, n, want, figures, now)
    since = m.autoscale_since if condition and condition == m.autoscale_condition else now
    assert since is not None
    held = max(0.0, (now - since).total_seconds())
    if condition == UP and held >= p.upscale_delay_s:
        return act(rule, want, held=held)
    if condition == DOWN and held >= p.downscale_delay_s and _quiet(m, now, p.downscale_delay_s):
        return act(rule, want, held=held, level=p.idle_to)
    if condition != m.autoscale_condition:
        return act("watch", n, condition, since if condition else None, held)
    return None


def _idle(m: ModelView, p: AutoscalePolicy, n: int, want: int, figures: QueueFigures, now: datetime) -> Decision | None:
    """Nothing queued or running, more replicas than `min_replicas`. The idle delay runs on the
    dispatchers' `idle_s`, not on a condition in the log: a sparse model's requests start and stop
    no watch (no event per request). A `down` watched before the model went idle goes on being
    watched (the load fell further), and either one held for `downscale_delay_s` takes the count
    part of the way, to `max(min_replicas, 1)`; `idle_after_s` of idle takes it to `min_replicas`.
    Idle counts at the earliest from when the policy was set, the count's last change by an
    operator (or a dispatcher's provisioning) and the autoscaler's last raise: turning autoscaling
    on never acts on idleness from before it, nor on figures taken before a replica came back."""
    held = figures.idle_s
    if m.autoscale_idle_from is not None:
        held = min(held, max(0.0, (now - m.autoscale_idle_from).total_seconds()))
    since = now - timedelta(seconds=held)
    down_held = (max(0.0, (now - m.autoscale_since).total_seconds())
                 if m.autoscale_condition == DOWN and m.autoscale_since is not None else 0.0)

    def act(rule: str, target: int, held_s: float, level: Level = Level.COLD) -> Decision:
        return Decision(model_key=m.model_key, rule=rule, current=n, target=target, condition="", since=since,
                        held_s=held_s, level=level)

    if held >= p.idle_after_s and want < n:
        return act("idle", want, held, p.idle_to)
    floor = max(p.min_replicas, 1)
    part = max(held, down_held)
    if part >= p.downscale_delay_s and floor < n and _quiet(m, now, p.downscale_delay_s):
        return act("queue-below-target", floor, part, p.idle_to)
    if m.autoscale_condition == UP:  # the load it watched is gone
        return Decision(model_key=m.model_key, rule="watch", current=n, target=n, condition="", since=None)
    return None


def _quiet(m: ModelView, now: datetime, delay_s: float) -> bool:
    """No change of the count within the last `delay_s` (a scale-down waits for the last one)."""
    return m.autoscale_last_at is None or (now - m.autoscale_last_at).total_seconds() >= delay_s


def decision_id(state: ClusterState, model_key: str, token: str) -> str:
    """The command id of the next autoscale decision of a model: it names the model and the
    position of its last autoscale event (the controller adds its own secret to it: see
    `Controller._own`); two controllers deciding on the same log append it once (the second's
    expected last sequence fails, and it decides on the state the first left)."""
    m = state.models.get(model_key)
    return f"autoscale-{token}-{m.autoscale_seq if m is not None else 0}"


def decide_autoscale(state: ClusterState, model_key: str, figures: QueueFigures | None, ctx: DecisionContext, *,
                     min_deploy_s: float = MIN_DEPLOY_S, headroom: float = PADDING) -> list[Event]:
    """The events of the autoscaler's decision for one model at `ctx.now` (none: nothing to do).

    A decision already in the log (its command id) appends nothing again."""
    if ctx.command_id in state.commands:
        return []
    d = evaluate(state, model_key, figures, ctx.now)
    if d is None:
        return []
    m = state.models[model_key]
    assert m.autoscale is not None
    seen = msgspec.structs.replace(figures, model_key="", dispatcher="") if figures is not None else None
    head = ctx.event(AutoscaleDecided, model_key=model_key, rule=d.rule, current=d.current, target=d.target,
                     figures=seen, target_queue_per_replica=m.autoscale.target_queue_per_replica, held_s=d.held_s,
                     condition=d.condition, since=d.since, level=d.level)
    if d.target > d.current:
        body = grow(state, model_key, d.target, ctx, min_deploy_s=min_deploy_s, headroom=headroom)
    elif d.target < d.current:
        body = shrink(state, model_key, d.target, ctx, to=d.level)
    else:
        body = []
    return [head, *body]
