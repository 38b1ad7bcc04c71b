"""The sidecar's unix socket is never reachable more widely than --socket-mode, at any moment,
and its directory is private (or at least not writable by others)."""

from __future__ import annotations

import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from sidecar.server import unixsock


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def watch_bind(monkeypatch):
    """Record, the moment gRPC creates the socket and the moment it is published, who could reach it."""
    seen: list[dict[str, object]] = []
    server_class = type(grpc.server(ThreadPoolExecutor(1)))
    real_add = server_class.add_insecure_port
    real_replace = unixsock.os.replace

    def add(self, address):
        port = real_add(self, address)
        if address.startswith("unix:"):
            bound = Path(address.removeprefix("unix:"))
            seen.append({"when": "bind", "path": bound, "mode": mode(bound), "dir": mode(bound.parent)})
        return port

    def replace(src, dst):
        if stat.S_ISSOCK(os.lstat(src).st_mode):  # os.replace is everyone's: only sockets matter here
            seen.append(
                {"when": "publish", "path": Path(dst), "mode": mode(Path(src)), "dir": mode(Path(src).parent)}
            )
        real_replace(src, dst)

    monkeypatch.setattr(server_class, "add_insecure_port", add)
    monkeypatch.setattr(unixsock.os, "replace", replace)
    return seen


def test_socket_in_a_pre_existing_0755_directory(make_sidecar, short_tmp, watch_bind):
    previous = os.umask(0o002)  # a permissive umask: a socket created in place would be 0775
    try:
        shared = short_tmp / "pub"
        shared.mkdir()
        os.chmod(shared, 0o755)
        server = make_sidecar(socket=str(shared / "s.sock"))
    finally:
        os.umask(previous)
    sock = Path(server.socket_path)
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode(sock) == 0o600
    assert mode(shared) == 0o755  # not writable by others: left as the user made it
    assert os.listdir(shared) == ["s.sock"]  # the private bind directory is gone
    bind, publish = watch_bind
    # While others could have reached its directory, the socket did not exist at its path; where
    # it was bound only its owner could enter, and it had its final mode before it was moved.
    assert bind["when"] == "bind" and bind["path"] != sock and bind["dir"] == 0o700
    assert bind["path"].parent.parent == shared
    assert publish["when"] == "publish" and publish["path"] == sock and publish["mode"] == 0o600


def test_a_new_directory_is_private_and_a_group_socket_gets_group_search(make_sidecar, short_tmp):
    base = short_tmp / "base"
    base.mkdir()
    os.chmod(base, 0o755)
    server = make_sidecar(socket=str(base / "new" / "s.sock"))
    assert mode(base / "new") == 0o700 and mode(Path(server.socket_path)) == 0o600
    group = make_sidecar(socket=str(base / "grp" / "s.sock"), socket_mode=0o660)
    assert mode(base / "grp") == 0o750 and mode(Path(group.socket_path)) == 0o660


def test_a_world_writable_directory_loses_its_write_bits(make_sidecar, short_tmp, caplog):
    loose = short_tmp / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with caplog.at_level(logging.WARNING, logger="sidecar.server.unixsock"):
        server = make_sidecar(socket=str(loose / "s.sock"))
    assert mode(loose) == 0o755 and mode(Path(server.socket_path)) == 0o600
    assert any("was writable by others (mode 0777): now 0755" in r.getMessage() for r in caplog.records)


def test_the_shared_memory_directory_is_left_writable(make_sidecar, short_tmp, caplog):
    shm = short_tmp / "shm-and-socket"
    shm.mkdir()
    os.chmod(shm, 0o777)  # trainers of other users create their segments here
    with caplog.at_level(logging.WARNING, logger="sidecar.server.unixsock"):
        server = make_sidecar(socket=str(shm / "s.sock"), shm_dir=str(shm))
    assert mode(shm) == 0o777 and mode(Path(server.socket_path)) == 0o600
    assert any("shared-memory directory" in r.getMessage() for r in caplog.records)


def test_a_socket_path_with_no_room_for_the_private_directory_is_refused(short_tmp):
    deep = short_tmp / ("d" * (unixsock.MAX_SOCKET_PATH_BYTES - len(str(short_tmp)) - 4))
    deep.mkdir()
    path = deep / "s"  # fits in 107 bytes, but its private twin does not
    assert len(str(path).encode()) <= unixsock.MAX_SOCKET_PATH_BYTES
    server = grpc.server(ThreadPoolExecutor(1))
    with pytest.raises(ValueError, match="bytes shorter"):
        unixsock.bind_private(server, path, 0o600)
    assert os.listdir(deep) == []
