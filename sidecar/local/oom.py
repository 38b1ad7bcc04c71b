"""Tell an OOM kill from any other SIGKILL: the memory cgroup's ``oom_kill`` counter.

A process the kernel's OOM killer ends exits by SIGKILL like one killed with
``kill -9``. What tells them apart is the counter the kernel keeps per memory
cgroup (and propagates to every ancestor): ``oom_kill`` in ``memory.events``
(cgroup v2) or in ``memory.oom_control`` (cgroup v1). The launcher reads it when
a rank starts and again when the rank dies by SIGKILL; a grown counter means the
OOM killer did it. Where no counter is readable (no cgroup filesystem, another
OS), :meth:`OomCounter.find` returns None and a SIGKILL stays a plain signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def read_oom_kills(path: Path | str) -> int | None:
    """The ``oom_kill`` count in a ``memory.events`` / ``memory.oom_control`` file; None if unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "oom_kill":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class OomCounter:
    """One cgroup's OOM-kill counter: the file it is read from and the cgroup's name, for messages."""

    path: Path
    cgroup: str

    def read(self) -> int | None:
        return read_oom_kills(self.path)

    @classmethod
    def find(
        cls, pid: int | str = "self", *, proc: Path = PROC, root: Path = CGROUP_ROOT
    ) -> OomCounter | None:
        """The counter of ``pid``'s memory cgroup, read from ``/proc/<pid>/cgroup``; None if none is readable.

        cgroup v2 (``0::<path>``) is tried first, then the v1 memory hierarchy. Inside a container
        whose cgroup paths are the host's (no cgroup namespace) the named directory is not mounted;
        the mount's own root, which is then the container's cgroup, is tried next.
        """
        try:
            lines = (proc / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        candidates: list[tuple[Path, str]] = []
        v1: list[tuple[Path, str]] = []
        for line in lines:
            hierarchy, _, rest = line.partition(":")
            controllers, _, cgroup = rest.partition(":")
            if not cgroup.startswith("/"):
                continue
            relative = cgroup.lstrip("/")
            if hierarchy == "0" and not controllers:
                candidates += [(root / relative / "memory.events", cgroup), (root / "memory.events", cgroup)]
            elif "memory" in controllers.split(","):
                mount = root / "memory"
                v1 += [
                    (mount / relative / "memory.oom_control", cgroup),
                    (mount / "memory.oom_control", cgroup),
                ]
        for path, cgroup in [*candidates, *v1]:
            if read_oom_kills(path) is not None:
                return cls(path, cgroup)
        return None
