"""The Ray implementation of the runtime ports: the one module of ours that imports `ray`.

Everything Ray does for us goes through here (Ray Serve's rule: "all Ray API calls are made
here"): starting or joining the local Ray, the replica actor (`ModelActor` made remote, created
detached and pinned to the agent's node), finding, killing and pinging actors (`RayRuntime`, the
node agent's `ReplicaRuntime`), and the request path's calls (`RayCaller`, a `ReplicaCaller`).
A test (tests/unit/test_ray_boundary.py) fails if any other module imports `ray`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane.replica.actor import NAMESPACE, ModelActor, actor_name, parse_actor_name, replica_resources
from dataplane.replica.journal import Line
from dataplane.replica.wire import Answer
from dataplane.runtime.ports import Found, Liveness, ReplicaHandle, ReplicaSpec
from schemas.errors import InfrastructureError

# ---- the local Ray ---------------------------------------------------------------------------


# Ray takes the machine's routable address for a new cluster's node (and so listens on every
# interface: GCS, raylet, workers, agents, metrics) unless it runs as a single-machine cluster, the mode
# this variable turns on (Ray's own name for it speaks of macOS and Windows; on Linux it does the same).
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
_TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
_loopback_set: tuple[str | None, bool] | None = None  # what start_local changed, put back by shutdown
_token_dir: Path | None = None


def _loopback_only() -> None:
    """Every socket of the local Ray on 127.0.0.1: its processes read the variable when they start,
    this one (which imported Ray already) reads the constant when `ray.init` picks the node's address."""
    global _loopback_set
    if _loopback_set is None:
        _loopback_set = (os.environ.get(_SINGLE_MACHINE_ENV), ray_constants.ENABLE_RAY_CLUSTER)
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _private_token() -> None:
    """Ray's token auth (on by default for a new local cluster) saves its token in ~/.ray/auth_token
    with the process's umask (0644 in a 0755 directory): any local user could read it and run code on
    the cluster. Give Ray this process's own token instead, 0600 in a 0700 directory, through
    RAY_AUTH_TOKEN_PATH (which Ray's processes, and joining ones started from here, inherit). Ray
    then warns on every start that it turned token auth on by itself, which is what we asked for and
    names nothing to do: that one warning is dropped (`_QuietTokenNotice`). A token or a mode the
    operator set is theirs and kept, and so are Ray's warnings about them."""
    global _token_dir
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled" or any(os.environ.get(v) for v in _TOKEN_ENVS):
        return
    if _token_dir is None:  # one per process: Ray caches the token it loaded first
        _token_dir = Path(tempfile.mkdtemp(prefix="ndif-ray-auth-"))  # 0700
        fd = os.open(_token_dir / "auth_token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # Ray's own token format
        atexit.register(shutil.rmtree, _token_dir, True)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(_token_dir / "auth_token")
    setup = logging.getLogger(_TOKEN_SETUP_LOGGER)
    if not any(isinstance(f, _QuietTokenNotice) for f in setup.filters):
        setup.addFilter(_QuietTokenNotice())


def auth_token_path() -> str | None:
    """The token file this process's Ray clusters use: the operator's RAY_AUTH_TOKEN_PATH, else a
    private one made here (`_private_token`); None when the token is given inline (RAY_AUTH_TOKEN) or
    auth is off. Processes started from here (`ray start`, agents) inherit it."""
    _private_token()
    return os.environ.get("RAY_AUTH_TOKEN_PATH")


class _QuietTokenNotice(logging.Filter):
    """Drops Ray's "Token authentication is enabled for this Ray cluster" notice (the token is ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def start_local(num_gpus: int, *, num_cpus: int | None = None) -> str:
    """Start a Ray for this process (`ndif up`, the demos, tests), in namespace `ndif`; its GCS address.

    It listens on 127.0.0.1 only (a process on this machine joins it at that address) and its auth
    token is private to this user (`_private_token`). The GPUs are declared, not Ray's to allocate
    (dataplane/replica/actor.py): `num_gpus` only says how many this node has."""
    _loopback_only()
    _private_token()
    ray.init(num_gpus=num_gpus, num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False,
             log_to_driver=False)
    return str(ray.get_runtime_context().gcs_address)


def join(address: str) -> None:
    """Join the Ray cluster at `address` (`ndif agent`, `ndif dispatcher`). ConnectionError when there is none.

    A cluster whose head is on loopback (`127.x.y.z:PORT`: tests, one machine) is joined through the
    head's raylet at that address: Ray otherwise looks for a raylet at this machine's address.
    InfrastructureError naming RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH when the cluster wants a token
    this process was not given (Ray's own error is a bare `InvalidAuthToken`)."""
    if any(os.environ.get(v) for v in _TOKEN_ENVS):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # a token given is meant to be sent
    host = address.rsplit(":", 1)[0]
    kw: dict[str, Any] = {"_node_ip_address": host} if host.startswith("127.") else {}
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **kw)
    except Exception as exc:
        if not _auth_refused(exc):
            raise
        given = next((v for v in _TOKEN_ENVS if os.environ.get(v)), None)
        raise InfrastructureError(
            f"the Ray cluster at {address!r} refused this process's auth token "
            f"({'none given' if given is None else 'from ' + given}): give it the cluster's token, "
            "RAY_AUTH_TOKEN_PATH=<the cluster's token file> or RAY_AUTH_TOKEN=<the token>") from None


def _auth_refused(exc: BaseException) -> bool:
    """Is this Ray's refusal of a missing or wrong auth token (its text is all it says)?"""
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__}: {seen}"
        if "InvalidAuthToken" in text or "AuthenticationError" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


