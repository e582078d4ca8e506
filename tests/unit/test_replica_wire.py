"""The replica call's wire (dataplane/replica/wire.py): every message kind round-trips, through msgpack
(the NATS endpoint) and pickle (Ray), and bytes that are not a reply are refused with typed
refusals, never raised (tests/unit/test_untrusted_bytes.py gives them hostile bytes)."""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.replica.wire import (
    Answers,
    Call,
    Completed,
    Failed,
    NotRun,
    Parked,
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
)
from schemas.guard import Refused

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
seconds = st.floats(0, 1e6, allow_nan=False)
answers = st.one_of(
    st.builds(Completed, result=json_values, seconds=seconds),
    st.builds(Failed, error=st.text(max_size=30), message=st.text(max_size=200), seconds=seconds),
    st.builds(NotRun, reason=st.text(max_size=100)),
)
payloads = st.lists(st.dictionaries(st.text(max_size=8), json_values, max_size=4), max_size=8)


def test_every_kind_of_answer_round_trips_in_one_reply() -> None:
    sent = Answers(answers=[Completed(result={"next_token_ids": [1, 2]}, seconds=0.25),
                            Failed(error="BadRequest", message="unknown op 'nope'", seconds=0.001),
                            NotRun(reason="replica 0 of m is WARM, not HOT")])
    got = decode_reply(encode_reply(sent))
    assert got == sent and [type(a) for a in got.answers] == [Completed, Failed, NotRun]  # type: ignore[union-attr]
    assert decode_reply(encode_reply(Parked())) == Parked()


def test_the_tags_are_explicit_strings_on_the_wire() -> None:
    """Renaming a class must not change what is on the wire (the tag is what is read back)."""
    assert msgspec.msgpack.decode(encode_reply(Parked())) == ["parked"]
    body = msgspec.msgpack.decode(encode_reply(Answers(answers=[Completed(result=1, seconds=0.5),
                                                                Failed(error="E", message="m", seconds=1.0),
                                                                NotRun(reason="r")])))
    assert body == ["answers", [["completed", 1, 0.5], ["failed", "E", "m", 1.0], ["not_run", "r"]]]


@settings(max_examples=60, deadline=None)
@given(st.lists(answers, max_size=8))
def test_answers_round_trip_through_msgpack_and_pickle(sent: list[Any]) -> None:
    reply = Answers(answers=sent)
    assert decode_reply(encode_reply(reply)) == reply  # the NATS endpoint's way
    assert pickle.loads(pickle.dumps(sent)) == sent  # Ray's way (run_batch, take_answer)


@settings(max_examples=40, deadline=None)
@given(payloads)
def test_a_call_round_trips(sent: list[dict[str, Any]]) -> None:
    assert decode_call(encode_call(sent)) == Call(payloads=sent)
    users = [f"user{i}" for i in range(len(sent))]
    assert decode_call(encode_call(sent, users)) == Call(payloads=sent, users=users)


def test_a_call_from_an_older_dispatcher_without_users_still_decodes() -> None:
    old = msgspec.msgpack.encode([[{"op": "echo", "data": 1}]])  # the Call of before `users`
    assert decode_call(old) == Call(payloads=[{"op": "echo", "data": 1}], users=[])


def test_a_reply_with_a_result_msgpack_cannot_carry_does_not_encode() -> None:
    """The endpoint parks such answers (taken through Ray, which pickles them)."""
    with pytest.raises((TypeError, msgspec.EncodeError)):
        encode_reply(Answers(answers=[Completed(result=object(), seconds=0.0)]))


@pytest.mark.parametrize("body", [
    b"", b"\xc1", b"\x92\x00\x90", msgspec.msgpack.encode(["answers", [["completed", 1]]]),
    msgspec.msgpack.encode(["nope", []]), msgspec.msgpack.encode([0, [[0, {"x": 1}, 0.1]]]),
    msgspec.msgpack.encode(["answers", [["not_run", 3]]]), msgspec.msgpack.encode({"answers": []}),
])
def test_bytes_that_are_not_a_reply_are_refused_with_the_reason(body: bytes) -> None:
    got = decode_reply(body)  # the link's `ReplyLost` (dataplane/serving/link.py)
    assert isinstance(got, Refused) and got.reason.startswith("malformed replica answer"), got


def test_a_call_that_is_not_a_list_of_payloads_is_refused() -> None:
    for body in (msgspec.msgpack.encode([[1, 2]]), msgspec.msgpack.encode([{"a": 1}]), b"\x90"):
        got = decode_call(body)
        assert isinstance(got, Refused) and "replica call" in got.reason, got
    # what msgspec raises past DecodeError (RecursionError; UnicodeDecodeError before 0.23) is refused too
    nested, bad_utf8 = b"\x91\x91\x81\xa1a" + b"\x91" * 100_000 + b"\x01", b"\x91\x91\x81\xa1a\xa1\xff"
    got = decode_call(nested)
    assert isinstance(got, Refused) and got.reason.startswith("unreadable replica call: RecursionError"), got
    got = decode_call(bad_utf8)
    assert isinstance(got, Refused) and got.reason.startswith("malformed replica call: "), got
    assert "utf-8" in got.reason.lower(), got
