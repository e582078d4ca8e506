"""What the fact gate keeps, on REFUSED_STREAM, about an observed fact it kept out of the log.

Written by the controller's gate (controlplane/service/factgate.py) on `ndif.refused.<source token>`,
read by the operator (`ndif status`, `nats stream view NDIF_REFUSED`) and by the source whose append
waits for its fact (it ends refused, with the reason, instead of waiting on).
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from schemas.errors import InvalidCommand

# The most of a refused fact's reason kept (a reason names a field or a bound, never the body).
MAX_REASON_CHARS = 500


class FactRefusal(msgspec.Struct, frozen=True, kw_only=True):
    facts_seq: int  # where the fact is in NDIF_FACTS (kept there until its age runs out)
    subject: str  # the subject it was sent on
    source: str  # the subject's source token (a node's token, or `dispatcher`)
    reason: str
    size: int  # its body's bytes
    ts: datetime


class FactRefused(InvalidCommand):
    """The gate refused this observed fact: it is not in the log, and sending it again changes nothing."""


encode_refusal = msgspec.json.Encoder().encode
decode_refusal = msgspec.json.Decoder(FactRefusal).decode
