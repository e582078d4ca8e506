"""Listing an Object Store bucket: one `multi_last` get, else (too many subjects) the scan."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from controlplane.store import direct
from controlplane.store.direct import DirectMsg, TooManyResults, object_names


def meta(seq: int, name: str, *, deleted: bool = False) -> DirectMsg:
    return DirectMsg(seq=seq, subject=f"$O.b.M.{seq}", data=msgspec.json.encode({"name": name, "deleted": deleted}))


METAS = [meta(1, "a"), meta(3, "gone", deleted=True), DirectMsg(seq=5, subject="$O.b.M.x", data=b"{"), meta(7, "b")]


async def test_one_multi_last_get(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, Any]] = []

    async def fake(nc: Any, stream: str, seq: int, batch: int = 0, **kw: Any) -> list[DirectMsg]:
        asked.append(kw)
        return METAS

    monkeypatch.setattr(direct, "direct_batch", fake)
    assert await object_names(None, "b") == ["a", "b"]
    assert [k.get("multi_last") for k in asked] == ["$O.b.M.>"]


@pytest.mark.parametrize("too_many", ["413", "a full batch"])
async def test_the_scan_when_the_server_will_not_answer_that_many(monkeypatch: pytest.MonkeyPatch, too_many: str) -> None:
    asked: list[tuple[int, dict[str, Any]]] = []

    async def fake(nc: Any, stream: str, seq: int, batch: int = 0, **kw: Any) -> list[DirectMsg]:
        asked.append((seq, kw))
        if kw.get("multi_last"):
            if too_many == "413":
                raise TooManyResults("too many")
            return [meta(i, f"m{i}") for i in range(1, direct.MAX_BATCH + 1)]
        return [m for m in METAS if m.seq >= seq]

    monkeypatch.setattr(direct, "direct_batch", fake)
    assert await object_names(None, "b") == ["a", "b"]
    assert [(s, k.get("next_by_subj")) for s, k in asked[1:]] == [(1, "$O.b.M.>")]
