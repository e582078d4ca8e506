"""The Ray actor around one `ModelReplica`, and the naming contract every component uses.

The contract: a replica is the Ray actor named exactly `ModelActor:<model_key>:<replica_id>`, in
namespace `ndif`. It is created `lifetime="detached"` (it outlives the agent that made it, which
adopts it again after a restart), pinned to the agent's Ray node (hard node affinity) and handed
exactly the GPU indices of its `ReplicaScheduled` event. Ray's own GPU accounting is not used
(`num_gpus=0`, `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, as NDIF does): the controller's
placement is authoritative, and a second allocator that could disagree with it (fractional shares,
replicas still leaving a card) would only leave actors pending.

CPU and memory are Ray's to account, though: each replica actor asks for `NDIF_REPLICA_CPUS`
(default 0.1) CPUs and `NDIF_REPLICA_MEMORY_MB` (default 256) MiB, so a node runs no more replica
processes than its CPUs and memory allow (2 CPUs: 20 replicas), and Ray leaves a replica it cannot
run pending, which the agent reports as a failed load (`replica_resources`).

Given the NATS URL (the agent passes its own), the actor also answers `run_batch` on its endpoint
`ndif.run.<ntok>.<mtok>.<replica_id>` (dataplane/replica/endpoint.py): the dispatcher's fast path
to it (the node token first: an agent's user may serve its own node's endpoints only). The call
and its answers are dataplane/replica/wire.py's.

The actor keeps its process's own recent log lines (`recent_lines`; dataplane/replica/journal.py),
which `ndif logs` shows beside the agent's: with `capture_logs` (the Ray adapter's actors, one per
process) every structlog event and printed `logging` record of the process, else only what the
actor itself notes.
"""

from __future__ import annotations

import os
import time
from typing import Any

from dataplane.replica.endpoint import ReplicaEndpoint
from dataplane.replica.journal import Journal, Line, capture_process_logs
from dataplane.replica.model import LoadError, ModelReplica, ReplicaNotHot, error_text
from dataplane.replica.wire import Answer, Completed, Failed, NotRun
from schemas.subjects import replica_call_subject

NAMESPACE = "ndif"
PREFIX = "ModelActor:"
REPLICA_CPUS = 0.1
REPLICA_MEMORY_MB = 256


def actor_name(model_key: str, replica_id: int) -> str:
    """The one name of a replica's actor (NDIF's naming contract)."""
    return f"{PREFIX}{model_key}:{replica_id}"


def parse_actor_name(name: str) -> tuple[str, int] | None:
    """(model_key, replica_id) of a contract name, or None for any other actor."""
    if not name.startswith(PREFIX):
        return None
    model_key, sep, rid = name[len(PREFIX):].rpartition(":")
    if not sep or not model_key or not rid.isdigit():
        return None
    return model_key, int(rid)


