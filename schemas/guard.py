"""The one check every decoder of untrusted bytes runs before msgspec: size, UTF-8, nesting depth.

msgspec turns malformed JSON into `DecodeError`, but nesting past the interpreter's recursion limit
into `RecursionError` (where that limit falls depends on how deep the caller's stack already is), and
before 0.23 invalid UTF-8 inside a string into `UnicodeDecodeError`. Checked first, the
same bytes are refused the same way by every reader, and a decoder returns a value or a `Refused`.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any, Final, TypeVar

import msgspec

T = TypeVar("T")

# Deeper than anything ndif writes (an event nests 3 levels, a request's payload a few more) and far
# below msgspec's own limit (about the interpreter's 1,000, minus the caller's stack).
MAX_DEPTH: Final = 128

# A JSON string, escapes included (the unrolled form: fast on long strings); what is left outside
# strings holds every bracket that nests.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes a decoder will not use, and why: what a decoder of untrusted bytes returns instead of raising."""

    reason: str


def depth(data: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in `data` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def body_problem(data: object, *, limit: int, max_depth: int = MAX_DEPTH) -> str | None:
    """Why `data` may not be given to msgspec (None: it may): not bytes, over `limit` bytes, not
    UTF-8, or nested deeper than `max_depth`. Costs a few C-level scans; the usual small body with
    few brackets skips the depth scan."""
    if data.__class__ is not bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            return f"not bytes but {type(data).__name__}"
        data = bytes(data)
    if len(data) > limit:
        return f"{len(data)} bytes, over the {limit} byte limit"
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"not UTF-8 (byte {exc.start}: {exc.reason})"
    if data.count(b"[") + data.count(b"{") > max_depth:
        d = depth(data)
        if d > max_depth:
            return f"nested {d} levels deep, over the limit of {max_depth}"
    return None


def decode_guarded(decoder: msgspec.json.Decoder[T], data: object, *, limit: int, what: str,
                   max_depth: int = MAX_DEPTH) -> T | Refused:
    """Decode untrusted bytes: the value, or `Refused` with the reason. Never raises."""
    problem = body_problem(data, limit=limit, max_depth=max_depth)
    if problem is not None:
        return Refused(reason=f"{what} refused: {problem}")
    try:
        return decoder.decode(data)  # type: ignore[arg-type]
    except msgspec.DecodeError as exc:
        return Refused(reason=f"malformed {what}: {exc}")
    except Exception as exc:  # noqa: BLE001 - checked above; anything else msgspec or a hook raises is a refusal too
        return Refused(reason=f"unreadable {what}: {type(exc).__name__}: {exc}")


_any = msgspec.json.Decoder()


def decode_any(data: object, *, limit: int, what: str = "body") -> Any:
    """Untrusted JSON of any shape (e.g. to find an id in a body that did not decode): the value, or
    `Refused`."""
    return decode_guarded(_any, data, limit=limit, what=what)
