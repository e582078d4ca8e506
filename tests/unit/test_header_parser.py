"""Our faster header parser returns exactly what nats-py's does, for any header block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from controlplane.store.eventstore import NdifNatsClient

names = st.text(alphabet=st.sampled_from("Ab-_: \t\x0bé1\x1c\x85"), max_size=12)
values = st.text(max_size=20)
lines = st.builds(lambda n, sep, v: n.encode("utf-8", "surrogatepass") + sep + v.encode("utf-8", "replace"),
                  names, st.sampled_from([b":", b": ", b":\t", b""]), values)
blocks = st.lists(st.one_of(lines, st.binary(max_size=30)), max_size=8).map(lambda ls: b"\r\n".join(ls))


@settings(max_examples=2000, deadline=None)
@given(blocks)
def test_same_as_nats_py(raw):
    assert NdifNatsClient._parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_event_headers():
    raw = b"Nats-Msg-Id: abc\r\nNdif-Event: ReplicaLoaded\r\nNdif-Schema: 1\r\n\r\n"
    assert NdifNatsClient._parse_header_lines(raw) == {"Nats-Msg-Id": "abc", "Ndif-Event": "ReplicaLoaded",
                                                         "Ndif-Schema": "1"}
