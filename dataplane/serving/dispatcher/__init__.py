"""The dispatcher, one concern per module (docs/architecture.md, "The dispatcher's parts").

Each part imports only those before it (tests/unit/test_architecture.py): background (the tasks
they own) -> statuses (status writing) -> capacity (pure rules) -> provisioning (deploys,
backoff) -> intake (consumers, triage, queue lifetime) -> follower (the log) -> service
(settings, wiring).
"""

from dataplane.serving.dispatcher.provisioning import MAX_REFUSED_MEMO
from dataplane.serving.dispatcher.service import ACK_WAIT_S, Dispatcher

__all__ = ["ACK_WAIT_S", "MAX_REFUSED_MEMO", "Dispatcher"]
