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
import time
from pathlib import Path
from typing import Any

import ray
import structlog
from ray._private import ray_constants
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dataplane.replica.actor import NAMESPACE, PREFIX, ModelActor, actor_name, parse_actor_name, replica_resources
from dataplane.replica.journal import Line
from dataplane.replica.model import warm_up
from dataplane.replica.wire import Answer
from dataplane.runtime.pool import Pool, member_number, member_prefix
from dataplane.runtime.ports import Found, Liveness, ReplicaHandle, ReplicaSpec
from schemas.errors import InfrastructureError

logger = structlog.get_logger("ndif.ray")

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
    if os.environ.get("RAY_ADDRESS"):
        logger.warning("ray_address_ignored", ray_address=os.environ["RAY_ADDRESS"][:200],
                       hint="this process starts a Ray of its own; `ndif agent` / `ndif dispatcher` join a cluster")
    # "local": always a new Ray, never the cluster RAY_ADDRESS or a (perhaps stale) `ray_current_cluster`
    # file in Ray's temp dir names; another user's or another run's Ray is not ours to join.
    ray.init(address="local", num_gpus=num_gpus, num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=False,
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


SAME_LABEL_WAIT_S = 60.0  # how long `ray_node_for` waits for Ray to mark a dead raylet of the same label dead
NODE_LABEL = "ndif.node_id"  # the Ray node label that names the ndif node a Ray node is (deploy/head.sh, deploy/worker.sh)


def ray_node_for(node_id: str) -> str | None:
    """The live Ray node labelled `ndif.node_id=<node_id>` (`ray start --labels`), or None.

    Several raylets may share one address (a loopback cluster) or a machine may run several: the
    label, not the address this process joined through, says which Ray node an agent is for."""
    # A node started again soon after it died (same label) can be listed next to its old raylet
    # until Ray marks that one dead (missed heartbeats): a replica pinned to the old one never runs.
    # Wait, boundedly, until the label names one live Ray node (past the wait, the last one listed).
    deadline = time.monotonic() + SAME_LABEL_WAIT_S
    while True:
        found = [str(n["NodeID"]) for n in ray.nodes()  # type: ignore[no-untyped-call]
                 if n.get("Alive") and (n.get("Labels") or {}).get(NODE_LABEL) == node_id]
        if len(found) <= 1 or time.monotonic() > deadline:
            return found[-1] if found else None
        time.sleep(1.0)


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
        return {**super().info(), "ray_node_id": here, "location": here, "pid": os.getpid()}

    def pid(self) -> int:
        """This process's pid (a pooled one answers before it is a replica; tests compare them)."""
        return os.getpid()

    @ray.method(enable_task_events=False)
    def calls_active(self, replies: list[str]) -> list[bool]:  # type: ignore[override]
        return super().calls_active(replies)

    @ray.method(enable_task_events=False)
    def run_batch(self, requests: list[dict[str, Any]],  # type: ignore[override]
                  users: list[str] | None = None) -> list[Answer]:
        return super().run_batch(requests, users)


class _PooledModelActor(_RayModelActor):
    """A replica process started before any replica needs it (dataplane/runtime/pool.py): it imports
    torch and transformers and warms their loading path now (`warm_up`), and becomes a replica when
    `adopt` hands it one's identity (the arguments `ModelActor` takes); every other method is the
    replica's, called after that."""

    def __init__(self) -> None:  # ModelActor.__init__ runs in `adopt`, once there is a replica
        warm_up()

    def adopt(self, model_key: str, replica_id: int, checkpoint: str, **kw: Any) -> int:
        """Become replica (model_key, replica_id); this process's pid."""
        ModelActor.__init__(self, model_key, replica_id, checkpoint, **kw)
        return os.getpid()


RemoteModelActor = ray.remote(_RayModelActor)
RemotePooledActor = ray.remote(_PooledModelActor)


def _actor_options(name: str, ray_node_id: str, max_concurrency: int) -> dict[str, Any]:
    """What every replica process gets from Ray, pooled or not: detached, named, pinned to its node
    (not soft), CPU and memory from `replica_resources`, no Ray GPUs (placement's are declared)."""
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    for var in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "NDIF_LOG_LEVEL"):
        if var in os.environ:
            env[var] = os.environ[var]
    cpus, memory = replica_resources()
    return {"name": name, "namespace": NAMESPACE, "lifetime": "detached", "num_cpus": cpus, "memory": memory,
            "num_gpus": 0, "max_concurrency": max_concurrency, "max_restarts": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
            "runtime_env": {"env_vars": env}}


