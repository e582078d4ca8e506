"""One model replica in one process: real transformers weights, HOT (GPU), WARM (CPU) or COLD (disk).

A plain class, so the same code runs inside the Ray actor (`dataplane/replica/actor.py`) and on a GPU
machine without Ray. COLD -> HOT is `load()` (`from_pretrained` from a local directory or the HF
cache; never the hub), HOT -> WARM is `to_cache()` (weights to CPU memory, GPU memory released),
WARM -> HOT is `from_cache(devices)`. Devices are the exact CUDA indices the controller chose; with
no CUDA (CPU machines, declared GPUs in tests) the model lives on the CPU and HOT vs WARM is
bookkeeping. On several cards the layers are laid out with each card's budget the share placement
charged it (`bytes_per_gpu`), not the card's whole memory, and the same layout is used at every
(re)load of the replica (see `device_map`). A request to a replica that is not HOT fails with `ReplicaNotHot`, which the
dispatcher recognises and re-queues.

Requests (dicts, so they cross Ray and JSON unchanged):
    {"op": "forward",  "input_ids": [[...]], "modules": ["transformer.h.0"]?, "top_k": 5?}
        -> {"next_token_ids": [...], "next_token_logprobs": [...], "top": [[(id, logprob)...]],
            "modules": {name: {"shape": [...], "mean": float, "norm": float}}}
    {"op": "generate", "input_ids": [[...]], "max_new_tokens": 8}
        -> {"output_ids": [[...]]}
`prompt` (text) may replace `input_ids` when the checkpoint has a tokenizer; outputs then carry `text`.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import threading
import time
from typing import Any

import structlog

from dataplane.replica.turns import Turns
from schemas.errors import NdifError
from schemas.requests import MAX_BATCH_TOKENS, MAX_NEW_TOKENS, payload_problem
from schemas.status import Level
from schemas.units import gib

logger = structlog.get_logger("ndif.model")



def error_text(exc: BaseException) -> str:
    """What a user is told of a request's failure: the last line of its message (or its class)."""
    text = str(exc).strip()
    return text.splitlines()[-1][:1000] if text else type(exc).__name__


class ReplicaNotHot(NdifError):
    """The replica is WARM or COLD: the request was not run; send it to a HOT replica (or re-queue)."""

    default_retryable = True


class ExecutionTimeout(NdifError):
    """The request ran past the replica's execution timeout."""


class LoadError(NdifError):
    """The checkpoint could not be loaded; the message carries the loader's own error."""


class BadRequest(NdifError, ValueError):
    """The request is malformed (unknown op, bad input_ids, too large)."""


def warm_up() -> None:
    """Make a process started ahead of need (dataplane/runtime/pool.py) spend a later cold start on
    the weights only: import torch, transformers and accelerate, and take a one-layer GPT-2 of a few
    KB through `ModelReplica.load` and a forward pass, then drop it. Importing alone leaves ~2 s of
    first use in the first real load (transformers' loading code, safetensors, torch's first ops)."""
    import tempfile

    import accelerate  # noqa: F401
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="ndif-warm-up-") as d:
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, n_positions=16)).save_pretrained(d)
        r = ModelReplica("warm-up", 0, d)
        r.load(())
        r({"op": "forward", "input_ids": [[1, 2]]})
        r.unload()


