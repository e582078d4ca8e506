"""One JetStream store, one cluster: the store lock refuses a second holder and names the first."""

from __future__ import annotations

import os

import pytest

from controlplane.ops.nats_server import StoreInUse, StoreLock


def test_a_second_holder_is_refused_with_the_first_ones_pid_and_port(tmp_path):
    first = StoreLock(tmp_path)
    first.acquire(4222)
    with pytest.raises(StoreInUse) as exc:
        StoreLock(tmp_path).acquire(4223)
    assert f"pid {os.getpid()}, port 4222" in str(exc.value)
    assert "another NDIF_HOME" in str(exc.value) and "--port" in str(exc.value)
    first.release()
    again = StoreLock(tmp_path)
    again.acquire(4224)  # free once the holder let go
    again.release()


def test_the_lock_file_is_private(tmp_path):
    lock = StoreLock(tmp_path)
    lock.acquire(1)
    assert (tmp_path / StoreLock.NAME).stat().st_mode & 0o077 == 0
    lock.release()