def create_actor(model_key: str, replica_id: int, checkpoint: str, *, ray_node_id: str, node_id: str,
                 revision: str | None = None, dtype: str = "float32", execution_timeout_s: float = 60.0,
                 max_concurrency: int = 4, nats_url: str | None = None, nats_creds: Any = None) -> Any:
    """Start the detached actor for a replica on `ray_node_id` (it loads nothing until `load`)."""
    return RemoteModelActor.options(**_actor_options(actor_name(model_key, replica_id), ray_node_id, max_concurrency),
    ).remote(model_key, replica_id, checkpoint, revision=revision, dtype=dtype, node_id=node_id,
             execution_timeout_s=execution_timeout_s, nats_url=nats_url, nats_creds=nats_creds, capture_logs=True)


def create_pooled_actor(name: str, ray_node_id: str, max_concurrency: int = 4) -> Any:
    """Start a pool member `name` on `ray_node_id`: a replica process, imports done, no replica yet."""
    return RemotePooledActor.options(**_actor_options(name, ray_node_id, max_concurrency)).remote()


# A pooled process taken by a replica keeps the name it was started with (Ray names an actor once):
# the contract name is then an alias, `ModelActor:<model_key>:<replica_id>` -> the member's name, in
# Ray's own key-value store (the GCS's, namespace `ndif`), which every lookup below reads after the
# named actor itself. A stale alias (its process died) resolves to nothing, as a dead actor does.
_ALIAS_NS = NAMESPACE


def put_alias(model_key: str, replica_id: int, member: str) -> None:
    internal_kv._internal_kv_put(actor_name(model_key, replica_id), member, True, namespace=_ALIAS_NS)


def drop_stale_aliases(prefix: str) -> int:
    """Forget the aliases to members named with `prefix` (one node's) whose process is gone; how many."""
    live = set(_named_actors())
    stale = [name for name, target in _aliases().items() if target.startswith(prefix) and target not in live]
    for name in stale:
        internal_kv._internal_kv_del(name, namespace=_ALIAS_NS)
    return len(stale)


def _aliases() -> dict[str, str]:
    """contract name -> pool member name, for every alias kept."""
    out = {}
    for key in internal_kv._internal_kv_list(PREFIX, namespace=_ALIAS_NS):
        target = internal_kv._internal_kv_get(key, namespace=_ALIAS_NS)
        if target is not None:
            out[key.decode()] = target.decode()
    return out


def get_actor(model_key: str, replica_id: int) -> Any | None:
    """The live actor of a replica, or None (blocking GCS calls): the contract-named actor, else
    the pooled process its alias names."""
    name = actor_name(model_key, replica_id)
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    target = internal_kv._internal_kv_get(name, namespace=_ALIAS_NS)
    if target is None:
        return None
    try:
        return ray.get_actor(target.decode(), namespace=NAMESPACE)
    except ValueError:
        return None


def _named_actors() -> list[str]:
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, ns = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        if ns == NAMESPACE:
            out.append(name)
    return out


def list_replica_actors() -> list[tuple[str, int, str]]:
    """(model_key, replica_id, name) of every live replica actor in the namespace: contract-named
    ones and pooled processes taken under an alias (named by their contract name)."""
    named = _named_actors()
    live = set(named)
    out = []
    for name in named:
        parsed = parse_actor_name(name)
        if parsed is not None:
            out.append((*parsed, name))
    for name, target in _aliases().items():
        parsed = parse_actor_name(name)
        if parsed is not None and name not in live and target in live:
            out.append((*parsed, name))
    return out


def pool_members(prefix: str) -> tuple[list[str], set[str]]:
    """Live actors named with `prefix` (a node's pool members) and the members aliases point to
    (taken: replicas now)."""
    return [n for n in _named_actors() if n.startswith(prefix)], set(_aliases().values())


