"""A full shared-memory tmpfs is reported with the sizing rule, not as a bare ENOSPC."""

from __future__ import annotations

import errno
import os

import pytest

from trainer_client._staging import SharedSegment


def test_full_tmpfs_names_the_sizing_rule(tmp_path, monkeypatch):
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(
        OSError, match=r"is full: no room for a 4096-byte staging segment.*one segment"
    ) as err:
        SharedSegment(str(tmp_path), "strata-x-0", 4096)
    assert err.value.errno == errno.ENOSPC
    assert "sizeLimit" in str(err.value) and "trainer's memory limit" in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_other_errors_pass_through(tmp_path, monkeypatch):
    def broken(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="I/O error"):
        SharedSegment(str(tmp_path), "strata-x-1", 4096)
