"""Model keys (pure): a mistyped name suggests the model it probably meant, among those the
service knows; one checkpoint is one model (what a load ignores is refused, a second key for a
registered checkpoint is its twin)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.decide import same_checkpoint
from controlplane.core.projections.cluster import ClusterState, ModelView, Registration
from schemas.errors import InvalidCommand
from schemas.keys import DEFAULT_MODEL_CLASS, canonical_model_key, closest_model


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


@pytest.mark.parametrize("key, why", [
    ('nnsight.modeling.language.LanguageModel:{"repo_id": "/m/tiny", "revision": "x1"}', "has no revision"),
    ('nnsight.modeling.language.LanguageModel:{"repo_id": "gpt2", "revision": null, "dispatch": true}',
     "'dispatch' not read by a load"),
    ('my.Other:{"repo_id": "gpt2", "revision": null}', "is not served"),
])
def test_what_a_load_ignores_is_refused_not_kept_as_another_model(key: str, why: str) -> None:
    with pytest.raises(InvalidCommand, match=why):
        canonical_model_key(key)


@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in ("repo_id", "revision")),
                       st.none() | st.booleans() | st.text(max_size=8), min_size=1, max_size=4))
def test_no_extra_field_makes_a_second_key(extra: dict[str, object]) -> None:
    with pytest.raises(InvalidCommand, match="not read by a load"):
        canonical_model_key(f"{DEFAULT_MODEL_CLASS}:{json.dumps({'repo_id': 'org/m', 'revision': None, **extra})}")


def test_a_second_key_for_a_registered_checkpoint_is_its_twin() -> None:
    state = ClusterState()
    first, second = canonical_model_key("/m/tiny"), canonical_model_key("/m/link")
    state.models[first] = ModelView(model_key=first, registration=Registration(checkpoint="/m/tiny", size_bytes=1))
    assert same_checkpoint(state, second, Registration(checkpoint="/m/tiny", size_bytes=1)) == first
    assert same_checkpoint(state, first, Registration(checkpoint="/m/tiny", size_bytes=1)) is None  # itself
    assert same_checkpoint(state, second, Registration(checkpoint="/m/other", size_bytes=1)) is None
