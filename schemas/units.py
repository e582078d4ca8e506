"""Memory sizes: bytes on the wire and in events; GiB (2**30 bytes) wherever a person reads or types one."""

from __future__ import annotations

GiB = 2**30


def gib(n: int) -> str:
    """`n` bytes for people, in GiB: two decimals, three significant digits under 1 GiB."""
    v = n / GiB
    return f"{v:,.2f} GiB" if abs(v) >= 1 else f"{v:.3g} GiB"


__all__ = ["GiB", "gib"]
