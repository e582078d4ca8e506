"""Every decoder of untrusted bytes returns a value or a typed refusal, whatever it is given.

Arbitrary bytes, arbitrary JSON, nesting thousands of levels deep, invalid UTF-8 inside a string
and mutated real bodies (tests/strategies.py `hostile_bytes`) go to each decoder and to the fold
every follower runs: no exception escapes, the fold moves past every message.
"""

from __future__ import annotations

import hashlib
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.core.fairness import FairnessPolicy, decode_policy
from controlplane.core.projections import ClusterState
from controlplane.core.projections.cluster import SNAPSHOT_SCHEMA
from controlplane.core.projections.snapshot import KIND, SnapshotHeader, decode_stored, encode_stored
from controlplane.dashboard.server import dispatcher_rows
from controlplane.store.heartbeats import beat_counts
from dataplane.replica import wire as W
from dataplane.serving.dispatcher.intake import _checked, _id_of
from schemas import events as E
from schemas import logs as L
from schemas.autoscale import QueueFigures, decode_figures
from schemas.commands import CommandResult, decode_command, decode_result
from schemas.errors import InvalidCommand
from schemas.guard import MAX_DEPTH, Refused, body_problem, decode_any, depth
from schemas.inventory import decode_inventory
from schemas.keys import canonical_model_key, display_name, model_parts
from schemas.requests import StatusUpdate, decode_request, decode_status
from schemas.subjects import model_token, node_token
from tests.strategies import MSGSPEC_BAD_UTF8, bad_utf8_json, deep_json, hostile_bytes

SUBJECTS = ["ndif.evt.node.node-a-0123456789", f"ndif.evt.replica.{model_token('m')}.0.{node_token('node-a')}",
            f"ndif.evt.replica.{model_token('m')}.0", "ndif.evt.model.x", "ndif.evt.cmd.y"]
many = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


# ---- the poison bodies of the issue, as they were sent ----------------------------------------


POISON_NESTED = b"[" * 3000 + b"]" * 3000  # 6 KB of nested arrays
POISON_UTF8 = b'{"type":"NodeJoined","event_id":"\xff"}'  # 36 bytes, invalid UTF-8 inside a string


def test_msgspec_itself_raises_more_than_decode_errors() -> None:
    """Why the guard exists: msgspec raises RecursionError for deep nesting, not DecodeError (and, before
    0.23, UnicodeDecodeError for bad UTF-8); the guard refuses both with its own reason whichever it raises."""
    assert len(POISON_UTF8) == 36
    with pytest.raises(RecursionError):
        msgspec.json.decode(b'{"x":' + POISON_NESTED + b"}", type=dict)
    with pytest.raises(MSGSPEC_BAD_UTF8):
        msgspec.json.decode(POISON_UTF8)
    got = decode_any(POISON_UTF8, limit=1 << 20)
    assert isinstance(got, Refused) and got.reason.startswith("body refused: not UTF-8"), got
    got = decode_any(b'{"x":' + POISON_NESTED + b"}", limit=1 << 20)
    assert isinstance(got, Refused) and got.reason.startswith("body refused: nested"), got


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


@many
@given(hostile_bytes)
def test_queue_figures_decoding_refuses_with_invalid_command_only(data: bytes) -> None:
    try:
        assert isinstance(decode_figures(data), QueueFigures)
    except InvalidCommand as exc:
        assert str(exc)


@many
@given(hostile_bytes)
def test_logs_ask_and_answer_decoding_refuse_with_invalid_command_only(data: bytes) -> None:
    for decode, cls in ((L.decode_ask, L.LogsAsk), (L.decode_reply, L.LogsReply)):
        try:
            assert isinstance(decode(data), cls)  # type: ignore[operator]
        except InvalidCommand as exc:
            assert str(exc)


@many
@given(hostile_bytes)
def test_fairness_policy_decoding_refuses_with_invalid_command_only(data: bytes) -> None:
    try:
        assert isinstance(decode_policy(data), FairnessPolicy)
    except InvalidCommand as exc:
        assert str(exc)


