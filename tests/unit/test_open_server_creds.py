"""Local credentials go only where they belong: a server this process runs without users gets none,
whatever an earlier `ndif up` left in `$NDIF_HOME/auth/` or `NDIF_CREDS` names."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.ops.auth import ensure_local
from controlplane.store.credentials import creds_file, mark_open, resolve


def test_a_server_run_open_gets_no_local_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    ensure_local(["vm"], home=home)
    monkeypatch.setenv("NDIF_HOME", str(home))
    monkeypatch.delenv("NDIF_CREDS", raising=False)
    users_url, open_url = "nats://127.0.0.1:14001", "nats://127.0.0.1:14002"
    assert resolve("dashboard", url=users_url) is not None  # an `ndif up` with users: its files are found
    mark_open(open_url)
    assert resolve("dashboard", url=open_url) is None
    assert resolve("client", url=open_url) is None
    monkeypatch.setenv("NDIF_CREDS", str(creds_file("admin", home=home)))
    assert resolve("admin", url=open_url) is None  # not even the file NDIF_CREDS names
    assert resolve("admin", url=users_url) is not None
