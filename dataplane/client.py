"""The researchers' SDK, at its public import path: `from dataplane.client import Client`.

It lives in `dataplane/serving/client.py` with the rest of the serving side; this module keeps the
path the README and users' code import from.
"""

from dataplane.serving.client import DEFAULT_URL, Client, Job, RequestFailed

__all__ = ["DEFAULT_URL", "Client", "Job", "RequestFailed"]
