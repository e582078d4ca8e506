"""Fault tests share the Ray fixture of tests/dataplane (one local Ray per module, 2 declared GPUs)."""

from tests.dataplane.conftest import local_ray

__all__ = ["local_ray"]
