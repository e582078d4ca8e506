"""A payload the replica would refuse is refused at submit (exit 2), before anything is sent: the
rules are schemas/requests.py `payload_problem`, which the replica applies too."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import structlog

from controlplane.store.credentials import Creds
from dataplane.client import Client
from dataplane.ops.cli import main
from schemas.errors import InvalidCommand
from schemas.requests import MAX_NEW_TOKENS, payload_problem


@pytest.mark.parametrize("payload", [
    {"op": "forward", "input_ids": [[1, 2, 3]]},
    {"op": "generate", "input_ids": [1, 2], "max_new_tokens": 4},
    {"op": "generate", "prompt": "Hello"},
    {"op": "echo", "data": 1},
    {"input_ids": [[1], [2]], "modules": ["transformer.h.0"], "top_k": 3},
])
def test_what_a_replica_runs_passes(payload: dict) -> None:
    assert payload_problem(payload) is None


@pytest.mark.parametrize(("payload", "says"), [
    ({"op": "train", "input_ids": [[1]]}, "unknown op 'train'"),
    ({"op": "forward"}, "needs input_ids"),
    ({"op": "forward", "input_ids": []}, "non-empty list"),
    ({"op": "forward", "input_ids": [[1, 2], [3]]}, "equally long"),
    ({"op": "forward", "input_ids": [[1, -2]]}, "ints in"),
    ({"op": "forward", "input_ids": [[1, "2"]]}, "ints in"),
    ({"op": "forward", "input_ids": [[True]]}, "ints in"),
    ({"op": "forward", "input_ids": [list(range(70_000))]}, "more than"),
    ({"op": "generate", "input_ids": [[1]], "max_new_tokens": 0}, "max_new_tokens"),
    ({"op": "generate", "input_ids": [[1]], "max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens"),
    ({"op": "generate", "prompt": ""}, "prompt"),
    ({"op": "forward", "input_ids": [[1]], "modules": "h.0"}, "modules"),
    ([1, 2], "JSON object"),
])
def test_what_a_replica_refuses_is_named(payload: object, says: str) -> None:
    problem = payload_problem(payload)
    assert problem is not None and says in problem, problem


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """`main` configures structlog onto this test's captured stderr, which pytest closes after it:
    later in-process services of the same run would write to a closed file."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("flags", [["--input-ids", "1,-2"], ["--prompt", "hi", "--max-new-tokens", "0"],
                                   ["--prompt", "hi", "--max-new-tokens", "5000"]])
def test_submit_refuses_an_invalid_payload_with_exit_2_before_connecting(flags: list[str], capsys) -> None:
    # Nothing listens on the port: a submit that got as far as connecting would fail with another
    # exit code, so exit 2 here means it stopped before sending anything.
    code = main(["submit", "openai-community/gpt2", "--nats", f"nats://127.0.0.1:{_dead_port()}", *flags])
    assert code == 2
    assert "invalid request" in capsys.readouterr().err


async def test_the_sdk_refuses_an_invalid_payload_before_it_stores_anything() -> None:
    """The SDK applies the same rules: a researcher's program gets InvalidCommand at submit, nothing
    is stored or listened to (the client is not even connected: nothing could have been sent)."""
    c = Client(f"nats://127.0.0.1:{_dead_port()}", creds=Creds(role="client", user="client-a", name="a", password="x"))
    with pytest.raises(InvalidCommand, match=r"invalid request: .*max_new_tokens"):
        await c.submit("openai-community/gpt2", {"op": "generate", "prompt": "hi", "max_new_tokens": 0})
