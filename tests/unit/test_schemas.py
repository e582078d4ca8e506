"""Model keys, subject tokens, commands and the skipping of unreadable bodies."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.commands import Deploy, Evict, Scale, decode_command
from schemas.errors import InvalidCommand
from schemas.events import Skipped, decode_or_skip
from schemas.keys import canonical_model_key, display_name
from schemas.subjects import model_token, node_token, replica_subject

GPT2 = 'nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}'
TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def test_canonical_forms_agree():
    assert canonical_model_key("openai-community/gpt2") == GPT2
    assert canonical_model_key(' nnsight.modeling.language.LanguageModel:{"revision": null, '
                               '"repo_id": "openai-community/gpt2"} ') == GPT2
    assert canonical_model_key("gpt2@v1.0") == (
        'nnsight.modeling.language.LanguageModel:{"repo_id": "gpt2", "revision": "v1.0"}')
    assert '"repo_id": "/ckpt/tiny"' in canonical_model_key("/ckpt/tiny/")
    assert display_name(GPT2) == "openai-community/gpt2"


@pytest.mark.parametrize("bad", ["", "   ", "a b c", "Class:{not json}", 'Class:{"revision": "x"}', "x@"])
def test_bad_keys_are_invalid_commands(bad):
    with pytest.raises(InvalidCommand):
        canonical_model_key(bad)


@given(st.text(min_size=1, max_size=200))
def test_tokens_are_subject_safe_and_keyed_by_the_full_text(text):
    tok = model_token(text)
    assert TOKEN.match(tok), tok
    assert model_token(text) == tok
    assert TOKEN.match(node_token(text))
    assert model_token(text + "x") != tok


def test_ndif_json_key_token_is_readable():
    tok = model_token(GPT2)
    assert tok.startswith("openai-community_gpt2-") and len(tok.rsplit("-", 1)[1]) == 10
    assert replica_subject(GPT2, 3) == f"ndif.evt.replica.{tok}.3"


def test_commands_validate():
    assert decode_command(msgspec.json.encode(Deploy(command_id="c", model_key="m", replicas=2))).replicas == 2
    with pytest.raises(InvalidCommand, match="at least 1"):
        decode_command(msgspec.json.encode(Scale(command_id="c", model_key="m", replicas=0)))
    with pytest.raises(InvalidCommand, match=r"at least 1, got -1 .*scale-down"):  # the same words below 0
        decode_command(msgspec.json.encode(Scale(command_id="c", model_key="m", replicas=-1)))
    with pytest.raises(InvalidCommand, match="0 or more"):
        decode_command(b'{"verb": "scale-down", "command_id": "c", "model_key": "m", "replicas": -1}')
    with pytest.raises(InvalidCommand, match="malformed"):
        decode_command(b"{nope")
    with pytest.raises(InvalidCommand, match="malformed"):
        decode_command(b'{"verb": "explode", "command_id": "c"}')
    with pytest.raises(InvalidCommand, match="give a model"):
        decode_command(msgspec.json.encode(Evict(command_id="c")))


def test_unreadable_bodies_become_skipped_with_a_reason():
    assert "malformed" in decode_or_skip(b"\x00garbage").reason
    newer = decode_or_skip(b'{"type": "ReplicaTeleported", "event_id": "x"}')
    assert isinstance(newer, Skipped) and newer.type == "ReplicaTeleported" and "newer version" in newer.reason
    assert isinstance(decode_or_skip(b"[1, 2]"), Skipped)