NODE_LABEL = "ndif.node_id"  # the Ray node label that names the ndif node a Ray node is (deploy/ray/)


def ray_node_for(node_id: str) -> str | None:
    """The live Ray node labelled `ndif.node_id=<node_id>` (`ray start --labels`), or None.

    Several raylets may share one address (a loopback cluster) or a machine may run several: the
    label, not the address this process joined through, says which Ray node an agent is for."""
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        if n.get("Alive") and (n.get("Labels") or {}).get(NODE_LABEL) == node_id:
            return str(n["NodeID"])
    return None


def ray_nodes() -> list[dict[str, Any]]:
    """Every Ray node of the cluster: id, alive, its ndif node label (tests and `ndif` tools)."""
    return [{"ray_node_id": str(n["NodeID"]), "alive": bool(n.get("Alive")),
             "node_id": (n.get("Labels") or {}).get(NODE_LABEL)} for n in ray.nodes()]  # type: ignore[no-untyped-call]


def is_initialized() -> bool:
    return bool(ray.is_initialized())


def shutdown() -> None:
    """Leave (or stop, when it was started here) this process's Ray; nothing when none. A later
    `join` of another cluster then takes this machine's routable address again."""
    global _loopback_set
    if ray.is_initialized():
        ray.shutdown()
    if _loopback_set is not None:
        env, cluster = _loopback_set
        if env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = env
        ray_constants.ENABLE_RAY_CLUSTER = cluster
        _loopback_set = None


def gcs_address() -> str:
    return str(ray.get_runtime_context().gcs_address)


def current_location() -> str:
    """This process's Ray node id (where `RayRuntime` makes its replicas)."""
    return str(ray.get_runtime_context().get_node_id())


# ---- the replica actor -----------------------------------------------------------------------


class _RayModelActor(ModelActor):
    """`ModelActor` as Ray runs it: `info` says the Ray node, and the request path's methods have
    Ray's per-task events off (every request already has its statuses and the dispatcher's logs,
    and task events cost ~0.2 ms a call here)."""

    def info(self) -> dict[str, Any]:
        here = current_location()
        return {**super().info(), "ray_node_id": here, "location": here}

    @ray.method(enable_task_events=False)
    def calls_active(self, replies: list[str]) -> list[bool]:  # type: ignore[override]
        return super().calls_active(replies)

    @ray.method(enable_task_events=False)
    def run_batch(self, requests: list[dict[str, Any]]) -> list[Answer]:  # type: ignore[override]
        return super().run_batch(requests)


RemoteModelActor = ray.remote(_RayModelActor)


def create_actor(model_key: str, replica_id: int, checkpoint: str, *, ray_node_id: str, node_id: str,
                 revision: str | None = None, dtype: str = "float32", execution_timeout_s: float = 60.0,
                 max_concurrency: int = 4, nats_url: str | None = None, nats_creds: Any = None) -> Any:
    """Start the detached actor for a replica on `ray_node_id` (it loads nothing until `load`)."""
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    for var in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "NDIF_LOG_LEVEL"):
        if var in os.environ:
            env[var] = os.environ[var]
    cpus, memory = replica_resources()
    return RemoteModelActor.options(
        name=actor_name(model_key, replica_id), namespace=NAMESPACE, lifetime="detached",
        num_cpus=cpus, memory=memory, num_gpus=0, max_concurrency=max_concurrency, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
        runtime_env={"env_vars": env},
    ).remote(model_key, replica_id, checkpoint, revision=revision, dtype=dtype, node_id=node_id,
             execution_timeout_s=execution_timeout_s, nats_url=nats_url, nats_creds=nats_creds, capture_logs=True)


def get_actor(model_key: str, replica_id: int) -> Any | None:
    """The live actor of a replica, or None (a blocking GCS call)."""
    try:
        return ray.get_actor(actor_name(model_key, replica_id), namespace=NAMESPACE)
    except ValueError:
        return None


def list_replica_actors() -> list[tuple[str, int, str]]:
    """(model_key, replica_id, name) of every live contract-named actor in the namespace."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        if ns != NAMESPACE:
            continue
        parsed = parse_actor_name(name)
        if parsed is not None:
            out.append((*parsed, name))
    return out


def kill_actor(handle: Any) -> None:
    """End an actor at once, no restart (tests and demos kill replicas behind the agent's back)."""
    ray.kill(handle, no_restart=True)


def actor_gone(exc: BaseException) -> bool:
    """Is this the error of a call whose actor died (or was killed)?"""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))