@many
@given(hostile_bytes)
def test_a_command_result_and_a_dispatcher_state_answer_are_read_or_refused(data: bytes) -> None:
    got = decode_result(data)
    assert isinstance(got, CommandResult) or (isinstance(got, Refused) and got.reason), got
    name, rows, problem = dispatcher_rows(data)  # the dashboard's queue table
    assert (name is None or isinstance(name, str)) and isinstance(rows, dict)
    assert problem is None or isinstance(problem, str)


@st.composite
def hostile_msgpack(draw: st.DrawFn) -> bytes:
    """msgpack a replica call or answer must survive: nesting past the recursion limit, invalid UTF-8
    in a string, real calls and answers cut and flipped, and any bytes (hostile JSON included)."""
    kind = draw(st.sampled_from(["deep", "utf8", "mutated", "any"]))
    real = draw(st.sampled_from([W.encode_call([{"op": "echo", "data": "x" * 20}], ["alice"]),
                                 W.encode_reply(W.Answers(answers=[W.Completed(result={"a": [1]}, seconds=0.5),
                                                                   W.Failed(error="E", message="m", seconds=1.0),
                                                                   W.NotRun(reason="r")])),
                                 W.encode_reply(W.Parked())]))
    if kind == "deep":
        head = draw(st.sampled_from([b"", b"\x91\x91\x81\xa1a", b"\x92\xa7answers\x91\x93\xa9completed"]))
        return head + draw(st.sampled_from([b"\x91", b"\x81\xa1a"])) * draw(st.integers(100, 50_000)) + b"\x01"
    if kind == "utf8":
        bad = draw(st.sampled_from([b"\xa1\xff", b"\xa2\xc3\x28", b"\xa3\xed\xa0\x80"]))
        return draw(st.sampled_from([b"\x91\x91\x81\xa1a", b"\x91\x91\x81", b"\x92", b"\x92\xa6failed"])) + bad
    if kind == "mutated":
        body = bytearray(real)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(body)))
            if draw(st.booleans()) and i < len(body):
                body[i] = draw(st.integers(0, 255))
            else:
                del body[i:]
        return bytes(body)
    return bytes(draw(hostile_bytes))


@many
@given(hostile_msgpack())
def test_replica_calls_and_answers_are_read_or_refused(data: bytes) -> None:
    """The replica's endpoint and the dispatcher's link (dataplane/replica/wire.py) never raise."""
    call = W.decode_call(data)
    assert isinstance(call, W.Call) or (isinstance(call, Refused) and call.reason), call
    reply = W.decode_reply(data)
    assert isinstance(reply, (W.Answers, W.Parked)) or (isinstance(reply, Refused) and reply.reason), reply


@st.composite
def hostile_snapshot(draw: st.DrawFn) -> bytes:
    """Stored snapshot bytes: any bytes, or a header that matches its body (size and digest) over a
    hostile inflated body, or a real snapshot cut or flipped."""
    kind = draw(st.sampled_from(["any", "body", "mutated"]))
    if kind == "any":
        return bytes(draw(hostile_bytes))
    if kind == "body":
        body = zlib.compress(draw(hostile_bytes | deep_json(at_least=2_000)), 1)
        header = SnapshotHeader(kind=KIND, schema=SNAPSHOT_SCHEMA, seq=1, event_id="e", max_ts=None,
                                body_bytes=len(body), body_sha256=hashlib.sha256(body).hexdigest())
        return msgspec.json.encode(header) + b"\n" + body
    _, data = encode_stored(ClusterState())
    out = bytearray(data)
    i = draw(st.integers(0, len(out) - 1))
    out[i] = draw(st.integers(0, 255))
    return bytes(out[:draw(st.integers(0, len(out)))])


@many
@given(hostile_snapshot())
def test_a_stored_snapshot_is_read_or_refused_with_the_reason(data: bytes) -> None:
    got = decode_stored(data)
    assert (isinstance(got, str) and got) or (isinstance(got, tuple) and isinstance(got[1], ClusterState)), got


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
