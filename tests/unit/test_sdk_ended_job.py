"""`job.statuses()` on a job that has ended yields its terminal status and returns: it must not wait
for statuses that never come (and, with a timeout, blame the dispatcher)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from dataplane.client import Job
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
