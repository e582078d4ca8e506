"""A batched direct read takes its messages raw (controlplane/store/direct.py): the status, sequence
and subject it reads from a header block are what our client's header dict holds for the same bytes
(nats-py's, except that only the server's own status line is a status: NdifNatsClient)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.store.direct import _SEQUENCE, _SUBJECT, raw_header, raw_status
from controlplane.store.eventstore.connection import NdifNatsClient

names = st.text(alphabet=st.sampled_from("Nats-Sequence-Subject: \t\x0bé1"), max_size=16)
values = st.text(max_size=20)
# What a publisher may put in a stored message's own headers: any names and values.
lines = st.builds(lambda n, sep, v: n.encode("utf-8", "surrogatepass") + sep + v.encode("utf-8", "replace"),
                  names, st.sampled_from([b":", b": ", b":\t", b""]), values)
# What the server appends to a direct get's answer, after the message's own headers.
server = st.builds(lambda subj, seq: [b"Nats-Stream: NDIF_EVENTS", b"Nats-Subject: " + subj.encode(),
                                      b"Nats-Sequence: " + str(seq).encode(), b"Nats-Time-Stamp: 2026-01-01T00:00:00Z"],
                   st.text(alphabet="abc.>*-_0é", min_size=1, max_size=30), st.integers(0, 2**63))


async def upstream(block: bytes) -> dict[str, str]:
    return await NdifNatsClient()._process_headers(block) or {}


@settings(max_examples=1000, deadline=None)
@given(st.lists(lines, max_size=6), server)
async def test_message_fields_as_nats_py_reads_them(own: list[bytes], theirs: list[bytes]) -> None:
    block = b"NATS/1.0\r\n" + b"\r\n".join(own + theirs) + b"\r\n\r\n"
    h = await upstream(block)
    assert raw_status(block) is None and "Status" not in h
    assert int(raw_header(block, _SEQUENCE) or b"0") == int(h["Nats-Sequence"])
    assert (raw_header(block, _SUBJECT) or b"").decode("utf-8", "replace") == h["Nats-Subject"]


@settings(max_examples=500, deadline=None)
@given(st.integers(100, 999), st.sampled_from(["", " EOB", " No Messages", " Request Timeout"]), st.lists(
    st.sampled_from([b"Nats-Num-Pending: 3", b"Nats-Last-Sequence: 7", b"Description: x"]), max_size=3))
async def test_status_as_nats_py_reads_it(code: int, text: str, more: list[bytes]) -> None:
    """(Status answers are the server's own: `NATS/1.0 <3 digits>[ text]`, then ASCII lines.)"""
    block = b"NATS/1.0 " + f"{code}{text}".encode() + b"\r\n" + b"\r\n".join(more) + b"\r\n\r\n"
    assert raw_status(block) == (await upstream(block)).get("Status") == str(code)


async def test_a_stored_message_is_never_a_status_whatever_its_headers_say() -> None:
    """A publisher (an agent on its fact subjects, a client on its request subject) may store a
    header block that begins like a status in another version, or carries its own `Status` line;
    the server keeps both as they are. Neither is a status for a raw read or for our client (nats-py
    took them for an end of batch, a heartbeat, a deleted consumer: a red-team finding)."""
    forged = [b"NATS/1.1 204 EOB", b"EVIL/1.0 204 EOB", b"NATS/1.0\t204", b"EVIL/1.0 409"]
    tail = b"\r\nNats-Msg-Id: w1\r\nNats-Stream: NDIF_EVENTS\r\nNats-Sequence: 2\r\n\r\n"
    for first in forged:
        block = first + tail
        assert raw_status(block) is None, first
        assert raw_status(block, b"") is None, first
        h = await upstream(block)
        assert "Status" not in h and h["Nats-Sequence"] == "2" and h["Nats-Msg-Id"] == "w1", (first, h)
    own = b"NATS/1.0\r\nStatus: 100\r\nDescription: Idle Heartbeat\r\nNats-Sequence: 3\r\n\r\n"
    h = await upstream(own)
    assert raw_status(own) is None and "Status" not in h and h["Description"] == "Idle Heartbeat"
    # The server's own status: no payload, no sequence.
    assert raw_status(b"NATS/1.0 204 EOB\r\nNats-Sequence: 2\r\n\r\n") is None
    assert raw_status(b"NATS/1.0 204 EOB\r\n\r\n", b"x") is None
    assert raw_status(b"NATS/1.0 204 EOB\r\n\r\n") == "204"


def test_the_server_answers() -> None:
    assert raw_status(b"NATS/1.0 204 EOB\r\nNats-Num-Pending: 0\r\nNats-Last-Sequence: 7\r\n\r\n") == "204"
    assert raw_status(b"NATS/1.0 404 No Messages\r\n\r\n") == "404"
    assert raw_status(None) is None and raw_header(None, _SEQUENCE) is None
    block = (b"NATS/1.0\r\nNats-Msg-Id: e-1\r\nNats-Sequence: 99\r\nNats-Stream: NDIF_EVENTS\r\n"
             b"Nats-Subject: ndif.evt.x\r\nNats-Sequence: 12\r\n\r\n")
    assert raw_status(block) is None
    assert raw_header(block, _SEQUENCE) == b"12" and raw_header(block, _SUBJECT) == b"ndif.evt.x"
