"""Shared by the Ray test modules: one local Ray per module (2 declared GPUs), actor cleanup."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray

from dataplane.model_actor import NAMESPACE, get_actor, list_replica_actors


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    ray.init(num_gpus=2, num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def kill_all_actors() -> None:
    for mk, rid, _ in list_replica_actors():
        h = get_actor(mk, rid)
        if h is not None:
            ray.kill(h, no_restart=True)
