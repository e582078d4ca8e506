"""Every decoder of untrusted bytes returns a value or a typed refusal, whatever it is given.

Arbitrary bytes, arbitrary JSON, nesting thousands of levels deep, invalid UTF-8 inside a string
and mutated real bodies (tests/strategies.py `hostile_bytes`) go to each decoder and to the fold
every follower runs: no exception escapes, the fold moves past every message.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.projections import ClusterState
from controlplane.store.heartbeats import beat_counts
from dataplane.serving.dispatcher.intake import _checked, _id_of
from schemas import events as E
from schemas.commands import decode_command
from schemas.errors import InvalidCommand
from schemas.guard import MAX_DEPTH, Refused, body_problem, decode_any, depth
from schemas.inventory import decode_inventory
from schemas.keys import canonical_model_key, display_name, model_parts
from schemas.requests import StatusUpdate, decode_request, decode_status
from schemas.subjects import model_token, node_token
from tests.strategies import bad_utf8_json, deep_json, hostile_bytes

SUBJECTS = ["ndif.evt.node.node-a-0123456789", f"ndif.evt.replica.{model_token('m')}.0.{node_token('node-a')}",
            f"ndif.evt.replica.{model_token('m')}.0", "ndif.evt.model.x", "ndif.evt.cmd.y"]
many = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


# ---- the poison bodies of the issue, as they were sent ----------------------------------------


POISON_NESTED = b"[" * 3000 + b"]" * 3000  # 6 KB of nested arrays
POISON_UTF8 = b'{"type":"NodeJoined","event_id":"\xff"}'  # 36 bytes, invalid UTF-8 inside a string


def test_msgspec_itself_raises_more_than_decode_errors() -> None:
    """Why the guard exists: msgspec raises RecursionError and UnicodeDecodeError for these, not DecodeError."""
    assert len(POISON_UTF8) == 36
    with pytest.raises(RecursionError):
        msgspec.json.decode(b'{"x":' + POISON_NESTED + b"}", type=dict)
    with pytest.raises(UnicodeDecodeError):
        msgspec.json.decode(POISON_UTF8)


@pytest.mark.parametrize("body", [POISON_NESTED, POISON_UTF8, b'{"type":"NodeJoined","x":' + POISON_NESTED + b"}"])
def test_the_poison_events_are_skipped_with_the_reason(body: bytes) -> None:
    got = E.decode_or_skip(body)
    assert isinstance(got, E.Skipped) and ("nested" in got.reason or "UTF-8" in got.reason), got
    state = ClusterState().apply(1, E.stored_item(SUBJECTS[0], body))
    assert state.seq == 1 and state.skipped == 1


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert depth(b'[1, {"a": [2]}]') == 3
    assert depth(b'["[[[[[", "\\"[[[", {"]]]": 1}]') == 2
    assert body_problem(b'["' + b"[" * 1000 + b'"]', limit=10_000) is None  # brackets in a string
    assert body_problem(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), limit=10_000) is not None
    assert body_problem(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, limit=10_000) is None
    assert body_problem(b"x" * 11, limit=10) is not None


# ---- every decoder, any bytes ------------------------------------------------------------------


@many
@given(hostile_bytes, st.sampled_from(SUBJECTS))
def test_event_decoding_never_raises(data: bytes, subject: str) -> None:
    got = E.decode_or_skip(data)
    assert isinstance(got, (E.Event, E.Skipped))
    item = E.stored_item(subject, data)
    assert isinstance(item, (E.Event, E.Skipped))
    if isinstance(item, E.Skipped):
        assert item.reason


@many
@given(hostile_bytes, st.sampled_from(["deploy", "scale", "evict", None]))
def test_command_decoding_refuses_with_invalid_command_only(data: bytes, verb: str | None) -> None:
    try:
        decode_command(data, verb=verb)
    except InvalidCommand as exc:
        assert str(exc)


@many
@given(hostile_bytes, st.sampled_from(["", "alice", "bad user", "x" * 200]), st.sampled_from(["tok", "m"]))
def test_request_decoding_refuses_with_invalid_command_only(data: bytes, user: str, token: str) -> None:
    try:
        decode_request(data)
    except InvalidCommand:
        pass
    try:
        _checked(data, user, token)  # the dispatcher's intake, subject checks included
    except InvalidCommand:
        pass
    rid = _id_of(data, {"Nats-Msg-Id": data.decode("latin-1")})
    assert rid is None or isinstance(rid, str)


@many
@given(hostile_bytes)
def test_status_and_any_decoding_never_raise(data: bytes) -> None:
    assert isinstance(decode_status(data), (StatusUpdate, Refused))
    decode_any(data, limit=1 << 20)  # a value or Refused


@many
@given(hostile_bytes, st.sampled_from(["node-a-0123456789", node_token("node-a")]))
def test_a_heartbeat_value_is_judged_never_raised_on(data: bytes, key: str) -> None:
    assert beat_counts(key, data) in (True, False)


@many
@given(hostile_bytes)
def test_inventory_decoding_refuses_with_invalid_command_only(data: bytes) -> None:
    try:
        decode_inventory(data)
    except InvalidCommand as exc:
        assert str(exc)


@many
@given(st.one_of(hostile_bytes.map(lambda b: b.decode("utf-8", "replace")),
                 deep_json().map(lambda b: "C:{\"repo_id\": " + b.decode() + "}"), st.text()))
def test_model_keys_from_the_wire_never_raise_past_invalid_command(text: str) -> None:
    try:
        key = canonical_model_key(text, relative=False)
    except InvalidCommand:
        key = text
    model_token(key)
    display_name(key)
    try:
        model_parts(key)
    except InvalidCommand:
        pass


# ---- every follower's fold: one bad message never stops it -------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.one_of(hostile_bytes, st.builds(E.encode_event, st.deferred(lambda: _any_event()))),
                min_size=1, max_size=30), st.sampled_from(SUBJECTS))
def test_the_fold_moves_past_every_message(bodies: list[bytes], subject: str) -> None:
    state = ClusterState()
    for seq, body in enumerate(bodies, 1):
        state.apply(seq, E.stored_item(subject, body))
        assert state.seq == seq
    state.to_snapshot()  # what `ndif status` and the dashboard read of it
    ClusterState.from_snapshot(state.to_snapshot())


def _any_event() -> st.SearchStrategy[E.Event]:
    from tests.strategies import any_event

    return any_event()


@given(bad_utf8_json())
def test_invalid_utf8_is_refused_before_msgspec(data: bytes) -> None:
    assert "UTF-8" in (body_problem(data, limit=1 << 20) or "")
