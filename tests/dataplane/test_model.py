"""The plain replica class with real tiny checkpoints on this machine's device (CPU here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataplane.replica.model import BadRequest, ExecutionTimeout, ModelReplica, ReplicaNotHot
from tests.checkpoints import TinyModels

IDS = [[5, 17, 42, 7]]


@pytest.fixture(scope="module")
def ckpts(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"gpt2": tiny_models.gpt2(root / "gpt2"), "llama": tiny_models.llama(root / "llama")}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hot_warm_hot_cold_keeps_outputs(ckpts: dict[str, Path], name: str) -> None:
    r = ModelReplica(f"k-{name}", 0, str(ckpts[name]))
    assert r.level == "COLD"
    assert r.load((0,)) >= 0 and r.level == "HOT"
    first = r({"op": "forward", "input_ids": IDS})
    assert len(first["next_token_ids"]) == 1 and first["next_token_logprobs"][0] <= 0
    assert len(first["top"][0]) == 5 and first["top"][0][0][0] == first["next_token_ids"][0]

    cpu = r.to_cache()
    assert r.level == "WARM" and cpu == r.cpu_bytes() > 0
    with pytest.raises(ReplicaNotHot):
        r({"op": "forward", "input_ids": IDS})
    r.from_cache((0,))
    assert r.level == "HOT"
    assert r({"op": "forward", "input_ids": IDS}) == first  # same weights after the round trip

    other = ModelReplica(f"k-{name}", 1, str(ckpts[name]))
    other.load((0,))  # the same device: on CUDA, CPU and GPU kernels differ in the last bits
    assert other({"op": "forward", "input_ids": IDS}) == first  # replicas of one checkpoint agree

    r.unload()
    assert r.level == "COLD" and r.cpu_bytes() == 0
    with pytest.raises(ReplicaNotHot):
        r.to_cache()


def test_generate_prompt_and_module_outputs(ckpts: dict[str, Path]) -> None:
    r = ModelReplica("k", 0, str(ckpts["gpt2"]))
    r.load()
    out = r({"op": "generate", "input_ids": IDS, "max_new_tokens": 6})
    assert len(out["output_ids"][0]) == len(IDS[0]) + 6 and out["output_ids"][0][:4] == IDS[0]
    text = r({"op": "generate", "prompt": "hello", "max_new_tokens": 3})
    assert isinstance(text["text"][0], str) and text["text"][0].startswith("hello")
    res = r({"op": "forward", "input_ids": IDS, "modules": ["transformer.h.0", "transformer.h.1.mlp"]})
    assert res["modules"]["transformer.h.0"]["shape"] == [1, 4, 64]
    assert set(res["modules"]) == {"transformer.h.0", "transformer.h.1.mlp"}


@pytest.mark.parametrize("request_, match", [
    ({"op": "train"}, "unknown op"),
    ({"op": "forward"}, "needs input_ids"),
    ({"op": "forward", "input_ids": [[1, 2], [3]]}, "equally long"),
    ({"op": "forward", "input_ids": [[1, 5000]]}, r"ints in \[0, 1000\)"),
    ({"op": "forward", "input_ids": [[1, "a"]]}, "ints in"),
    ({"op": "generate", "input_ids": [[1]], "max_new_tokens": 0}, "max_new_tokens"),
    ({"op": "forward", "input_ids": [[1]], "modules": ["nope"]}, "unknown modules"),
    ({"op": "generate", "input_ids": [[1, 2, 3]], "max_new_tokens": 126}, "3 input tokens \\+ 126 new exceed the model's context of 128"),
    ({"op": "forward", "input_ids": [[1] * 129]}, "129 input tokens exceed the model's context of 128"),
])
def test_bad_requests_are_clear_errors_and_the_replica_keeps_serving(ckpts: dict[str, Path], request_: dict,
                                                                      match: str) -> None:
    r = ModelReplica("k", 0, str(ckpts["gpt2"]))
    r.load()
    with pytest.raises(BadRequest, match=match):
        r(request_)
    assert r({"op": "forward", "input_ids": IDS})["next_token_ids"]


def test_execution_timeout(ckpts: dict[str, Path]) -> None:
    r = ModelReplica("k", 0, str(ckpts["gpt2"]), execution_timeout_s=0.001)
    r.load()
    with pytest.raises(ExecutionTimeout, match="longer than"):
        r({"op": "forward", "input_ids": [[1] * 100] * 64})


def test_corrupt_checkpoint_fails_to_load_with_the_error(ckpts: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpts["gpt2"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": "sixty-four"}))
    r = ModelReplica("k", 0, str(bad))
    with pytest.raises(Exception) as info:
        r.load()
    assert str(info.value) and r.level == "COLD"


def test_run_batch_answers_each_request_on_its_own(ckpts: dict[str, Path]) -> None:
    """The dispatcher's batched call: one request's error never touches the others, and what the
    replica could not run once it left HOT comes back NOT_RUN (the dispatcher hands it on)."""
    from dataplane.replica.actor import ModelActor
    from dataplane.replica.wire import Completed, Failed, NotRun

    a = ModelActor("k", 0, str(ckpts["gpt2"]))
    a.load([])
    good = {"op": "forward", "input_ids": IDS}
    answers = a.run_batch([good, {"op": "nope"}, {"op": "echo", "data": 7}])
    assert [type(x) for x in answers] == [Completed, Failed, Completed]
    ok, bad, echo = answers
    assert isinstance(ok, Completed) and isinstance(bad, Failed) and isinstance(echo, Completed)
    assert ok.result == a(good) and echo.result["echo"] == 7
    assert bad.error == "BadRequest" and "unknown op" in bad.message
    assert min(ok.seconds, bad.seconds, echo.seconds) >= 0  # run seconds, for the batch budget
    a.to_cache()
    assert [type(x) for x in a.run_batch([good, good])] == [NotRun, NotRun]


def _card_bytes(model, dmap: dict[str, int]) -> dict[int, int]:
    """Bytes each card gets under a device map (tied tensors counted once, where first placed)."""
    mods = dict(model.named_modules())
    seen: set[int] = set()
    out: dict[int, int] = {}
    for name, card in dmap.items():
        for t in (*mods[name].parameters(), *mods[name].buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out[card] = out.get(card, 0) + t.numel() * t.element_size()
    return out


def _real_cards() -> int:
    import torch

    return torch.cuda.device_count() if ModelReplica.cuda_available() else 0


@pytest.mark.skipif(0 < _real_cards() < 4, reason="lays out over cards 0-3: declared ones (no CUDA) or 4 real ones")
def test_multi_card_device_map_keeps_to_the_charged_share_and_is_the_same_at_reload(ckpts: dict[str, Path]) -> None:
    """The layout on several (declared) cards budgets each card the share placement
    charged, not the card's whole memory; coming back from WARM (onto other cards) it is the same."""
    import math

    from dataplane.replica.model import device_map

    r = ModelReplica("k", 0, str(ckpts["llama"]))
    r.load(())
    size = r.cpu_bytes()
    r.unload()
    share = math.ceil(size * 1.15 / 2)  # what placement charges each of 2 cards (15% headroom)
    r.load((0, 1), share)
    first = r.device_map
    assert first is not None and set(first.values()) == {0, 1}
    per_card = _card_bytes(r.model, first)
    assert sum(per_card.values()) == size and max(per_card.values()) <= share
    all_tensors = {id(t) for t in (*r.model.parameters(), *r.model.buffers())}
    mods = dict(r.model.named_modules())
    assert {id(t) for n in first for t in (*mods[n].parameters(), *mods[n].buffers())} == all_tensors
    r.to_cache()
    r.from_cache((2, 3), share)
    assert r.device_map == {name: card + 2 for name, card in first.items()}  # same layout, other cards
    # A whole card's memory as the budget (the old reload) puts everything on the first card.
    assert set(device_map(r.model, (0, 1), 80 * 2**30).values()) == {0}
    with pytest.raises(Exception, match="do not fit"):
        device_map(r.model, (0, 1), size // 4)


def test_a_request_whose_weights_are_dropped_under_it_is_not_run_not_failed(ckpts: dict[str, Path]) -> None:
    """An unload (the agent's kill of a restarting replica unloads first) while a request runs: the
    request is reported not run (another replica takes it), never as the request's own error."""
    import threading
    import time

    r = ModelReplica("m", 0, str(ckpts["gpt2"]))
    r.load()
    real = r._run

    def slow_run(op, request):
        time.sleep(0.3)
        return real(op, request)

    r._run = slow_run  # type: ignore[method-assign]
    threading.Timer(0.1, r.unload).start()
    with pytest.raises(ReplicaNotHot, match="left HOT"):
        r({"op": "forward", "input_ids": [[1, 2, 3]]})
