"""The request dedup id (`auth.request_msg_id`): the owner's resend keeps it, no one else can form it,
the dispatcher still reads the request id from its last token, and one that does not name the user
of its subject and its request is refused (`msg_id_problem`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.ops.auth import make_creds
from controlplane.store.credentials import msg_id_problem, request_msg_id
from schemas.requests import check_request_id

ids = st.from_regex(r"[A-Za-z0-9_-]{1,128}", fullmatch=True)
alice = make_creds("client", name="alice")
bob = make_creds("client", name="bob")


@given(ids)
def test_the_owner_gets_the_same_id_and_the_request_id_is_its_last_token(rid: str) -> None:
    check_request_id(rid)
    mid = request_msg_id(rid, bob)
    assert mid == request_msg_id(rid, bob)  # a resend is deduplicated
    assert mid.startswith("bob.") and mid.rsplit(".", 1)[-1] == rid  # what the dispatcher's triage reads


@given(ids)
def test_no_other_user_forms_it(rid: str) -> None:
    mid = request_msg_id(rid, bob)
    assert mid not in {request_msg_id(rid, alice), f"bob.{rid}", rid}
    # The same name with another password (credentials made again) is another id too.
    assert mid != request_msg_id(rid, make_creds("client", name="bob"))


def test_an_open_server_keeps_the_plain_id() -> None:
    assert request_msg_id("r1", None) == "r1"
    assert request_msg_id("r1", make_creds("admin")) == "r1"


@given(ids)
def test_the_sdks_id_names_its_user_and_request(rid: str) -> None:
    assert msg_id_problem(request_msg_id(rid, bob), user="bob", request_id=rid) is None
    assert msg_id_problem("", user="bob", request_id=rid) is None  # no dedup id: nothing taken from anyone
    assert msg_id_problem(rid, user="", request_id=rid) is None  # an open server


@given(ids, ids)
def test_a_dedup_id_naming_another_user_or_request_is_refused(rid: str, other: str) -> None:
    """The dispatcher ends such a request ERROR (dataplane/serving/dispatcher/intake.py)."""
    on_alices_subject = request_msg_id(rid, bob)  # stored by alice under an id that names bob
    assert msg_id_problem(on_alices_subject, user="alice", request_id=rid) is not None
    for bad in (rid, f"alice.{rid}", f"alice.x.y.{rid}", f"alice.{'0' * 32}.{rid}x"):
        assert msg_id_problem(bad, user="alice", request_id=rid) is not None, bad
    if other != rid:
        assert msg_id_problem(request_msg_id(other, alice), user="alice", request_id=rid) is not None