class ModelReplica:
    """Holds one replica's weights and runs requests on them."""

    def __init__(self, model_key: str, replica_id: int, checkpoint: str, *, revision: str | None = None,
                 dtype: str = "float32", execution_timeout_s: float = 60.0) -> None:
        self.model_key = model_key
        self.replica_id = replica_id
        self.checkpoint = checkpoint
        self.revision = revision
        self.dtype = dtype
        self.execution_timeout_s = execution_timeout_s
        self.model: Any = None
        self.tokenizer: Any = None
        self.devices: tuple[int, ...] = ()
        # The multi-card layout: module -> position in `devices` (the same at every reload), and the
        # per-card share it was computed for; `device_map` is it on the current devices.
        self.layout: dict[str, int] | None = None
        self.layout_share = 0
        self.device_map: dict[str, int] | None = None
        self.level = Level.COLD
        self._lock = threading.Lock()  # one move (load/cache/unload) at a time; requests check the level
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-exec")
        self._turns = Turns()  # whose request runs next on the one runner above
        self.logger = logger.bind(model_key=model_key, replica_id=replica_id)

    # ---- where the weights are -----------------------------------------------------------------

    @staticmethod
    def cuda_available() -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def _device_for(self, devices: tuple[int, ...]) -> str:
        return f"cuda:{devices[0]}" if devices and self.cuda_available() else "cpu"

    def _layout_for(self, model: Any, devices: tuple[int, ...], bytes_per_gpu: int,
                    strict: bool = True) -> dict[str, int] | None:
        """The layout on `devices` for a multi-card replica (None for one card or no charge given):
        the one already computed for this share, else a new one from `device_map`. Not `strict`
        (declared cards without CUDA: the weights stay on the CPU), a layout that does not fit is
        logged, not raised."""
        if len(devices) < 2 or bytes_per_gpu <= 0:
            return None
        if self.layout is None or self.layout_share != bytes_per_gpu:
            try:
                dmap = device_map(model, tuple(range(len(devices))), bytes_per_gpu)
            except LoadError as exc:
                if strict:
                    raise
                self.logger.warning("device_map_unfit", error=str(exc), devices=list(devices))
                return None
            self.layout, self.layout_share = dmap, bytes_per_gpu
        return {name: devices[i] for name, i in self.layout.items()}

    def load(self, devices: tuple[int, ...] = (), bytes_per_gpu: int = 0) -> float:
        """COLD -> HOT: read the checkpoint from disk onto `devices` (CPU without CUDA). Seconds taken.

        On several cards each gets at most `bytes_per_gpu` of the weights (the share placement
        charged; 0: each card's whole memory, for a caller that passes no share)."""
        import torch
        from transformers import AutoModelForCausalLM

        with self._lock:
            if self.level == Level.HOT:
                return 0.0
            t0 = time.perf_counter()
            dtype = getattr(torch, self.dtype, None) if self.dtype not in ("", "unknown") else None
            kwargs: dict[str, Any] = {"local_files_only": True}
            if self.revision:
                kwargs["revision"] = self.revision
            if isinstance(dtype, torch.dtype):
                kwargs["dtype"] = dtype
            cuda = self.cuda_available() and len(devices) > 0
            if cuda and len(devices) > 1:
                # Spread layers over exactly these cards, each within its charged share.
                share = bytes_per_gpu or min(torch.cuda.get_device_properties(i).total_memory for i in devices)
                dmap = self._layout_for(_skeleton(self.checkpoint, kwargs), tuple(devices), share)
                self.model = AutoModelForCausalLM.from_pretrained(self.checkpoint, device_map=dmap, **kwargs)
                self.device_map = dmap
            else:
                self.model = AutoModelForCausalLM.from_pretrained(self.checkpoint, **kwargs)
                device = self._device_for(devices)
                if device == "cpu":
                    _materialize(self.model)
                else:
                    self.model.to(device)
                # Declared cards without CUDA: the layout is still computed (and checked against
                # the share), so a reload keeps it.
                self.device_map = self._layout_for(self.model, tuple(devices), bytes_per_gpu, strict=False)
            self.model.eval()
            self.tokenizer = _maybe_tokenizer(self.checkpoint)
            if cuda:
                torch.cuda.synchronize()
            self.devices = tuple(devices)
            self.level = Level.HOT
            took = time.perf_counter() - t0
            self.logger.info("replica_loaded", seconds=round(took, 3), devices=list(devices), cuda=cuda)
            return took

    def to_cache(self) -> int:
        """HOT -> WARM: weights to CPU memory, GPU memory released. Returns the bytes held on CPU."""
        import torch

        with self._lock:
            if self.level == Level.COLD or self.model is None:
                raise ReplicaNotHot(f"replica {self.replica_id} is COLD: nothing to cache")
            if self.level == Level.HOT:
                self.model.to("cpu")
                if self.cuda_available():
                    gc.collect()
                    torch.cuda.empty_cache()
                self.level = Level.WARM
                self.devices = ()
                self.device_map = None  # the layout is kept: a reload with the same share reuses it
            return self.cpu_bytes()

    def from_cache(self, devices: tuple[int, ...] = (), bytes_per_gpu: int = 0) -> float:
        """WARM -> HOT onto `devices`. Seconds taken. On several cards: the layout of the first load
        (moved to these cards) when the share is the same, else one computed for `bytes_per_gpu`."""
        import torch

        with self._lock:
            if self.level == Level.HOT:
                return 0.0
            if self.level != Level.WARM or self.model is None:
                raise ReplicaNotHot(f"replica {self.replica_id} is {self.level}: nothing cached to load")
            t0 = time.perf_counter()
            cuda = self.cuda_available() and len(devices) > 0
            if cuda and len(devices) > 1:
                from accelerate import dispatch_model

                share = bytes_per_gpu or self.layout_share or min(
                    torch.cuda.get_device_properties(i).total_memory for i in devices)
                dmap = self._layout_for(self.model, tuple(devices), share)
                self.model = dispatch_model(self.model, device_map=dmap)
                self.device_map = dmap
            else:
                self.model.to(self._device_for(devices))
                self.device_map = self._layout_for(self.model, tuple(devices), bytes_per_gpu, strict=False)
            if cuda:
                torch.cuda.synchronize()
            self.devices = tuple(devices)
            self.level = Level.HOT
            return time.perf_counter() - t0

    def unload(self) -> None:
        """-> COLD: drop the weights (GPU and CPU)."""
        import torch

        with self._lock:
            self.model = None
            self.level = Level.COLD
            self.devices = ()
            self.layout, self.layout_share, self.device_map = None, 0, None
            gc.collect()
            if self.cuda_available():
                torch.cuda.empty_cache()

    def cpu_bytes(self) -> int:
        if self.model is None:
            return 0
        return int(sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())))

    def gpu_bytes(self) -> dict[int, int]:
        """Bytes allocated by this process on each CUDA device (what HOT/WARM changes)."""
        import torch

        if not self.cuda_available():
            return {}
        return {i: int(torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())}

    def info(self) -> dict[str, Any]:
        return {"model_key": self.model_key, "replica_id": self.replica_id, "level": self.level,
                "devices": list(self.devices), "checkpoint": self.checkpoint, "pid": os.getpid(),
                "cpu_bytes": self.cpu_bytes() if self.level == Level.WARM else 0}

    # ---- requests ------------------------------------------------------------------------------

    def __call__(self, request: dict[str, Any], user: str = "") -> dict[str, Any]:
        """Run one request (`user` is whose it is: it decides the turn when several wait)."""
        return self.timed(request, user)[0]

    def timed(self, request: dict[str, Any], user: str = "") -> tuple[dict[str, Any], float]:
        """`__call__`, and the seconds the request itself ran (its wait for the turn not counted:
        the dispatcher's batch budget goes by it)."""
        t = time.perf_counter()
        if self.level != Level.HOT or self.model is None:
            raise ReplicaNotHot(f"replica {self.replica_id} of {self.model_key} is {self.level}, not HOT")
        op = request.get("op", "forward")
        if op == "echo":  # no model work: health checks and the dispatch benchmark's no-op replicas
            return {"echo": request.get("data"), "replica_id": self.replica_id}, time.perf_counter() - t
        problem = payload_problem(request)  # the rules `ndif submit` checks before sending
        if problem is not None:
            raise BadRequest(problem)
        # One run at a time on the replica, the next chosen fairly among the waiting (turns.py: the
        # user served least recently here goes first). A request waits for its turn at most one
        # timeout ("busy with other requests"), and its run's timeout counts from its start;
        # the turn ends when the run does, also one that outlived its caller's wait.
        if not self._turns.acquire(user, timeout=self.execution_timeout_s):
            raise ExecutionTimeout(f"replica {self.replica_id} was busy for {self.execution_timeout_s:g}s "
                                   "with other requests")
        model = self.model

        def run() -> tuple[dict[str, Any], float]:
            t = time.perf_counter()
            try:
                return self._run(op, request), time.perf_counter() - t
            except Exception:
                # The weights were moved or dropped under the request (an unload before a kill, a
                # restart): the request never ran to the end here, so it is not its failure. Not
                # run: the dispatcher gives it to another replica.
                if self.model is not model or self.level != Level.HOT:
                    raise ReplicaNotHot(f"replica {self.replica_id} of {self.model_key} left HOT while running "
                                        "the request") from None
                raise

        try:
            fut = self._pool.submit(run)
        except BaseException:
            self._turns.release()
            raise
        fut.add_done_callback(lambda _: self._turns.release())
        try:
            return fut.result(timeout=self.execution_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ExecutionTimeout(
                f"request ran longer than {self.execution_timeout_s:.0f}s on replica {self.replica_id}"
            ) from None

    def _input_ids(self, request: dict[str, Any]) -> Any:
        import torch

        ids = request.get("input_ids")
        if ids is None and "prompt" in request:
            if self.tokenizer is None:
                raise BadRequest("this checkpoint has no tokenizer: send input_ids instead of prompt")
            return self.tokenizer(str(request["prompt"]), return_tensors="pt")["input_ids"]
        if ids is None:
            raise BadRequest("request needs input_ids (a list of token ids, or a list of such lists) or prompt")
        if ids and isinstance(ids[0], int):
            ids = [ids]
        if (not isinstance(ids, list) or not ids or not all(isinstance(row, list) and row for row in ids)
                or len({len(row) for row in ids}) != 1):
            raise BadRequest("input_ids must be a non-empty list of equally long, non-empty lists of ints")
        if sum(len(r) for r in ids) > MAX_BATCH_TOKENS:
            raise BadRequest(f"input_ids hold more than {MAX_BATCH_TOKENS} tokens")
        vocab = int(self.model.config.vocab_size)
        if any(not isinstance(t, int) or t < 0 or t >= vocab for row in ids for t in row):
            raise BadRequest(f"input_ids must be ints in [0, {vocab})")
        return torch.tensor(ids, dtype=torch.long)

    def _context_length(self) -> int | None:
        """The longest sequence the model declares (GPT-2's `n_positions`, most others'
        `max_position_embeddings`); past it a learned position table fails with an IndexError."""
        cfg = self.model.config
        for attr in ("n_positions", "max_position_embeddings"):
            v = getattr(cfg, attr, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    def _run(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        import torch

        ids = self._input_ids(request).to(self.model.device)
        n = int(request.get("max_new_tokens", 16)) if op == "generate" else 0
        if op == "generate" and not 1 <= n <= MAX_NEW_TOKENS:
            raise BadRequest(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}]")
        ctx = self._context_length()
        if ctx is not None and ids.shape[1] + n > ctx:
            raise BadRequest(f"{ids.shape[1]} input tokens{f' + {n} new' if n else ''} exceed the model's "
                             f"context of {ctx} tokens: send fewer tokens{' or ask for fewer new ones' if n else ''}")
        with torch.inference_mode():
            if op == "generate":
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                          do_sample=False, pad_token_id=self.model.config.eos_token_id,
                                          max_time=self.execution_timeout_s)
                res: dict[str, Any] = {"output_ids": out.tolist()}
                if self.tokenizer is not None:
                    res["text"] = self.tokenizer.batch_decode(out, skip_special_tokens=True)
                return res
            captured: dict[str, Any] = {}
            hooks = []
            names = request.get("modules") or []
            if names:
                modules = dict(self.model.named_modules())
                missing = [n for n in names if n not in modules]
                if missing:
                    raise BadRequest(f"unknown modules {missing}; e.g. {list(modules)[1:4]}")
                for name in names:
                    hooks.append(modules[name].register_forward_hook(_capture(captured, name)))
            try:
                logits = self.model(ids).logits[:, -1, :].float()
            finally:
                for h in hooks:
                    h.remove()
            logprobs = torch.log_softmax(logits, dim=-1)
            top_k = max(1, min(int(request.get("top_k", 5)), 50))
            top = torch.topk(logprobs, top_k, dim=-1)
            nxt = logprobs.argmax(dim=-1)
            return {
                "next_token_ids": nxt.tolist(),
                "next_token_logprobs": logprobs.gather(-1, nxt[:, None])[:, 0].tolist(),
                "top": [[(int(i), float(v)) for i, v in zip(ti, tv, strict=True)]
                        for ti, tv in zip(top.indices.tolist(), top.values.tolist(), strict=True)],
                "modules": captured,
            }


def device_map(model: Any, devices: tuple[int, ...], bytes_per_gpu: int) -> dict[str, int]:
    """Module name -> card for `model` over `devices`, each card budgeted `bytes_per_gpu` (the share
    placement charged it), filled in module order.

    A module goes whole onto the current card if it fits there, else it is split into its children
    (never a `_no_split_modules` block, nor one holding tensors of its own), else the next card
    starts. A module sharing a tensor with one already placed (tied weights) goes with it. Pure:
    the same model, cards and share give the same map, with or without CUDA. Raises LoadError when
    the weights do not fit those budgets: a replica never spills onto another card, the CPU or disk.
    """
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    seen: dict[int, int] = {}  # tensor id -> card it went to
    out: dict[str, int] = {}
    card, used = 0, 0

    def tensors(module: Any) -> list[Any]:
        return [*module.parameters(), *module.buffers()]

    def place(name: str, module: Any) -> None:
        nonlocal card, used
        ts = tensors(module)
        tied = [seen[id(t)] for t in ts if id(t) in seen]
        new = {id(t): t for t in ts if id(t) not in seen}
        size = sum(t.numel() * t.element_size() for t in new.values())
        if tied and not new:
            out[name] = devices[tied[0]]  # only tied tensors: with them
            return
        children = list(module.named_children())
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        while card < len(devices):
            if used + size <= bytes_per_gpu:
                out[name] = devices[card]
                for i in new:
                    seen[i] = card
                used += size
                return
            if children and not own and type(module).__name__ not in no_split:
                for child, sub in children:
                    place(f"{name}.{child}" if name else child, sub)
                return
            card, used = card + 1, 0
        raise LoadError(f"the weights do not fit {len(devices)} cards of {gib(bytes_per_gpu)} each (the share "
                        f"placement charged): {name or 'the model'} ({gib(size)}) has no room left")

    place("", model)
    return out


def _skeleton(checkpoint: str, kwargs: dict[str, Any]) -> Any:
    """The model's modules without weights (meta tensors), to lay it out before reading the weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint, **{k: v for k, v in kwargs.items() if k != "dtype"})
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, **({"torch_dtype": kwargs["dtype"]} if "dtype" in kwargs else {}))


def _materialize(model: Any) -> None:
    """Copy memory-mapped weights into process memory: HOT on a CPU means read from disk, not a
    promise to page it in on the first request (safetensors loads map the file lazily)."""
    import torch

    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.data = t.data.clone()


def _capture(into: dict[str, Any], name: str) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        t = output[0] if isinstance(output, tuple) else output
        t = t.detach().float()
        into[name] = {"shape": list(t.shape), "mean": float(t.mean()), "norm": float(t.norm())}

    return hook


def _maybe_tokenizer(checkpoint: str) -> Any:
    if not any(os.path.exists(os.path.join(checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a model without a usable tokenizer still serves input_ids
        logger.warning("tokenizer_unusable", checkpoint=checkpoint, error=str(exc))
        return None