def _get_named(name: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


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

    def __init__(self, *, nats_url: str | None = None, nats_creds: Any = None, location: str | None = None,
                 pool_size: int = 0) -> None:
        self.nats_url = nats_url
        self.nats_creds = nats_creds
        self._location = location or current_location()
        # Pre-started replica processes on this Ray node (dataplane/runtime/pool.py), named by the Ray
        # node: two agents never share one.
        self.pool = Pool(self._location, pool_size)
        self._refill_wanted = asyncio.Event()
        self._refills: set[asyncio.Task[None]] = set()

    @property
    def location(self) -> str:
        return self._location

    async def create(self, spec: ReplicaSpec) -> ReplicaHandle:
        """A ready pooled process handed the replica's identity (its contract name an alias of the
        member's), else a new actor under the contract name."""
        kw: dict[str, Any] = {"revision": spec.revision, "dtype": spec.dtype, "node_id": spec.node_id,
                              "execution_timeout_s": spec.execution_timeout_s, "nats_url": self.nats_url,
                              "nats_creds": self.nats_creds}
        while (taken := self.pool.take()) is not None:
            name, handle = taken
            try:
                await handle.adopt.remote(spec.model_key, spec.replica_id, spec.checkpoint, capture_logs=True, **kw)
            except Exception:  # noqa: BLE001 - a member that died idle: the next one, or a new actor
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(kill_actor, handle)
                continue
            await asyncio.to_thread(put_alias, spec.model_key, spec.replica_id, name)
            return handle
        return await asyncio.to_thread(create_actor, spec.model_key, spec.replica_id, spec.checkpoint,
                                       ray_node_id=self._location, **kw)

    # ---- the pool --------------------------------------------------------------------------

    async def start_pool(self) -> None:
        """Take back this node's idle members a previous agent left (ready once they answer; those
        past the size are ended), then keep the pool full in the background until `stop_pool`."""
        prefix = member_prefix(self._location)
        members, taken = await asyncio.to_thread(pool_members, prefix)
        idle = sorted((n for n in members if n not in taken), key=lambda n: member_number(self._location, n) or 0)
        # New names go past every member alive or named by an alias (a dead member's stale alias must
        # never come to name a new idle process).
        self.pool.seen([n for n in (member_number(self._location, m) for m in (*members, *taken)) if n is not None])
        for i, name in enumerate(idle):
            handle = await asyncio.to_thread(_get_named, name)
            if handle is None:
                continue
            if i < self.pool.size:
                self._watch(name, handle)
            else:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(kill_actor, handle)
        task = asyncio.create_task(self._refill_loop(), name="pool-refill")
        self._refills.add(task)
        self._refill_wanted.set()

    async def stop_pool(self, kill: bool = False) -> None:
        """Stop refilling; with `kill`, end the idle members too (otherwise a restarted agent takes them back)."""
        tasks = list(self._refills)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if kill:
            for name, handle in [*self.pool.starting.items(), *self.pool.ready.items()]:
                self.pool.failed(name)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(kill_actor, handle)

    def pool_report(self) -> tuple[int, int]:
        return self.pool.report()

    async def _refill_loop(self) -> None:
        while True:
            await self._refill_wanted.wait()
            self._refill_wanted.clear()
            # The aliases of this node's replicas that ended (a kill, a crash) name nothing: forgotten.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(drop_stale_aliases, member_prefix(self._location))
            for name in self.pool.refill():
                try:
                    handle = await asyncio.to_thread(create_pooled_actor, name, self._location)
                except Exception as exc:  # noqa: BLE001 - Ray refused (resources): tried again on the next take
                    logging.getLogger(__name__).warning("pool member %s not started: %s", name, exc)
                    continue
                self._watch(name, handle)

    def _watch(self, name: str, handle: Any, timeout_s: float = 300.0) -> None:
        """Count `name` as starting, and as ready once its process answers (its imports are done)."""
        self.pool.started(name, handle)

        async def until_up() -> None:
            try:
                await asyncio.wait_for(handle.ping.remote(), timeout_s)
            except Exception:  # noqa: BLE001 - never came up: out of the pool, a new one started
                self.pool.failed(name)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(kill_actor, handle)
                self._refill_wanted.set()
                return
            self.pool.up(name)

        task = asyncio.create_task(until_up(), name=f"pool-{name}")
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

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
        try:
            await handle.load.remote(devices, bytes_per_gpu)
        finally:
            # A member taken for this replica is replaced now, after its load: a new process's imports
            # would compete with the load for the node's CPUs (measured here: about 2x slower on 2 cores).
            self._refill_wanted.set()

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

    def run_batch(self, handle: ReplicaHandle, payloads: list[dict[str, Any]], users: list[str]) -> Any:
        return handle.run_batch.remote(payloads, users)

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


def plain_actor(cls: type, *, name: str) -> Any:
    """A plain named actor of `cls` (no CPU reserved): a benchmark's raw-call baseline
    (tools/bench/fairness.py). `named_actor(name)` finds it from another process of the cluster."""
    return ray.remote(num_cpus=0)(cls).options(name=name, namespace=NAMESPACE).remote()  # type: ignore[attr-defined]


def named_actor(name: str) -> Any | None:
    return _get_named(name)
