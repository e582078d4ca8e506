"""The JetStream adapter of the `EventLog` and `SnapshotStore` ports (controlplane/ports.py).

Every name the single module `controlplane/eventstore.py` had is importable from here.
"""

from controlplane.eventstore.log import (
    CLOSE_TIMEOUT_S,
    DIRECT_READ_ROLES,
    DUPLICATE_WINDOW_S,
    ERR_BATCH_DUPLICATE,
    ERR_BATCH_TOO_LARGE,
    ERR_WRONG_LAST_SEQ,
    EVENT_MAX_MSG_BYTES,
    HEARTBEAT_TTL_S,
    REQUEST_MAX_MSG_BYTES,
    REQUEST_STATUS_TTL_S,
    STATUS_MAX_VALUE_BYTES,
    FastHeaderClient,
    JetStreamEventLog,
    connect,
    stream_replicas_default,
    stream_seq,
)

__all__ = [
    "CLOSE_TIMEOUT_S",
    "DIRECT_READ_ROLES",
    "DUPLICATE_WINDOW_S",
    "ERR_BATCH_DUPLICATE",
    "ERR_BATCH_TOO_LARGE",
    "ERR_WRONG_LAST_SEQ",
    "EVENT_MAX_MSG_BYTES",
    "HEARTBEAT_TTL_S",
    "REQUEST_MAX_MSG_BYTES",
    "REQUEST_STATUS_TTL_S",
    "STATUS_MAX_VALUE_BYTES",
    "FastHeaderClient",
    "JetStreamEventLog",
    "connect",
    "stream_replicas_default",
    "stream_seq",
]