class ModelActor:
    """A plain class; the runtime adapter makes it an actor (dataplane/runtime/ray_adapter.py).
    Every method is a thin call into `ModelReplica`."""

    def __init__(self, model_key: str, replica_id: int, checkpoint: str, *, revision: str | None = None,
                 dtype: str = "float32", node_id: str = "", execution_timeout_s: float = 60.0,
                 nats_url: str | None = None, nats_creds: Any = None, capture_logs: bool = False) -> None:
        self.node_id = node_id
        self.journal = Journal()
        if capture_logs:  # before the replica and its endpoint say anything
            capture_process_logs(self.journal)
        self.replica = ModelReplica(model_key, replica_id, checkpoint, revision=revision, dtype=dtype,
                                    execution_timeout_s=execution_timeout_s)
        # The request path's endpoint (dataplane/replica/endpoint.py): `run_batch` over NATS as well.
        self.endpoint = None if not nats_url else ReplicaEndpoint(
            nats_url, replica_call_subject(model_key, replica_id, node_id), self.run_batch, creds=nats_creds,
            name=f"replica:{model_key}:{replica_id}", model_key=model_key, replica_id=replica_id).start()

    def load(self, devices: list[int], bytes_per_gpu: int = 0) -> float:
        try:
            seconds = self.replica.load(tuple(devices), bytes_per_gpu)
        except Exception as exc:  # noqa: BLE001 - every load failure is reported the same way
            # transformers' errors do not always pickle; the agent needs their text, not their class.
            raise LoadError(f"{type(exc).__name__}: {exc}") from None
        self._endpoint_settle()
        return seconds

    def _endpoint_settle(self) -> None:
        """A replica reported HOT is reachable on its endpoint: a young actor gives its connection
        up to 5 s of its life to come up (one that cannot reach NATS is served through Ray)."""
        if self.endpoint is not None:
            self.endpoint.ready(timeout=self.endpoint.started + 5.0 - time.monotonic())

    def to_cache(self) -> int:
        return self.replica.to_cache()

    def from_cache(self, devices: list[int], bytes_per_gpu: int = 0) -> float:
        seconds = self.replica.from_cache(tuple(devices), bytes_per_gpu)
        self._endpoint_settle()
        return seconds

    def unload(self) -> None:
        self.replica.unload()

    def info(self) -> dict[str, Any]:
        return {**self.replica.info(), "node_id": self.node_id}

    def ping(self) -> bool:
        return True

    def recent_lines(self, n: int) -> list[Line]:
        """The process's own newest `n` lines (at most `schemas.logs.MAX_LINES`), oldest first."""
        return self.journal.recent(n)

    def calls_active(self, replies: list[str]) -> list[bool]:
        """Which of these endpoint calls this replica still works on (the dispatcher's check)."""
        return self.endpoint.calls_active(replies) if self.endpoint else [False] * len(replies)

    def take_answer(self, reply: str) -> list[Answer] | None:
        """An endpoint call's answer too big for NATS, taken through Ray."""
        return self.endpoint.take_answer(reply) if self.endpoint else None

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.replica(request)

    def run_batch(self, requests: list[dict[str, Any]], users: list[str] | None = None) -> list[Answer]:
        """Requests in one call, run one after the other, each answered on its own (the dispatcher's path).
        `users[i]` is whose `requests[i]` is: when calls wait for the replica, the next request is
        chosen by it (dataplane/replica/turns.py).

        Each answer is `Completed`, `Failed` (the request's own error, which never touches the
        others), or `NotRun` for the ones after the replica stopped being HOT (the dispatcher hands
        those to another replica): dataplane/replica/wire.py.
        """
        out: list[Answer] = []
        for i, request in enumerate(requests):
            t = time.perf_counter()
            try:
                user = users[i] if users and i < len(users) else ""
                result, seconds = self.replica.timed(request, user)
                out.append(Completed(result=result, seconds=seconds))
            except ReplicaNotHot as exc:
                out += [NotRun(reason=str(exc))] * (len(requests) - i)
                break
            except Exception as exc:  # noqa: BLE001 - the request's own failure, reported as its answer
                out.append(Failed(error=type(exc).__name__, message=error_text(exc), seconds=time.perf_counter() - t))
        return out


def replica_resources() -> tuple[float, int]:
    """(num_cpus, memory bytes) a replica actor asks Ray for: `NDIF_REPLICA_CPUS`, `NDIF_REPLICA_MEMORY_MB`."""
    try:
        cpus = float(os.environ.get("NDIF_REPLICA_CPUS", REPLICA_CPUS))
        mem_mb = float(os.environ.get("NDIF_REPLICA_MEMORY_MB", REPLICA_MEMORY_MB))
    except ValueError:
        raise ValueError("NDIF_REPLICA_CPUS and NDIF_REPLICA_MEMORY_MB take numbers (e.g. 0.1, 256)") from None
    if not (0 < cpus <= 1024 and 0 < mem_mb <= 2**30):
        raise ValueError(f"NDIF_REPLICA_CPUS must be in (0, 1024] and NDIF_REPLICA_MEMORY_MB > 0 "
                         f"(got {cpus}, {mem_mb})")
    return cpus, int(mem_mb * 2**20)
