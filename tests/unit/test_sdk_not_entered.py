"""A `Client` used without `async with` says so, in one clear error, instead of a bare AttributeError
on `None` (the connection is made on entering: `async with Client(...) as c:`)."""

from __future__ import annotations

import pytest

from controlplane.store.credentials import Creds
from dataplane.client import Client, ClientNotConnected
from schemas.errors import InvalidCommand


def _client() -> Client:
    return Client("nats://127.0.0.1:1", creds=Creds(role="client", user="client-alice", name="alice", password="x"))


@pytest.mark.parametrize("call", [
    lambda c: c.submit("openai-community/gpt2", {"op": "echo"}),
    lambda c: c.kill("r1"),
])
async def test_a_client_used_without_async_with_says_to_use_it(call) -> None:
    with pytest.raises(ClientNotConnected, match=r"async with Client\("):
        await call(_client())


async def test_a_job_of_a_client_not_entered_says_so_too() -> None:
    job = await _client().job("r1")
    with pytest.raises(ClientNotConnected, match=r"async with Client\("):
        await job.latest()


def test_the_error_is_a_runtime_error() -> None:
    assert issubclass(ClientNotConnected, RuntimeError)


async def test_a_payload_too_deep_to_send_is_refused_in_words_not_a_recursion_error() -> None:
    deep: object = 1
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(InvalidCommand, match="cannot be sent as JSON"):
        await _client().submit("openai-community/gpt2", {"op": "echo", "data": deep})
