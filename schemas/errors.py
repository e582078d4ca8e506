"""The one error tree of ndif: every component raises these, adapters translate into them.

Attributes are keyword-only and read-only; `retryable` tells a caller whether the same call may
succeed later unchanged.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from schemas.guard import Refused, decode_guarded

T = TypeVar("T")


class NdifError(Exception):
    """Base of every ndif error. `str()` is one line a person can act on."""

    default_retryable = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self._set(retryable=self.default_retryable if retryable is None else retryable)

    def _set(self, **attrs: object) -> None:
        for name, value in attrs.items():
            object.__setattr__(self, "_" + name, value)

    def __setattr__(self, name: str, value: object) -> None:
        if name.startswith("__"):  # exception machinery (__traceback__, __cause__, ...)
            super().__setattr__(name, value)
            return
        raise AttributeError(f"{type(self).__name__}.{name} is read-only")

    def __reduce__(self) -> tuple[object, ...]:
        # Errors cross process boundaries (a replica's BadRequest travels back through Ray): rebuild
        # the same class with the same message and read-only attributes, bypassing __init__'s
        # per-class keyword arguments.
        attrs = {k[1:]: v for k, v in self.__dict__.items() if k.startswith("_") and not k.startswith("__")}
        return (_rebuild, (type(self), self.args, attrs))

    @property
    def retryable(self) -> bool:
        return bool(self._retryable)  # type: ignore[attr-defined]

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidCommand(NdifError, ValueError):
    """The input is wrong (bad count, malformed JSON, unknown flag combination); nothing was appended."""


class CommandIdConflict(InvalidCommand):
    """A command id already used for a different command (same id, different payload); nothing appended."""


class AlreadyDeployed(InvalidCommand):
    """`deploy` of a model that already has HOT replicas (use `scale`); nothing appended.

    Its own kind, so a caller for whom that is success (a dispatcher provisioning a model another
    one deployed first) tells it apart without reading the message."""


class OnDemandRefused(InvalidCommand):
    """A user's request may not make the cluster load its model (no right to, or the limit of models
    deployed on demand is reached); nothing was appended. The message says what to ask the operator."""


class NotFound(NdifError, LookupError):
    """A model, replica, node or request that does not exist."""


class UnknownModel(NotFound):
    """A model key that cannot be resolved offline (no local checkpoint dir, not in the HF cache)."""


class ConflictError(NdifError):
    """An optimistic-concurrency append lost: the log moved past `expected_last_seq`.

    Nothing of the append was stored. Fold the tail up to `actual_last_seq` and decide again.
    """

    default_retryable = True

    def __init__(self, message: str, *, expected_last_seq: int, actual_last_seq: int | None) -> None:
        super().__init__(message)
        self._set(expected_last_seq=expected_last_seq, actual_last_seq=actual_last_seq)

    @property
    def expected_last_seq(self) -> int:
        return int(self._expected_last_seq)  # type: ignore[attr-defined]

    @property
    def actual_last_seq(self) -> int | None:
        return self._actual_last_seq  # type: ignore[attr-defined,no-any-return]


class PlacementError(NdifError):
    """The cluster cannot hold what was asked (CANT_ACCOMMODATE)."""


class InfrastructureError(NdifError):
    """NATS, Ray or the disk failed or did not answer; usually worth retrying."""

    default_retryable = True


class LogRewound(InfrastructureError):
    """The log ends before what this reader already folded (a server restarted on a store that lost
    its tail, or a store restored from a backup): the fold holds events the log no longer does."""

    def __init__(self, message: str, *, folded_seq: int = 0, last_seq: int = 0) -> None:
        super().__init__(message)
        self._set(folded_seq=folded_seq, last_seq=last_seq)

    @property
    def folded_seq(self) -> int:
        return int(self._folded_seq)  # type: ignore[attr-defined]

    @property
    def last_seq(self) -> int:
        return int(self._last_seq)  # type: ignore[attr-defined]


class QuotaExceeded(InfrastructureError):
    """The server refused this account more of what it may hold at once (its connections): it
    holds its limit; one of its own clients must close first, or the operator raise the limit."""

    default_retryable = False


class InfrastructureTimeout(InfrastructureError, TimeoutError):
    """A call did not answer within its timeout; the outcome may be unknown."""


class ReplayAnomalyError(NdifError):
    """`replay --strict` found anomalies (out-of-order or impossible events) in the history."""

    def __init__(self, message: str, *, anomalies: tuple[object, ...]) -> None:
        super().__init__(message)
        self._set(anomalies=anomalies)

    @property
    def anomalies(self) -> tuple[object, ...]:
        return self._anomalies  # type: ignore[attr-defined,no-any-return]


def decode_bounded(decoder: msgspec.json.Decoder[T], data: bytes, *, limit: int, what: str) -> T:
    """Decode an untrusted body of at most `limit` bytes: whatever the bytes, the value or
    InvalidCommand with the reason (schemas/guard.py checks size, UTF-8 and nesting first)."""
    got = decode_guarded(decoder, data, limit=limit, what=what)
    if got.__class__ is Refused:
        raise InvalidCommand(got.reason)  # type: ignore[union-attr]
    return got  # type: ignore[return-value]


def _rebuild(cls: type[NdifError], args: tuple[object, ...], attrs: dict[str, object]) -> NdifError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err._set(**attrs)
    return err
