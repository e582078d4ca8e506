"""Stored snapshots of the cluster fold: a header line (what the snapshot covers), then the body.

The header names the sequence the snapshot covers, the id of the stored event at that sequence,
the schema of the body (`ClusterSnapshot` JSON, SNAPSHOT_SCHEMA, zlib-compressed: about a fifth of
its size, ~25 ms for a 2 MB fold) and the latest event time folded; the
object's name repeats kind, schema, sequence and time so a reader picks one without loading any.
A reader uses a snapshot only if its schema is this version's and its sequence and event id match
the log (controlplane/store/snapshots.py checks the log). Decoding never raises: bytes that are not
a readable snapshot of this schema come back as the reason, in words.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import msgspec

from controlplane.core.projections.cluster import SNAPSHOT_SCHEMA, ClusterSnapshot, ClusterState

KIND = "cluster"
MAX_SNAPSHOT_BYTES = 512 * 2**20  # a larger object is not read (a cluster's fold is a few MB)
_MAX_HEADER_BYTES = 4096
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_NAME = re.compile(r"^([a-z]+)\.v(\d{1,6})\.(\d{12,20})\.t(-|\d{1,20})$")


class SnapshotHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a stored snapshot covers, and the size and digest of its body."""

    kind: str
    schema: int
    seq: int  # the last stored sequence folded
    event_id: str  # of the stored event at `seq` ("" when it was unreadable)
    max_ts: datetime | None = None  # the latest event time folded up to `seq`
    encoding: str = "zlib"  # of the body as stored
    body_bytes: int  # as stored
    body_sha256: str  # of the body as stored


class SnapshotName(NamedTuple):
    """A stored snapshot's name, read: what a reader chooses by before loading anything."""

    name: str
    kind: str
    schema: int
    seq: int
    max_ts_us: int | None  # the header's max_ts in microseconds since the epoch (None: no event yet)


def micros(t: datetime) -> int:
    """Microseconds since the epoch, exactly (a time without a zone is taken as UTC)."""
    aware = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
    return (aware - _EPOCH) // _US


def snapshot_name(h: SnapshotHeader) -> str:
    ts = "-" if h.max_ts is None else str(micros(h.max_ts))
    return f"{h.kind}.v{h.schema}.{h.seq:012d}.t{ts}"


def parse_name(name: str) -> SnapshotName | None:
    """The parts of a snapshot's name, or None for a name that is not one."""
    m = _NAME.match(name)
    if m is None:
        return None
    kind, schema, seq, ts = m.groups()
    return SnapshotName(name=name, kind=kind, schema=int(schema), seq=int(seq),
                        max_ts_us=None if ts == "-" else int(ts))


_header_encoder = msgspec.json.Encoder()
_header_decoder = msgspec.json.Decoder(SnapshotHeader)
_body_encoder = msgspec.json.Encoder()
_body_decoder = msgspec.json.Decoder(ClusterSnapshot)


def encode_stored(state: ClusterState) -> tuple[SnapshotHeader, bytes]:
    """The state as a stored snapshot: (its header, the bytes to store under `snapshot_name(header)`)."""
    body = zlib.compress(_body_encoder.encode(state.to_snapshot()), 1)
    header = SnapshotHeader(kind=KIND, schema=SNAPSHOT_SCHEMA, seq=state.seq, event_id=state.last_event_id,
                            max_ts=state.max_ts, body_bytes=len(body), body_sha256=hashlib.sha256(body).hexdigest())
    return header, _header_encoder.encode(header) + b"\n" + body


def read_header(data: bytes) -> SnapshotHeader | str:
    """The header of stored snapshot bytes, or why there is none."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        return f"{len(data)} bytes, more than a snapshot may be ({MAX_SNAPSHOT_BYTES})"
    end = data.find(b"\n", 0, _MAX_HEADER_BYTES)
    if end < 0:
        return "no header line"
    try:
        return _header_decoder.decode(data[:end])
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        return f"unreadable header ({type(exc).__name__})"


def decode_stored(data: bytes) -> tuple[SnapshotHeader, ClusterState] | str:
    """The header and the state of stored snapshot bytes, or why they cannot be used (never raises)."""
    h = read_header(data)
    if isinstance(h, str):
        return h
    if h.kind != KIND:
        return f"a snapshot of {h.kind!r}, not of {KIND!r}"
    if h.schema != SNAPSHOT_SCHEMA:
        return f"schema {h.schema}; this version reads schema {SNAPSHOT_SCHEMA}"
    body = data[data.find(b"\n") + 1:]
    if len(body) != h.body_bytes or hashlib.sha256(body).hexdigest() != h.body_sha256:
        return f"corrupt: its body ({len(body)} bytes) does not match its header's size and digest"
    if h.encoding != "zlib":
        return f"its body is in {h.encoding[:40]!r}; this version reads zlib"
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(body, MAX_SNAPSHOT_BYTES)
    except zlib.error as exc:
        return f"its body does not inflate ({exc})"
    if inflate.unconsumed_tail or not inflate.eof:
        return f"its body inflates past {MAX_SNAPSHOT_BYTES} bytes, or is cut short"
    try:
        snap = _body_decoder.decode(raw)
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        return f"unreadable body ({type(exc).__name__})"
    if snap.schema != h.schema or snap.seq != h.seq or snap.last_event_id != h.event_id:
        return "its body and header disagree (schema, seq or event id)"
    try:
        state = ClusterState.from_snapshot(snap)
    except Exception as exc:  # noqa: BLE001 - well-formed but impossible data: refused, never raised
        return f"its body does not load ({type(exc).__name__}: {exc})"
    return h, state
