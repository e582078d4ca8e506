"""`job.statuses()` on a job that has ended yields its terminal status and returns: it must not wait
for statuses that never come (and, with a timeout, blame the dispatcher). `job.result()` on one
refused for its user's queued limit raises `QueueLimitExceeded` with the limit and the count."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from dataplane.client import Job, QueueLimitExceeded, RequestFailed
from schemas.requests import StatusUpdate
from schemas.status import RequestStatus


async def test_statuses_of_an_ended_job_yield_its_terminal_status_and_return() -> None:
    job = Job(client=Any, request_id="r1", model_key="m")  # type: ignore[arg-type]  # no connection needed
    done = StatusUpdate(request_id="r1", status=RequestStatus.COMPLETED, ts=datetime.now(UTC))
    job.last = done
    got = await asyncio.wait_for(_all(job), 2)
    assert got == [done]


async def _all(job: Job) -> list[StatusUpdate]:
    return [s async for s in job.statuses()]


async def test_a_request_refused_for_its_users_queued_limit_raises_queue_limit_exceeded_with_both_figures() -> None:
    job = Job(client=Any, request_id="r2", model_key="m")  # type: ignore[arg-type]  # no connection needed
    job.last = StatusUpdate(request_id="r2", status=RequestStatus.ERROR, ts=datetime.now(UTC),
                            error="QueueLimitExceeded", limit=5, count=5,
                            message="user 'u' has 5 requests queued for m, the limit is 5: wait ...")
    with pytest.raises(QueueLimitExceeded) as got:
        await job.result(timeout=2)
    assert (got.value.limit, got.value.count, got.value.error) == (5, 5, "QueueLimitExceeded")
    assert "the limit is 5" in str(got.value)
    other = Job(client=Any, request_id="r3", model_key="m")  # type: ignore[arg-type]
    other.last = StatusUpdate(request_id="r3", status=RequestStatus.ERROR, ts=datetime.now(UTC), error="QueueTimeout")
    with pytest.raises(RequestFailed) as failed:
        await other.result(timeout=2)
    assert not isinstance(failed.value, QueueLimitExceeded)
