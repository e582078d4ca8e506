"""The researchers' SDK: `from dataplane.client import Client`.

Installs with the base package alone (nats-py, msgspec, structlog): nothing here imports torch,
transformers or Ray (tests/unit/test_architecture.py checks `sys.modules` after the import).
"""

from dataplane.client.sdk import DEFAULT_URL, Client, ClientNotConnected, Job, QueueLimitExceeded, RequestFailed

__all__ = ["DEFAULT_URL", "Client", "ClientNotConnected", "Job", "QueueLimitExceeded", "RequestFailed"]
