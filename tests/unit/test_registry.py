"""Offline model resolution: local checkpoint dirs and the Hugging Face cache, sizes on the meta device."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from controlplane.service.registry import find_checkpoint, resolve
from schemas.errors import UnknownModel
from schemas.keys import canonical_model_key, display_name
from tests.checkpoints import TinyModels


@pytest.fixture(scope="module")
def ckpts(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    tiny_models.gpt2(root / "gpt2")
    tiny_models.llama(root / "llama")
    return root


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_size_measured_on_meta_equals_the_loaded_model(ckpts: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    reg = resolve(canonical_model_key(str(ckpts / name)))
    model = AutoModelForCausalLM.from_pretrained(ckpts / name)
    real = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert reg.size_bytes == real
    assert reg.dtype == "float32"
    assert reg.checkpoint == str(ckpts / name)


def test_size_override_skips_measuring(ckpts: Path) -> None:
    reg = resolve(canonical_model_key(str(ckpts / "gpt2")), size_bytes=40 * 10**9)
    assert reg.size_bytes == 40 * 10**9


def test_hf_cache_layout_is_found_offline(ckpts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(ckpts / "gpt2", snap)
    (cache / "models--acme--tiny" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    path, rev = find_checkpoint(canonical_model_key("acme/tiny"))
    assert Path(path) == snap and rev is None
    assert resolve(canonical_model_key("acme/tiny")).size_bytes > 0


def test_unknown_models_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="never downloads"):
        find_checkpoint(canonical_model_key("nobody/nothing-here"))
    with pytest.raises(UnknownModel, match=r"no config\.json"):
        find_checkpoint(canonical_model_key(str(tmp_path)))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnknownModel, match="cannot read the config"):
        resolve(canonical_model_key(str(tmp_path)))


# ---- a deploy a request asked for: only what the operator offers --------------------------------


def test_a_requests_model_resolves_only_under_the_operators_roots(tiny_models: TinyModels, ckpts: Path, tmp_path: Path) -> None:
    from controlplane.service.registry import ModelRoots

    roots = ModelRoots((str(ckpts),))
    assert resolve(canonical_model_key(str(ckpts / "gpt2")), roots=roots).checkpoint == str(ckpts / "gpt2")
    elsewhere = tmp_path / "elsewhere"
    tiny_models.gpt2(elsewhere / "gpt2")  # a real checkpoint, not under the roots
    (tmp_path / "empty").mkdir()
    asked = [str(elsewhere / "gpt2"), str(tmp_path / "empty"), str(tmp_path / "missing"), "/etc", "/",
             str(ckpts / "missing"), str(ckpts / ".." / "elsewhere"), str(ckpts) + "-sibling/gpt2"]
    answers = []
    for path in asked:
        key = canonical_model_key(path)
        with pytest.raises(UnknownModel) as exc:
            resolve(key, roots=roots)
        answers.append(str(exc.value).replace(display_name(key), "<model>"))
    # One answer, whatever exists: nothing about which directories exist or hold a config.
    assert len(set(answers)) == 1, answers
    assert "not a model this service offers" in answers[0]
    for word in ("exist", "config", "directory", "cache"):
        assert word not in answers[0]
    # The operator's own deploy is not limited to the roots, and says why a path does not resolve.
    assert resolve(canonical_model_key(str(elsewhere / "gpt2"))).checkpoint == str(elsewhere / "gpt2")
    with pytest.raises(UnknownModel, match=r"has no config\.json"):
        resolve(canonical_model_key(str(tmp_path / "empty")))


def test_the_model_roots_come_from_the_environment(tmp_path: Path) -> None:
    from controlplane.service.registry import ModelRoots

    assert ModelRoots.from_env({"NDIF_HOME": str(tmp_path)}).roots == (str(tmp_path / "models"),)
    two = ModelRoots.from_env({"NDIF_MODEL_ROOTS": f"{tmp_path / 'a'}:{tmp_path / 'b'}/"})
    assert two.roots == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert two.holds(str(tmp_path / "b" / "m")) and not two.holds(str(tmp_path / "bb" / "m"))
    assert not two.holds(str(tmp_path))
