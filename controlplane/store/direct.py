"""Reading a stream by batched direct gets: no consumer, so nothing the server would deliver elsewhere.

A consumer's config names its deliver subject in the request body, which subject permissions
cannot see: whoever may create a push consumer can make the server publish a stream's messages on
any subject (another user's status subject, a service's command subject). Read-only roles
(the dashboard, a client reading its own large results) therefore read with direct gets only
(`$JS.API.DIRECT.GET.<stream>`, the stream needs `allow_direct`): the answer always goes to the
asker's own reply inbox.

One request `{"seq": s, "batch": n}` (optionally `"next_by_subj"`) is answered with up to `n`
messages, each with `Nats-Sequence` / `Nats-Subject` headers, then an end-of-batch message
(status 204 `EOB`), or a single status 404 when nothing is at or after `s`.

`api` is the JetStream API prefix of the asking user: `$JS.API` in the system's account,
`$JS.NDIF.API` in an account that imports it (controlplane/store/credentials.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from typing import Any

import msgspec
import nats.errors

from controlplane.store.credentials import JS_API
from schemas.errors import InfrastructureError, InfrastructureTimeout, InvalidCommand, NotFound
from schemas.guard import decode_any

MAX_BATCH = 1000  # messages asked for in one request
MAX_BATCH_BYTES = 4 * 2**20  # and bytes: the server stops a batch there (at least one message comes)


class DirectMsg(msgspec.Struct, frozen=True):
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = msgspec.field(default_factory=dict)


async def _get(nc: Any, api_subject: str, timeout: float, *, absent: str, slow: str) -> Any:
    """One direct get's answer: InfrastructureError (`absent`) when no stream answers,
    InfrastructureTimeout (`slow`) when none answers in time."""
    try:
        return await nc.request(api_subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        raise InfrastructureError(absent) from None
    except nats.errors.TimeoutError:
        raise InfrastructureTimeout(slow) from None


async def last_by_subject(nc: Any, stream: str, subject: str, *, timeout: float = 5.0,
                          api: str = JS_API) -> DirectMsg | None:
    """The last message of `stream` on `subject`, by a direct get that names the subject in the API
    subject (so a permission can be one key); None when there is none."""
    msg = await _get(nc, f"{api}.DIRECT.GET.{stream}.{subject}", timeout,
                     absent=f"no stream {stream} answers direct gets of {subject}",
                     slow=f"direct get of {subject} from {stream} timed out")
    h = dict(msg.headers or {})
    status = h.get("Status")
    if status == "404":
        return None
    if status:
        raise InfrastructureError(f"direct get of {subject} from {stream}: status {status}")
    return DirectMsg(seq=int(h.get("Nats-Sequence", "0") or 0), subject=h.get("Nats-Subject", ""), data=msg.data,
                     headers=h)


class TooManyResults(InfrastructureError):
    """A `multi_last` get matched more subjects than the server answers in one go (status 413)."""


STATUS_LINE = b"NATS/1.0 "  # how the server begins a status message's header block (`NATS/1.0 204 EOB`)
_SEQUENCE = b"\r\nNats-Sequence:"
_SUBJECT = b"\r\nNats-Subject:"
_HEADER_LINE = len(b"NATS/1.0")


def raw_status(headers: bytes | None, data: bytes = b"") -> str | None:
    """The server's inline status in a raw header block (`NATS/1.0 204 EOB`): the three digits after
    exactly `NATS/1.0 `, on a message with no payload and no `Nats-Sequence` (a stored message's
    answer always has one). Anything else is a stored message: a publisher may store a block that
    begins `NATS/1.1 204` or `EVIL/1.0 204`, which the server keeps as it is."""
    if not headers or data or not headers.startswith(STATUS_LINE) or _SEQUENCE in headers:
        return None
    status = headers[_HEADER_LINE + 1:_HEADER_LINE + 4]
    return status.decode("ascii") if len(status) == 3 and status.isdigit() else None


def raw_header(headers: bytes | None, line_start: bytes) -> bytes | None:
    """The value (stripped) of the last header line beginning `line_start` (b"\r\nName:") in a raw
    header block; None when there is none. The last one, as in nats-py's header dict: a direct get's
    answer carries the stored message's own headers, then the server's (Nats-Sequence, Nats-Subject)."""
    if not headers:
        return None
    i = headers.rfind(line_start)
    if i < 0:
        return None
    start = i + len(line_start)
    end = headers.find(b"\r\n", start)
    return headers[start:end if end >= 0 else len(headers)].strip()


async def direct_batch(nc: Any, stream: str, seq: int, batch: int = MAX_BATCH, *, next_by_subj: str | None = None,
                       multi_last: str | None = None, timeout: float = 5.0, api: str = JS_API) -> list[DirectMsg]:
    """Up to `batch` messages of `stream` from `seq` on (of `next_by_subj` only, if given); [] when none.
    `multi_last`: instead, the last message of each subject that matches it (TooManyResults when the
    server will not answer that many at once)."""
    req: dict[str, Any] = {"batch": max(1, min(int(batch), MAX_BATCH)), "max_bytes": MAX_BATCH_BYTES}
    if multi_last:
        req["multi_last"] = [multi_last]
    else:
        req["seq"] = max(int(seq), 1)
    if next_by_subj:
        req["next_by_subj"] = next_by_subj
    out: list[DirectMsg] = []
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_msg(headers: bytes | None, data: bytes) -> None:
        status = raw_status(headers, data)
        if status:
            if not done.done():
                done.set_result(status)
            return
        seq = raw_header(headers, _SEQUENCE)
        try:
            n = int(seq) if seq is not None else 0
        except ValueError:
            return  # not a stream's message: the batch ends short, and the reader asks on from its last
        subject = raw_header(headers, _SUBJECT)
        out.append(DirectMsg(seq=n, subject=subject.decode("utf-8", "replace") if subject is not None else "", data=data))

    inbox = nc.new_inbox()
    # Raw: the answer's messages go from the parser to `on_msg` with no per-message Msg, header
    # dict, queue or coroutine (controlplane/store/eventstore/connection.py, NdifNatsClient).
    sub = await nc.subscribe_raw(inbox, on_msg)
    try:
        await nc.publish(f"{api}.DIRECT.GET.{stream}", msgspec.json.encode(req), reply=inbox)
        try:
            status = await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise InfrastructureTimeout(f"direct get of {stream} from seq {seq} timed out "
                                        f"({len(out)} messages received)") from None
    finally:
        await sub.unsubscribe()
    if status == "413":
        raise TooManyResults(f"direct get of {stream}: too many subjects match {multi_last!r}")
    if status == "503":
        raise InfrastructureError(f"no stream {stream} answers direct gets (missing, or allow_direct off)")
    if status not in ("204", "404"):
        raise InfrastructureError(f"direct get of {stream} from seq {seq}: status {status}")
    return out


async def read_object(nc: Any, bucket: str, name: str, *, timeout: float = 5.0, api: str = JS_API,
                      max_bytes: int | None = None) -> bytes:
    """An Object Store object (nats-py's layout) by direct gets: its meta (the last message on
    `$O.<bucket>.M.<base64url(name)>`), then its chunks (`$O.<bucket>.C.<nuid>`), digest checked.
    An object larger than `max_bytes` is refused (InvalidCommand) before any chunk is read."""
    stream = f"OBJ_{bucket}"
    meta_subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
    msg = await _get(nc, f"{api}.DIRECT.GET.{stream}.{meta_subject}", timeout,
                     absent=f"no bucket {bucket} answers direct gets",
                     slow=f"reading object {name} of {bucket} timed out")
    status = (msg.headers or {}).get("Status")
    if status:
        raise NotFound(f"no object {name} in bucket {bucket} (status {status})")
    info = decode_any(msg.data, limit=64 * 1024, what="object meta")
    if not isinstance(info, dict):
        raise InfrastructureError(f"object {name} of {bucket}: its meta cannot be read ({getattr(info, 'reason', info)!r})")
    if info.get("deleted"):
        raise NotFound(f"object {name} in bucket {bucket} was deleted")
    try:
        chunks, size, nuid = int(info.get("chunks") or 0), int(info.get("size") or 0), str(info.get("nuid") or "")
    except (TypeError, ValueError):
        raise InfrastructureError(f"object {name} of {bucket}: its meta has no chunk count or size") from None
    if max_bytes is not None and size > max_bytes:
        raise InvalidCommand(f"object {name} of {bucket} is {size} bytes, more than {max_bytes} allowed")
    chunk_subject = f"$O.{bucket}.C.{nuid}"
    parts: list[bytes] = []
    seq = 1
    while len(parts) < chunks:
        got = await direct_batch(nc, stream, seq, chunks - len(parts), next_by_subj=chunk_subject, timeout=timeout,
                                 api=api)
        if not got:
            break
        parts.extend(m.data for m in got)
        seq = got[-1].seq + 1
    data = b"".join(parts)
    if len(parts) != chunks or len(data) != size:
        raise InfrastructureError(f"object {name} of {bucket}: {len(parts)}/{chunks} chunks, {len(data)}/{size} bytes")
    digest = str(info.get("digest") or "")
    if digest[:8].upper() == "SHA-256=":
        digest = digest[8:]
    if digest and digest != base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode():
        raise InfrastructureError(f"object {name} of {bucket}: digest mismatch")
    return data


async def object_names(nc: Any, bucket: str, *, timeout: float = 5.0, api: str = JS_API) -> list[str]:
    """The names of the live objects of an Object Store bucket, by direct gets of its meta messages
    (one per object: nats-py rolls each object's meta up to its last).

    First by one `multi_last` get (the last message of each meta subject, found by the stream's
    subject index): a scan with `next_by_subj` walks the chunks between the metas, so its cost grew
    with the bytes stored (200 snapshots of 300 KB: ~15-35 ms against ~4). If the server will not
    answer that many subjects at once, by the scan."""
    stream, meta = f"OBJ_{bucket}", f"$O.{bucket}.M.>"
    try:
        got = await direct_batch(nc, stream, 1, MAX_BATCH, multi_last=meta, timeout=timeout, api=api)
    except TooManyResults:
        pass
    else:
        if len(got) < MAX_BATCH:
            return _live_names(got)
    names: list[str] = []
    seq = 1
    while True:
        got = await direct_batch(nc, stream, seq, MAX_BATCH, next_by_subj=meta, timeout=timeout, api=api)
        names.extend(_live_names(got))
        if len(got) < MAX_BATCH:
            return names
        seq = got[-1].seq + 1


def _live_names(metas: list[DirectMsg]) -> list[str]:
    """The names the meta messages give, less the deleted objects' and what cannot be read."""
    names: list[str] = []
    for m in metas:
        info = decode_any(m.data, limit=64 * 1024, what="object meta")  # Refused: not an object we can read
        if isinstance(info, dict) and isinstance(info.get("name"), str) and not info.get("deleted"):
            names.append(info["name"])
    return names
