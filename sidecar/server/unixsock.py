"""The sidecar's unix socket: never reachable with wider permissions than ``--socket-mode``.

gRPC creates the socket file when it binds, with the process umask's mode
(typically 0755, or 0775 under umask 002); chmod'ing it after the server started
leaves a window in which others may connect. Setting the umask around the bind
would close it, but the umask is process-wide and other threads (uploads, the
metrics server) create files at the same time. So the socket is bound in a fresh
private directory (0700, from mkdtemp) beside its final path, chmod'ed to
``socket_mode`` there, and only then renamed into place: rename is atomic and
keeps the inode, so the listening socket appears at its path with its final mode,
and nobody can reach it before (the private directory admits only its owner).
The two paths are in one directory, so one filesystem, as rename needs.

The socket's directory is created 0700 (plus group/other search when
``socket_mode`` grants group/other access, or they could not reach the socket).
An existing directory keeps its read/search bits (it may be shared on purpose,
e.g. an emptyDir both containers mount), but loses group/other *write* (with
which anyone could replace the socket with their own) when it is ours and not
the shared-memory directory, where trainers must create their segments. What
was changed, or could not be, is logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)
#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


def directory_mode(socket_mode: int) -> int:
    """The mode a newly created socket directory gets: owner only, plus search where the socket is shared."""
    mode = 0o700
    if socket_mode & 0o070:
        mode |= 0o050
    if socket_mode & 0o007:
        mode |= 0o005
    return mode


def prepare_directory(directory: Path, socket_mode: int, shm_dir: str = "") -> None:
    """Create the socket's directory private, or take group/other write off an existing one."""
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)  # the umask can only narrow it
        os.chmod(directory, directory_mode(socket_mode))  # exact, whatever the umask
        return
    st = directory.stat()
    loose = stat.S_IMODE(st.st_mode) & 0o022
    if not loose:
        return
    mode = stat.S_IMODE(st.st_mode)
    same_as_shm = bool(shm_dir) and _same(directory, Path(shm_dir))
    if same_as_shm or st.st_uid != os.getuid() or st.st_mode & stat.S_ISVTX:
        why = (
            "it is also the shared-memory directory, where trainers create their segments"
            if same_as_shm
            else "it is another user's"
            if st.st_uid != os.getuid()
            else "it is sticky, so shared on purpose"
        )
        log.warning(
            "socket directory %s is writable by %s (mode %04o); leaving it as it is (%s), but whoever can "
            "write there can replace the socket: prefer a directory only this user can write",
            directory,
            "group and others" if loose == 0o022 else "its group" if loose == 0o020 else "others",
            mode,
            why,
        )
        return
    os.chmod(directory, mode & ~0o022)
    log.warning(
        "socket directory %s was writable by others (mode %04o): now %04o, so nobody else can replace "
        "the socket",
        directory,
        mode,
        mode & ~0o022,
    )


def bind_private(server: grpc.Server, path: Path, socket_mode: int) -> Callable[[], None]:
    """Bind ``server`` to a socket in a private directory beside ``path``, chmod'ed to ``socket_mode``.

    Returns ``publish``: call it once the server has started, to move the socket to ``path``.
    """
    private = Path(tempfile.mkdtemp(prefix=".s", dir=path.parent))  # 0700, ours
    staged = private / "s"
    if len(str(staged).encode()) > MAX_SOCKET_PATH_BYTES:
        private.rmdir()
        extra = len(str(staged).encode()) - MAX_SOCKET_PATH_BYTES
        raise ValueError(
            f"--socket {path}: binding needs {extra} more bytes than unix sockets allow "
            f"(a private directory beside it); use a path at least {extra} bytes shorter"
        )
    try:
        server.add_insecure_port(f"unix:{staged}")
        if staged.exists():
            os.chmod(staged, socket_mode)
    except BaseException:
        _discard(private)
        raise

    def publish() -> None:
        try:
            os.chmod(staged, socket_mode)  # again: the bind may create the file only when serving starts
            os.replace(staged, path)
        finally:
            _discard(private)

    return publish


def _discard(private: Path) -> None:
    for leftover in private.iterdir() if private.exists() else ():
        with contextlib.suppress(OSError):
            leftover.unlink()
    with contextlib.suppress(OSError):
        private.rmdir()


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
