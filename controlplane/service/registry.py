"""Resolving a model key offline: where its checkpoint is and how big it is (docs/architecture.md §3).

Only local sources: an absolute checkpoint directory, or the Hugging Face cache. Never the hub
(there may be none, and a control plane must not block on one). The size is params + buffers of
the model built on the meta device (nothing is allocated), in the checkpoint's dtype. torch and
transformers are imported lazily: the CLI and the projections never pay for them.
"""

from __future__ import annotations

import os
from pathlib import Path

from controlplane.core.projections.cluster import Registration
from schemas.errors import UnknownModel
from schemas.keys import display_name, model_parts


def find_checkpoint(model_key: str) -> tuple[str, str | None]:
    """(checkpoint directory, revision) for a canonical key, or UnknownModel."""
    _, repo, revision = model_parts(model_key)
    if repo.startswith("/"):
        if (Path(repo) / "config.json").is_file():
            return repo, revision
        why = "has no config.json" if Path(repo).is_dir() else "does not exist on the controller's machine"
        raise UnknownModel(f"unknown model {display_name(model_key)}: {repo} {why}")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        raise UnknownModel(f"unknown model {display_name(model_key)}: huggingface_hub is not installed") from None
    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    if isinstance(found, str) and os.path.isfile(found):
        return str(Path(found).parent), revision
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


def resolve(model_key: str, size_bytes: int | None = None) -> Registration:
    """Registration for an unregistered model; `size_bytes` overrides the measurement."""
    checkpoint, revision = find_checkpoint(model_key)
    if size_bytes is not None:
        return Registration(checkpoint=checkpoint, revision=revision, size_bytes=size_bytes, dtype="unknown")
    size, dtype = measure_size(checkpoint)
    return Registration(checkpoint=checkpoint, revision=revision, size_bytes=size, dtype=dtype)
