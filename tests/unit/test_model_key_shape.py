"""`model_key` has one shape on the wire: an object `{"repo_id": ..., "revision": ...}` (`class` when not
the default) in events, statuses and requests alike; bodies stored in the older string form still
decode to the same key."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from schemas.events import ModelRegistered, encode_event
from schemas.keys import canonical_model_key
from schemas.requests import (
    Request,
    StatusUpdate,
    decode_request,
    decode_status,
    encode_request,
    encode_status,
    encoder,
)
from schemas.status import RequestStatus

KEY = canonical_model_key("openai-community/gpt2")
ODD = 'some.Class:{"repo_id": "x", "revision": null, "dtype": "bf16"}'  # not canonical-with-fields: stays a string
TS = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_status_carries_the_model_key_as_an_event_does() -> None:
    event = json.loads(encode_event(ModelRegistered(event_id="e", ts=TS, actor="cli:x", model_key=KEY, checkpoint="c", size_bytes=1)))
    u = StatusUpdate(request_id="r", status=RequestStatus.QUEUED, ts=TS, model_key=KEY, queue_position=0)
    body = json.loads(encode_status(u))
    assert body["model_key"] == event["model_key"] == {"repo_id": "openai-community/gpt2"}
    assert decode_status(encode_status(u)) == u


def test_a_request_carries_it_so_too() -> None:
    req = Request(request_id="r", model_key=KEY, payload={"op": "echo"}, submitted_at=TS)
    assert json.loads(encode_request(req))["model_key"] == {"repo_id": "openai-community/gpt2"}
    assert decode_request(encode_request(req)) == req


def test_statuses_and_requests_in_the_old_string_form_still_decode() -> None:
    u = StatusUpdate(request_id="r", status=RequestStatus.COMPLETED, ts=TS, model_key=KEY)
    old = encoder.encode(u)
    assert b'"model_key":"nnsight' in old
    assert decode_status(old) == u
    req = Request(request_id="r", model_key=KEY, payload={}, submitted_at=TS)
    assert decode_request(encoder.encode(req)) == req


def test_keys_without_fields_and_no_key_round_trip() -> None:
    for key in (ODD, "m", ""):
        u = StatusUpdate(request_id="r", status=RequestStatus.ERROR, ts=TS, model_key=key)
        assert decode_status(encode_status(u)) == u
    assert "model_key" not in json.loads(encode_status(StatusUpdate(request_id="r", status=RequestStatus.ERROR, ts=TS)))


def test_a_status_with_a_malformed_key_object_is_refused_not_raised() -> None:
    body = b'{"request_id":"r","status":"QUEUED","ts":"2026-01-01T00:00:00Z","model_key":{"repo_id":"x","evil":1}}'
    assert decode_status(body).__class__.__name__ == "Refused"
