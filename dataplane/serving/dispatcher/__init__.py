"""The dispatcher, one concern per module (docs/architecture.md, "The dispatcher's parts").

service (settings, wiring) <- follower (the log) <- intake (consumers, triage, queue lifetime)
<- provisioning (deploys, backoff) <- statuses (status writing); background holds their tasks.
"""

from dataplane.serving.dispatcher.provisioning import MAX_REFUSED_MEMO, _memo_put
from dataplane.serving.dispatcher.service import ACK_WAIT_S, Dispatcher, run_dispatcher

__all__ = ["ACK_WAIT_S", "MAX_REFUSED_MEMO", "Dispatcher", "_memo_put", "run_dispatcher"]
