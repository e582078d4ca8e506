"""A mistyped model name: the model it probably meant, among those the service knows (pure)."""

from __future__ import annotations

from schemas.keys import canonical_model_key, closest_model


def test_a_near_name_suggests_the_model_it_probably_meant() -> None:
    known = [canonical_model_key(k) for k in ("/models/tiny-llama", "openai-community/gpt2", "/models/tiny-gpt2")]
    assert closest_model("/models/tiny-lama", known) == known[0]  # a typo in a path
    assert closest_model("tiny-llama", known) == known[0]  # a short name
    assert closest_model("openai-community/gtp2", known) == known[1]
    assert closest_model("/models/tiny-llama", known) is None  # the model itself is no typo
    assert closest_model("something/else", known) is None
    assert closest_model("x" * 100_000, known) is None  # bounded: a huge name is cut before comparing


def test_a_client_is_matched_on_names_only_never_on_a_shared_directory() -> None:
    known = [canonical_model_key("/srv/models/tiny-llama")]
    assert closest_model("/srv/models", known, names_only=True) is None  # the root alone lists nothing
    assert closest_model("/srv/models/nope", known, names_only=True) is None
    assert closest_model("/srv/models/tiny-lama", known, names_only=True) == known[0]
