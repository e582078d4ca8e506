"""Provisioning: asking the controller for replicas when requests wait for a model that has none.

A rejected deploy (no room) is sent again only once the cluster's capacity changed, with a backoff
(5 s, 10 s, ... 60 s); a model no node could ever hold fails its waiting requests at once
(`PlacementImpossible`). Models the controller refuses outright are remembered for a while, so a
flood of requests for them costs one refusal each. Depends on the status writer only.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from controlplane.core.capacity import capacity_mark, never_fits
from controlplane.core.projections import ClusterState
from controlplane.core.projections.queue import queue_view
from dataplane.serving.dispatcher.background import Background
from dataplane.serving.dispatcher.statuses import StatusWriter
from dataplane.serving.ports import Deploy
from dataplane.serving.processor import Processor
from schemas import errors as errs
from schemas.keys import closest_model, display_name
from schemas.status import RequestStatus
from schemas.units import gib

logger = structlog.get_logger("ndif.dispatcher")
R = RequestStatus
REFUSED_MODEL_MEMO_S = 10.0  # a model the controller refused to deploy is not asked again for this long
MAX_REFUSED_MEMO = 1_000  # refused model names remembered at once (the names come from users: bounded)
TRIAGE_DEPLOYS = 4  # deployments the triage of unknown model subjects asks for at once
PROVISION_RETRY_S = 5.0  # a model the cluster has no room for is deployed again after 5 s, 10 s, ... 60 s
PROVISION_RETRY_MAX_S = 60.0

Refusal = tuple[str, str]  # (error kind, message) a refused request ends with


class Provisioner:
    def __init__(self, *, state: ClusterState, deploy: Deploy, statuses: StatusWriter, bg: Background,
                 default_replicas: int) -> None:
        self.state = state  # the dispatcher's fold (read only here)
        self.deploy = deploy
        self.statuses = statuses
        self.bg = bg
        self.default_replicas = default_replicas
        self.retry_s = PROVISION_RETRY_S  # the first backoff, and how often an unchanged cluster is looked at
        self.rechecks = 0  # timer-driven looks at waiting models so far (what a test awaits instead of sleeping)
        # model token -> (capacity mark, reason it can never be placed or None) of its last rejected deploy
        self._rejected: dict[str, tuple[tuple[object, ...], str | None]] = {}
        self._rechecks: set[str] = set()  # model tokens with a provisioning timer set
        self._refused: dict[str, tuple[float, str, str]] = {}  # model key -> (until, error, message)
        # Deployments asked for by triage at once: a flood of unknown model names waits here instead
        # of queueing that many registry look-ups at the controller.
        self._triage_deploys = asyncio.Semaphore(TRIAGE_DEPLOYS)

    def maybe_provision(self, p: Processor) -> None:
        """Requests wait and the model has no replica asked for: deploy it (once at a time).

        After a rejection the deploy is sent again only once the cluster's capacity changed (and
        not sooner than the backoff): an unchanged cluster would reject it again, and every deploy
        appends events. A model no node can ever hold fails its requests at once, until a node
        that changes that joins.
        """
        if p.model_key is None or not p.queue or p.provisioning:
            return
        if p.view is not None and p.view.replica_count > 0:
            return
        rejected = self._rejected.get(p.token)
        if rejected is not None:
            mark, never = rejected
            if mark == self._mark(p.model_key):
                if never is not None:
                    p.fail_all("PlacementImpossible", f"cannot place {p.model_key}: {never}")
                else:
                    self._recheck_later(p, self.retry_s)  # time alone can make room (evictions)
                return  # still no room: nothing appended
            wait = p.provision_not_before - time.monotonic()
            if never is None and wait > 0:
                self._recheck_later(p, wait)  # changed, but too soon after the last deploy
                return
        p.provisioning = True
        self.bg.spawn(self._provision(p))

    def _retry_provision_later(self, p: Processor) -> None:
        """After a rejected deploy: the next one no sooner than the backoff (5 s, 10 s, ... 60 s)."""
        p.provision_backoff_s = min(max(p.provision_backoff_s * 2, self.retry_s), PROVISION_RETRY_MAX_S)
        p.provision_not_before = time.monotonic() + p.provision_backoff_s
        self._recheck_later(p, p.provision_backoff_s)

    def _recheck_later(self, p: Processor, delay_s: float) -> None:
        """Look at a waiting model again in `delay_s` (one timer per model at a time)."""
        if p.token in self._rechecks:
            return
        self._rechecks.add(p.token)

        def fire() -> None:
            self._rechecks.discard(p.token)
            self.rechecks += 1
            if not self.bg.stopped:
                self.maybe_provision(p)

        asyncio.get_running_loop().call_later(max(0.0, delay_s), fire)

    async def _provision(self, p: Processor) -> None:
        assert p.model_key is not None
        user = _first_user(p)  # before the await: the refusal is this user's, whoever waits by then
        try:
            res = await self.deploy(p.model_key, self.default_replicas, user)
            if res.rejections and not res.replicas:
                r = res.rejections[0]
                await self._folded(res.last_seq)
                never = never_fits(self.state, r.needed_bytes)
                self._rejected[p.token] = (self._mark(p.model_key), never)
                if never is not None:
                    # No node could hold it even empty: waiting cannot help, so the requests end now.
                    logger.warning("provision_impossible", model_key=p.model_key, needed=r.needed_bytes,
                                   reason=never)
                    p.fail_all("PlacementImpossible", f"cannot place {p.model_key}: {never}")
                    return
                # No room anywhere now: tell the waiting users why and try again later (not in a loop).
                self._retry_provision_later(p)
                msg = (f"no room for {p.model_key}: needs {gib(r.needed_bytes)}, {gib(r.free_bytes)} free; "
                       f"trying again in {p.provision_backoff_s:.0f}s (or scale/evict to make room)")
                logger.warning("provision_rejected", model_key=p.model_key, needed=r.needed_bytes, free=r.free_bytes,
                               retry_s=p.provision_backoff_s)
                for w in list(p.queue):
                    self.statuses.status(w, R.PROVISIONING, message=msg)
                return
            p.provision_backoff_s = 0.0
            self._rejected.pop(p.token, None)
            logger.info("provisioned", model_key=p.model_key, replicas=self.default_replicas)
        except errs.AlreadyDeployed:
            pass  # another dispatcher (or an operator) was first: fine
        except errs.OnDemandRefused as exc:  # that user's requests end; another's may have the right
            p.fail_user(user, type(exc).__name__, str(exc))
        except errs.InvalidCommand as exc:
            p.fail_all(type(exc).__name__, f"cannot deploy {p.model_key}: {exc}")
        except errs.NotFound as exc:
            p.fail_all(type(exc).__name__, str(exc))
        except errs.NdifError as exc:
            logger.warning("provision_failed", model_key=p.model_key, error=str(exc))
            await asyncio.sleep(2.0)  # no controller yet: try again on the next event
        finally:
            p.provisioning = False
            await asyncio.sleep(0)
            if p.model_key in self.state.models:
                p.sync(queue_view(self.state, p.model_key))

    def _mark(self, model_key: str) -> tuple[object, ...]:
        """What a deploy's answer depends on: the cluster's capacity and the model's registered size."""
        m = self.state.models.get(model_key)
        size = m.registration.size_bytes if m is not None and m.registration is not None else None
        return capacity_mark(self.state, time.time()), size

    async def _folded(self, seq: int, timeout: float = 5.0) -> None:
        """Wait (bounded) until the fold has reached `seq`: marks are taken after our own events."""
        deadline = time.monotonic() + timeout
        while self.state.seq < seq and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    # ---- for triage: the first request of a model the log does not know ----------------------

    def refusal(self, model_key: str, user: str) -> Refusal | None:
        """Why this model's requests (of `user`) end at once (refused by the controller a moment ago), or None."""
        for key in (model_key, _for(model_key, user)):
            refused = self._refused.get(key)
            if refused is not None and refused[0] > time.monotonic():
                return refused[1], refused[2]
        return None

    async def deploy_first(self, model_key: str, user: str) -> Refusal | None:
        """Deploy a model the log does not know yet, for its first request (a few at a time).

        None: deployed, or deployed by someone first. A refusal (invalid, unknown model) is
        returned and remembered for REFUSED_MODEL_MEMO_S. Any other NdifError (no controller) is
        raised: the request stays and is looked at again.
        """
        try:
            async with self._triage_deploys:
                await self.deploy(model_key, self.default_replicas, user)
            logger.info("provisioned", model_key=model_key, replicas=self.default_replicas, by="first request")
        except errs.AlreadyDeployed:
            pass  # deployed by someone first: its processor takes the requests
        except errs.OnDemandRefused as exc:  # this user's: another user's request may have the right
            now = time.monotonic()
            _memo_put(self._refused, _for(model_key, user), (now + REFUSED_MODEL_MEMO_S, type(exc).__name__, str(exc)), now)
            return type(exc).__name__, str(exc)
        except (errs.InvalidCommand, errs.NotFound) as exc:
            msg = f"cannot deploy {display_name(model_key)}: {exc}"
            serving = [k for k, m in self.state.models.items() if not m.undeployed and m.target_hot > 0]
            near = closest_model(display_name(model_key), serving, names_only=True)
            if near is not None:  # a model this service serves now, by a near name: never a path of the machine
                msg += f"; did you mean {display_name(near)}?"
            now = time.monotonic()
            _memo_put(self._refused, model_key, (now + REFUSED_MODEL_MEMO_S, type(exc).__name__, msg), now)
            return type(exc).__name__, msg
        return None


def _for(model_key: str, user: str) -> str:
    """The memo's key of a refusal that is one user's (NUL: in neither a model key nor a user)."""
    return f"{model_key}\0{user}"


def _first_user(p: Processor) -> str:
    """The user of the oldest waiting request: whose right a deploy for the queue is counted against."""
    return next((w.req.user for w in p.queue), "")


def _memo_put(memo: dict[str, tuple[float, str, str]], key: str, value: tuple[float, str, str], now: float,
              cap: int = MAX_REFUSED_MEMO) -> None:
    """Keep `value` (its first field: until when) under `key`; a full memo drops its expired entries,
    then its oldest, so it never holds more than `cap` (a flood of model names cannot grow it)."""
    if key not in memo and len(memo) >= cap:
        for k in [k for k, v in memo.items() if v[0] <= now]:
            del memo[k]
        while len(memo) >= cap:
            del memo[next(iter(memo))]
    memo[key] = value
