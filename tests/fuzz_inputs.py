"""The fuzz inputs of every command and request field, published raw: one set of strategies for the
live server's test (tests/integration/test_fuzz_boundaries.py, the wiring) and the in-memory ports'
(tests/unit/test_fuzz_boundaries_memlog.py, the rule at full strength)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
from hypothesis import strategies as st

from schemas.commands import VERBS
from schemas.keys import canonical_model_key
from schemas.requests import check_request_id
from schemas.subjects import model_token

KNOWN = "acme/fuzz-known"
BYSTANDER = "acme/fuzz-bystander"  # the model of the command sent meanwhile: no fuzz input names it
ANSWER_S = 1.0  # another command is answered within this while an input is handled

ints = st.one_of(st.integers(-3, 12), st.integers(-(2**70), 2**70), st.text(max_size=4), st.none(), st.floats())
texts = st.one_of(st.text(max_size=24), st.sampled_from(["a--b", "c..d", "x" * 97, "a/b/c", "foo.git", "", " ",
                                                         'Cls:{"repo_id": 1}', "gpt2@", "./nope-ckpt"]))
models = st.one_of(st.just(KNOWN), texts)
command_fields = {
    "command_id": st.one_of(st.uuids().map(lambda u: u.hex), st.text(max_size=12)),
    "actor": st.one_of(st.just("fuzz"), st.text(max_size=8)),
    "model_key": models,
    # Replica counts stay small here: their bounds (10^9 replicas) are tests/integration/test_cli_outcomes.py's.
    "replicas": st.one_of(st.integers(-3, 16), st.text(max_size=3), st.none()),
    "replica_id": ints, "all": st.one_of(st.booleans(), ints), "cold": st.booleans(), "scale_up": st.booleans(),
    "dedicated": st.booleans(), "size_bytes": ints, "junk": texts,
}
command_bodies = st.one_of(
    st.fixed_dictionaries({"verb": st.one_of(st.sampled_from(VERBS), st.text(max_size=8))},
                          optional=command_fields).map(msgspec.json.encode),
    st.binary(max_size=40),
)
subject_verbs = st.one_of(st.none(), st.sampled_from([*VERBS, "junk", "x-y"]))

request_fields = {
    "request_id": st.one_of(st.uuids().map(lambda u: u.hex), st.text(max_size=10), ints),
    "model_key": st.one_of(texts, ints, st.sampled_from(["nobody/fuzz-a", "nobody/fuzz-b"])),
    "payload": st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3), ints, texts),
    "submitted_at": st.one_of(st.just(datetime.now(UTC).isoformat()), texts),
    "client": texts,
}
request_bodies = st.one_of(st.fixed_dictionaries({}, optional=request_fields).map(msgspec.json.encode),
                           st.binary(max_size=40))
header_ids = st.one_of(st.none(), st.uuids().map(lambda u: u.hex), st.sampled_from(["bad id", "a.b", "x" * 200]))


def command_subject_verb(body: bytes, verb: str | None) -> str:
    """The verb of the subject a fuzzed command is sent on: `verb`, else the body's, else "deploy";
    one not fit for a subject is "junk"."""
    try:
        sent_verb = verb or str(msgspec.json.decode(body).get("verb"))
    except Exception:  # noqa: BLE001 - not an object: any verb
        sent_verb = "deploy"
    return sent_verb if sent_verb and all(c.isalnum() or c in "-_" for c in sent_verb) else "junk"


def body_id_and_model(body: bytes) -> tuple[Any, Any]:
    """The request id and model key a fuzzed request body names, if it is a JSON object."""
    try:
        decoded = msgspec.json.decode(body)
    except Exception:  # noqa: BLE001 - not JSON
        return None, None
    if not isinstance(decoded, dict):
        return None, None
    return decoded.get("request_id"), decoded.get("model_key")


@dataclass(frozen=True)
class Published:
    """How a fuzzed request body is published: its subject, its headers, the id it names in the body
    and the one its status is kept under (None: no valid id anywhere)."""

    subject: str
    headers: dict[str, str] | None
    body_id: Any
    keyed: str | None


def published(body: bytes, header_id: str | None, on_own_subject: bool) -> Published:
    """On its model's subject when asked and the body names a model key, else on a fresh junk name."""
    rid, mk = body_id_and_model(body)
    try:
        subject = f"ndif.req.{model_token(canonical_model_key(mk))}" if on_own_subject and isinstance(mk, str) \
            else f"ndif.req.fuzz-{uuid.uuid4().hex[:10]}"
    except Exception:  # noqa: BLE001 - not a model key
        subject = f"ndif.req.fuzz-{uuid.uuid4().hex[:10]}"
    keyed = next((i for i in (rid, header_id) if valid_request_id(i)), None)
    return Published(subject, {"Nats-Msg-Id": header_id} if header_id is not None else None, rid, keyed)


def valid_request_id(rid: Any) -> bool:
    try:
        check_request_id(rid)
    except Exception:  # noqa: BLE001
        return False
    return True
