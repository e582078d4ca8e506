"""Resolving a model key offline: where its checkpoint is and how big it is (docs/architecture.md §3).

Only local sources: an absolute checkpoint directory, or the Hugging Face cache. Never the hub
(there may be none, and a control plane must not block on one). The size is params + buffers of
the model built on the meta device (nothing is allocated), in the checkpoint's dtype. torch and
transformers are imported lazily: the CLI and the projections never pay for them.

An operator's deploy may name any directory of the controller's machine. A deploy a user's
request asked for (the dispatcher's provisioning) may name only what the operator offers
(`ModelRoots`): a directory under the model roots, or a repo id in the Hugging Face cache; and its
refusal is one sentence that says nothing of the filesystem (which paths exist, hold a config,
or could not be read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from controlplane.core.projections.cluster import Registration
from schemas.errors import UnknownModel
from schemas.keys import display_name, model_parts


@dataclass(frozen=True)
class ModelRoots:
    """The directories under which a request's model may live: NDIF_MODEL_ROOTS (separated by
    `os.pathsep`), default `$NDIF_HOME/models` (where `ndif up --demo` puts its models). Repo ids
    are looked up in the Hugging Face cache, which the operator fills (HF_HOME)."""

    roots: tuple[str, ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ModelRoots:
        raw = env.get("NDIF_MODEL_ROOTS")
        if raw is None:
            home = env.get("NDIF_HOME") or str(Path.home() / ".ndif")
            paths = [os.path.join(home, "models")]
        else:
            paths = [p for p in raw.split(os.pathsep) if p.strip()]
        return cls(tuple(os.path.normpath(os.path.abspath(os.path.expanduser(p))) for p in paths))

    def holds(self, path: str) -> bool:
        """Whether `path` (absolute, as a canonical key holds it: no `..` left) is under a root."""
        p = os.path.normpath(path)
        return any(p == r or p.startswith(r.rstrip(os.sep) + os.sep) for r in self.roots)


def not_offered(model_key: str) -> UnknownModel:
    """The one refusal of a request's model that is not offered, whatever the reason."""
    return UnknownModel(f"unknown model {display_name(model_key)}: not a model this service offers (the "
                        "operator deploys models with `ndif deploy`, or puts them under its model roots)")


def find_checkpoint(model_key: str) -> tuple[str, str | None]:
    """(checkpoint directory, revision) for a canonical key, or UnknownModel."""
    _, repo, revision = model_parts(model_key)
    if repo.startswith("/"):
        if (Path(repo) / "config.json").is_file():
            return os.path.realpath(repo), revision  # a link's target: one checkpoint, one registration
        why = "has no config.json" if Path(repo).is_dir() else "does not exist on the controller's machine"
        raise UnknownModel(f"unknown model {display_name(model_key)}: {repo} {why}")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        raise UnknownModel(f"unknown model {display_name(model_key)}: huggingface_hub is not installed") from None
    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    if isinstance(found, str) and os.path.isfile(found):
        # The snapshot directory: a branch, a tag and the commit they name resolve to the same one.
        return os.path.realpath(Path(found).parent), revision
    raise UnknownModel(
        f"unknown model {display_name(model_key)}: not a local checkpoint dir and not in the Hugging Face cache "
        "(this control plane never downloads; put it in the cache or pass a directory)"
    )


def measure_size(checkpoint: str) -> tuple[int, str]:
    """(bytes of params + buffers, dtype name), building the model on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable config is the same answer
        raise UnknownModel(f"cannot read the config of {checkpoint}: {exc}") from None
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)  # type: ignore[no-untyped-call]
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return int(size), str(dtype).removeprefix("torch.")


def resolve(model_key: str, size_bytes: int | None = None, *, roots: ModelRoots | None = None) -> Registration:
    """Registration for an unregistered model; `size_bytes` overrides the measurement.

    With `roots` (a deploy a user's request asked for) only a model the operator offers resolves;
    anything else is `not_offered`, decided before a path outside the roots is even looked at."""
    if roots is None:
        return _resolve(model_key, size_bytes)
    _, repo, _ = model_parts(model_key)
    if repo.startswith("/") and not roots.holds(repo):
        raise not_offered(model_key)
    try:
        return _resolve(model_key, size_bytes)
    except Exception:  # noqa: BLE001 - missing, unreadable or unbuildable: the user learns none of it
        raise not_offered(model_key) from None


def _resolve(model_key: str, size_bytes: int | None) -> Registration:
    checkpoint, revision = find_checkpoint(model_key)
    if size_bytes is not None:
        return Registration(checkpoint=checkpoint, revision=revision, size_bytes=size_bytes, dtype="unknown")
    size, dtype = measure_size(checkpoint)
    return Registration(checkpoint=checkpoint, revision=revision, size_bytes=size, dtype=dtype)
