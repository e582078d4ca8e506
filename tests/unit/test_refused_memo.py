"""The dispatcher's memo of models the controller refused to deploy is bounded: its keys are model
names users send (a flood of distinct unknown names must not grow it without end)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dataplane.serving.dispatcher.provisioning import MAX_REFUSED_MEMO, _memo_put


def test_a_flood_of_names_keeps_the_memo_at_its_cap() -> None:
    memo: dict[str, tuple[float, str, str]] = {}
    for i in range(3 * MAX_REFUSED_MEMO):
        _memo_put(memo, f"model-{i}", (100.0 + i, "NotFound", "no such model"), now=float(i))
    assert len(memo) <= MAX_REFUSED_MEMO
    assert f"model-{3 * MAX_REFUSED_MEMO - 1}" in memo  # the newest refusal is kept


def test_expired_entries_go_before_live_ones() -> None:
    memo: dict[str, tuple[float, str, str]] = {"live": (50.0, "NotFound", "m"), "old": (5.0, "NotFound", "m")}
    _memo_put(memo, "new", (60.0, "NotFound", "m"), now=10.0, cap=2)
    assert set(memo) == {"live", "new"}


@given(st.lists(st.tuples(st.text(max_size=3), st.floats(0, 100), st.floats(0, 100)), max_size=60),
       st.integers(1, 8))
def test_never_above_cap_and_the_last_put_is_kept(puts: list[tuple[str, float, float]], cap: int) -> None:
    memo: dict[str, tuple[float, str, str]] = {}
    for key, until, now in puts:
        _memo_put(memo, key, (until, "E", "m"), now, cap)
        assert len(memo) <= cap
        assert memo[key] == (until, "E", "m")
