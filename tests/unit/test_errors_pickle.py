"""Errors cross process boundaries (Ray returns a replica's BadRequest to the dispatcher) intact."""

from __future__ import annotations

import pickle

import pytest

from schemas import errors as errs


@pytest.mark.parametrize("err", [
    errs.InvalidCommand("bad count"),
    errs.UnknownModel("unknown model x"),
    errs.ConflictError("log moved", expected_last_seq=3, actual_last_seq=7),
    errs.InfrastructureTimeout("no controller"),
])
def test_errors_round_trip_through_pickle(err: errs.NdifError) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.retryable == err.retryable
    if isinstance(err, errs.ConflictError):
        assert (back.expected_last_seq, back.actual_last_seq) == (3, 7)
    with pytest.raises(AttributeError):
        back.message = "changed"  # still read-only
