"""The event codec's model keys: structured on the wire, the canonical string in Python, old bodies still read."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import events as E
from schemas.errors import InvalidCommand
from schemas.events import ModelRef, Skipped, decode_event, decode_or_skip, encode_event, model_ref, ref_key
from schemas.keys import check_repo_id
from schemas.status import EvictionReason, Level

GPT2 = 'nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}'
PINNED = 'nnsight.modeling.language.LanguageModel:{"repo_id": "meta-llama/Llama-3.1-8B", "revision": "main"}'
T0 = datetime(2026, 1, 1, tzinfo=UTC)
_plain = msgspec.json.Encoder()  # what the store wrote before model keys were structured


def loaded(key: str, **kw: object) -> E.ReplicaLoaded:
    return E.ReplicaLoaded(event_id="e1", ts=T0, actor="agent:a", model_key=key, replica_id=2, node_id="a", **kw)


def test_a_canonical_key_is_stored_as_fields_and_read_back_as_the_string():
    body = encode_event(loaded(PINNED))
    wire = json.loads(body)
    assert wire["model_key"] == {"repo_id": "meta-llama/Llama-3.1-8B", "revision": "main"}
    back = decode_event(body)
    assert back == loaded(PINNED) and type(back.model_key) is str and back.model_key == PINNED


def test_a_null_revision_and_the_default_class_are_left_out_and_the_body_is_smaller():
    body = encode_event(loaded(GPT2))
    assert json.loads(body)["model_key"] == {"repo_id": "openai-community/gpt2"}
    assert len(body) < len(_plain.encode(loaded(GPT2))) - 60
    assert decode_event(body).model_key == GPT2
    other = GPT2.replace("nnsight.modeling.language.LanguageModel", "pkg.vision.VisionModel")
    wire = json.loads(encode_event(loaded(other)))["model_key"]
    assert wire == {"class": "pkg.vision.VisionModel", "repo_id": "openai-community/gpt2"}
    assert decode_event(encode_event(loaded(other))).model_key == other


def test_the_wire_default_class_is_frozen():
    """A stored ref without "class" means this class forever (changing it would change stored events' model)."""
    assert E.WIRE_DEFAULT_CLASS == "nnsight.modeling.language.LanguageModel"
    body = b'{"type":"ReplicaLoaded","event_id":"e1","ts":"2026-01-01T00:00:00Z","actor":"agent:a",' \
           b'"model_key":{"repo_id":"openai-community/gpt2"},"replica_id":2,"node_id":"a"}'
    assert decode_event(body) == loaded(GPT2)
    assert decode_event(body.replace(b'{"repo_id"', b'{"class":"nnsight.modeling.language.LanguageModel",'
                                                    b'"repo_id"')) == loaded(GPT2)


def test_old_string_bodies_decode_to_the_same_event():
    for key in (GPT2, PINNED):
        old, new = _plain.encode(loaded(key)), encode_event(loaded(key))
        assert b'"model_key":"nnsight' in old and old != new
        assert decode_event(old) == decode_event(new) == loaded(key)


@pytest.mark.parametrize("key", [
    "m",  # tests and hand-made logs use short strings
    'nnsight.modeling.language.LanguageModel:{"repo_id": "gpt2", "revision": null, "dispatch": true}',  # more kwargs
    'nnsight.modeling.language.LanguageModel:{"revision": null, "repo_id": "gpt2"}',  # not in canonical order
    'nnsight.modeling.language.LanguageModel:{"repo_id":"gpt2","revision":null}',  # not canonical spacing
    'C:{"revision": null}',  # no repo_id
    'C:{"repo_id": "gpt2", "revision": 5}',  # a revision that is not a string
    'C:{"repo_id": 7, "revision": null}',  # a repo_id that is not a string
    'C:{not json}',
])
def test_keys_that_are_not_plain_canonical_stay_strings_and_round_trip_exactly(key):
    assert model_ref(key) is None
    body = encode_event(loaded(key))
    assert json.loads(body)["model_key"] == key
    assert decode_event(body).model_key == key


def test_the_pressure_evictions_by_model_key_is_structured_too():
    ev = E.ReplicaEvictionRequested(event_id="e", ts=T0, actor="controller", model_key=GPT2, replica_id=0,
                                    reason=EvictionReason.PRESSURE, target=Level.WARM, by_model_key=PINNED,
                                    by_replica_id=4)
    wire = json.loads(encode_event(ev))
    assert wire["model_key"]["repo_id"] == "openai-community/gpt2"
    assert wire["by_model_key"]["revision"] == "main"
    assert decode_event(encode_event(ev)) == ev
    odd = msgspec.structs.replace(ev, model_key="m")  # one key structured, the other a string
    assert json.loads(encode_event(odd))["model_key"] == "m" and decode_event(encode_event(odd)) == odd


def test_events_without_a_model_have_null():
    ev = E.NodeLost(event_id="n", ts=T0, actor="controller", node_id="a")
    assert json.loads(encode_event(ev))["model_key"] is None and decode_event(encode_event(ev)) == ev


@pytest.mark.parametrize("bad", [
    {"class": "C"},  # no repo
    {"class": "C", "repo_id": ""},  # empty repo
    {"class": "C", "repo_id": "gpt2", "kwargs": {"x": 1}},  # a field this version does not know
    {"class": "C", "repo_id": 3},
    {"class": "C", "repo_id": "gpt2", "revision": 7},
    ["C", "gpt2"],
    17,
])
def test_a_malformed_structured_key_is_skipped_with_a_reason(bad):
    body = json.loads(encode_event(loaded(GPT2)))
    body["model_key"] = bad
    out = decode_or_skip(json.dumps(body).encode())
    assert isinstance(out, Skipped) and out.type == "ReplicaLoaded" and "model_key" in out.reason


def test_a_seen_ref_with_an_unknown_field_is_still_refused():
    """The decoder's cache of known refs must not let an extra field through."""
    decode_event(encode_event(loaded(GPT2)))  # GPT2's ref is now cached
    body = json.loads(encode_event(loaded(GPT2)))
    body["model_key"]["extra"] = 1
    assert isinstance(decode_or_skip(json.dumps(body).encode()), Skipped)


def test_model_ref_fields():
    ref = model_ref(PINNED)
    assert ref == ModelRef(cls="nnsight.modeling.language.LanguageModel", repo_id="meta-llama/Llama-3.1-8B",
                           revision="main")
    assert ref is not None and ref.model_key == PINNED


def _valid_repo(r: str) -> bool:
    try:
        check_repo_id(r)
    except InvalidCommand:
        return False
    return True


_repo = st.from_regex(r"[A-Za-z0-9_.-]{1,12}(/[A-Za-z0-9_.-]{1,12})?", fullmatch=True).filter(
    lambda r: r not in (".", "..") and not r.startswith(".") and _valid_repo(r))
_rev = st.none() | st.text(min_size=1, max_size=12)


@given(repo=_repo | st.from_regex(r"/[a-z0-9_/-]{1,20}", fullmatch=True), rev=_rev,
       cls=st.sampled_from(["nnsight.modeling.language.LanguageModel", "pkg.mod.Other"]))
def test_any_canonical_key_round_trips_through_the_fields(repo, rev, cls):
    # Built as the codec spells keys: a log may hold a class or a revision that input no longer takes.
    key = ref_key(cls, repo, rev)
    ev = loaded(key)
    body = encode_event(ev)
    assert decode_event(body) == ev == decode_event(_plain.encode(ev))
    if model_ref(key) is not None:
        assert json.loads(body)["model_key"]["repo_id"] == json.loads(key.partition(":")[2])["repo_id"]


@given(st.text(max_size=60))
def test_any_string_key_round_trips(key):
    ev = loaded(key)
    assert decode_event(encode_event(ev)).model_key == key
