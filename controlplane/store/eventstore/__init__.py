"""The JetStream adapter of the `EventLog` and `SnapshotStore` ports (controlplane/core/ports.py).

One concern per module, each importing only those above it: connection (connect, size limits),
topology (streams and buckets), appends, feed (reads, follow), snapshots; log.py composes them
into `JetStreamEventLog`. Callers import the public names from the package, not from its modules.
"""

from controlplane.store.eventstore.appends import ERR_BATCH_DUPLICATE, ERR_BATCH_TOO_LARGE, ERR_WRONG_LAST_SEQ
from controlplane.store.eventstore.connection import (
    EVENT_MAX_MSG_BYTES,
    REQUEST_MAX_MSG_BYTES,
    STATUS_MAX_VALUE_BYTES,
    NdifNatsClient,
    connect,
    stream_replicas_default,
    stream_seq,
)
from controlplane.store.eventstore.log import CLOSE_TIMEOUT_S, DIRECT_READ_ROLES, JetStreamEventLog
from controlplane.store.eventstore.topology import DUPLICATE_WINDOW_S, HEARTBEAT_TTL_S, REQUEST_STATUS_TTL_S

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
    "JetStreamEventLog",
    "NdifNatsClient",
    "connect",
    "stream_replicas_default",
    "stream_seq",
]