def get(ref: Any, timeout_s: float | None = None) -> Any:
    """The value of an object ref, blocking (tools and tests outside an event loop)."""
    return ray.get(ref, timeout=timeout_s)


# ---- the node agent's runtime ----------------------------------------------------------------


class RayRuntime:
    """`ReplicaRuntime` on Ray: detached contract-named actors pinned to this process's Ray node.

    Given the NATS URL (and the agent's credentials), each actor also serves its NATS endpoint
    (dataplane/serving/link.py)."""

    def __init__(self, *, nats_url: str | None = None, nats_creds: Any = None, location: str | None = None) -> None:
        self.nats_url = nats_url
        self.nats_creds = nats_creds
        self._location = location or current_location()

    @property
    def location(self) -> str:
        return self._location

    async def create(self, spec: ReplicaSpec) -> ReplicaHandle:
        return await asyncio.to_thread(
            create_actor, spec.model_key, spec.replica_id, spec.checkpoint, revision=spec.revision, dtype=spec.dtype,
            ray_node_id=self._location, node_id=spec.node_id, execution_timeout_s=spec.execution_timeout_s,
            nats_url=self.nats_url, nats_creds=self.nats_creds)

    async def started(self, handle: ReplicaHandle, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(handle.info.remote(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def get(self, model_key: str, replica_id: int) -> ReplicaHandle | None:
        # A blocking GCS call: kept off the event loop (heartbeats must not stall).
        return await asyncio.to_thread(get_actor, model_key, replica_id)

    async def info(self, handle: ReplicaHandle) -> dict[str, Any]:
        info: dict[str, Any] = await handle.info.remote()
        info.setdefault("location", info.get("ray_node_id"))  # an actor made before `location` was said
        return info

    async def load(self, handle: ReplicaHandle, devices: list[int], bytes_per_gpu: int) -> None:
        await handle.load.remote(devices, bytes_per_gpu)

    async def to_cache(self, handle: ReplicaHandle) -> int:
        return int(await handle.to_cache.remote())

    async def from_cache(self, handle: ReplicaHandle, devices: list[int], bytes_per_gpu: int) -> None:
        await handle.from_cache.remote(devices, bytes_per_gpu)

    async def unload(self, handle: ReplicaHandle) -> None:
        await handle.unload.remote()

    async def kill(self, handle: ReplicaHandle) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.unload.remote(), 10)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(kill_actor, handle)

    async def ping(self, handle: ReplicaHandle, timeout_s: float) -> tuple[Liveness, str]:
        try:
            await asyncio.wait_for(handle.ping.remote(), timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            return Liveness.DEAD, f"actor died: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        except (TimeoutError, ray.exceptions.GetTimeoutError):
            return Liveness.BUSY, ""
        return Liveness.ALIVE, ""

    async def recent_lines(self, handle: ReplicaHandle, n: int, timeout_s: float) -> list[Line]:
        ref = handle.recent_lines.remote(n)
        try:
            lines: list[Line] = await asyncio.wait_for(ref, timeout_s)
        except (TimeoutError, ray.exceptions.GetTimeoutError):
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # a queued call the actor never started is dropped
            raise TimeoutError(f"the replica did not answer within {timeout_s:g} s") from None
        return lines

    async def list(self) -> list[Found]:
        found = await asyncio.to_thread(list_replica_actors)
        return [Found(model_key=mk, replica_id=rid, name=name) for mk, rid, name in found]


# ---- the request path's calls ----------------------------------------------------------------


class RayCaller:
    """`ReplicaCaller` on Ray: actor method calls, awaited as Ray object refs."""

    def lookup(self, model_key: str, replica_id: int) -> ReplicaHandle | None:
        return get_actor(model_key, replica_id)

    def run_batch(self, handle: ReplicaHandle, payloads: list[dict[str, Any]]) -> Any:
        return handle.run_batch.remote(payloads)

    def take_answer(self, handle: ReplicaHandle, reply: str) -> Any:
        return handle.take_answer.remote(reply)

    def calls_active(self, handle: ReplicaHandle, replies: list[str]) -> Any:
        return handle.calls_active.remote(replies)

    def gone(self, exc: BaseException) -> bool:
        return actor_gone(exc)


__all__ = ["RayCaller", "RayRuntime", "RemoteModelActor", "actor_gone", "auth_token_path", "create_actor",
           "current_location", "gcs_address", "get", "get_actor", "is_initialized", "join", "kill_actor",
           "list_replica_actors", "ray_node_for", "ray_nodes", "shutdown", "start_local"]


# ---- Ray Serve, the baseline tools/bench/dispatch.py measures us against -----------------------


def serve_run(cls: type, *, name: str, num_replicas: int) -> Any:
    """Deploy `cls` with Ray Serve (`num_replicas`, no CPU reserved); its deployment handle."""
    from ray import serve

    deployment = serve.deployment(num_replicas=num_replicas, ray_actor_options={"num_cpus": 0})(cls)
    return serve.run(deployment.bind(), name=name, route_prefix=None)


def serve_shutdown() -> None:
    from ray import serve

    serve.shutdown()  # type: ignore[no-untyped-call]
