"""Client settings: constructor arguments, then environment, then defaults.

Identity comes from the environment the launcher (torchrun, ``strata
launch``, the Kubernetes webhook) sets: ``RANK``/``WORLD_SIZE`` are honoured,
``STRATA_*`` variables win over them.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from sidecar.api import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES, default_socket_path, envvars, sizes

log = logging.getLogger("strata.client")

RESUME_POLICIES = ("auto", "never", "require")
BUSY_POLICIES = ("skip", "wait")
SHM_POLICIES = ("auto", "on", "off")
STAGING_POLICIES = ("auto", "1", "2")
OVERLAP_POLICIES = ("auto", "off")
REPLICA_POLICIES = ("auto", "off")


def _torchelastic_generation() -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run else None


def _env(*names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set, and its value."""
    for name in names:
        if os.environ.get(name):
            return name, os.environ[name]
    return None


def _torchelastic_generation_var() -> tuple[str, str] | None:
    generation = _torchelastic_generation()
    return ("TORCHELASTIC_RUN_ID", generation) if generation else None


#: Settings in bytes, also read with units (``STRATA_CHUNK_BYTES=4MiB``).
SIZE_FIELDS = frozenset({"chunk_bytes", "max_message_bytes"})

#: Misspelt variables are warned of once per process, not at every client.
_warned: set[str] = set()


@dataclass
class ClientSettings:
    job: str = ""
    namespace: str = "default"
    rank: int = 0
    world_size: int = 1
    #: gang restarts before this run of the trainer (STRATA_RESTART; torchrun's restart count).
    #: Not the attempt: storage allocates that, one per generation, and the EPOCH records it
    restart: int = 0
    #: gang generation "RUN/RESTART" (STRATA_GENERATION; torchrun's run id and restart count); a
    #: single rank without one gets a generation of its own per process
    generation: str = ""
    #: unix socket of the sidecar; ignored when ``address`` is set
    socket: str = field(default_factory=default_socket_path)
    #: host:port of a TCP sidecar (needs ``token``)
    address: str = ""
    token: str = ""
    resume: str = "auto"
    when_busy: str = "skip"
    #: shared-memory saves: "auto" (when the sidecar offers them on this host), "on" (required), "off"
    shm: str = "auto"
    #: shared-memory staging segments: "1" (the committed snapshot the sidecar keeps is the one
    #: segment, given back to the client before the next save stages into it), "2" (the next save
    #: stages into the other one: the held copy stays while it does), "auto" (what the sidecar
    #: suggests: 1, or 2 where it pushes copies to peers)
    staging_buffers: str = "auto"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    connect_timeout_s: float = 30.0
    rpc_timeout_s: float = 600.0
    commit_timeout_s: float = 900.0
    capture_rng: bool = True
    #: overlapped staging: "auto" (the optimizers found in the saved state stage in the background,
    #: their step() waiting for the copy), "off" (only those passed as ``optimizers=``)
    overlap: str = "auto"
    #: seconds a save after SIGTERM may take, counted from the signal (STRATA_SAVE_ON_SIGTERM_S);
    #: None: SIGTERM is left alone (see CheckpointClient)
    save_on_sigterm: float | None = None
    #: replica-aware saves: "auto" (a tensor replicated across a data-parallel group, found from the
    #: DDP wrappers in the state or declared with replicate(), is saved by one rank of the group),
    #: "off" (every rank saves everything)
    replicas: str = "auto"

    @classmethod
    def from_env(cls, **overrides: Any) -> ClientSettings:
        env: dict[str, tuple[str, str] | None] = {
            "job": _env("STRATA_JOB"),
            "namespace": _env("STRATA_NAMESPACE", "POD_NAMESPACE"),
            "rank": _env("STRATA_RANK", "RANK"),
            "world_size": _env("STRATA_WORLD_SIZE", "WORLD_SIZE"),
            # STRATA_ATTEMPT: this variable's older name, still read
            "restart": _env("STRATA_RESTART", "STRATA_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"),
            "generation": _env("STRATA_GENERATION") or _torchelastic_generation_var(),
            "socket": _env("STRATA_SOCKET"),
            "address": _env("STRATA_ADDRESS"),
            "token": _env("STRATA_TOKEN"),
            "resume": _env("STRATA_RESUME"),
            "when_busy": _env("STRATA_WHEN_BUSY"),
            "shm": _env("STRATA_SHM"),
            "staging_buffers": _env("STRATA_STAGING_BUFFERS"),
            "overlap": _env("STRATA_OVERLAP"),
            "replicas": _env("STRATA_REPLICAS"),
            "chunk_bytes": _env("STRATA_CHUNK_BYTES"),
            "max_message_bytes": _env("STRATA_MAX_MESSAGE_BYTES"),
            "commit_timeout_s": _env("STRATA_COMMIT_TIMEOUT_S"),
            "save_on_sigterm": _env("STRATA_SAVE_ON_SIGTERM_S"),
        }
        for warning in envvars.unknown(os.environ):
            if warning not in _warned:
                _warned.add(warning)
                log.warning("%s", warning)
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for name, found in env.items():
            if found is None or overrides.get(name) is not None:
                continue
            variable, raw = found
            kind = str(kinds[name]).removesuffix(" | None")
            try:
                if name in SIZE_FIELDS:
                    values[name] = sizes.parse_size(raw)
                else:
                    values[name] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
            except ValueError as exc:
                if name in SIZE_FIELDS:
                    raise ValueError(f"{variable}={raw!r}: {exc}") from None
                article = "an" if kind == "int" else "a"
                raise ValueError(f"{variable}={raw!r}: expected {article} {kind}") from None
            sources[name] = variable
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        if not settings.generation and settings.world_size == 1:
            settings.generation = f"solo-{uuid.uuid4().hex[:16]}/0"
        settings.validate(sources)
        return settings

    def validate(self, sources: dict[str, str] | None = None) -> None:
        """Raise ValueError naming what is wrong: the environment variable a value came from
        (``sources``: field -> variable), else the argument."""
        where = sources or {}
        self.staging_buffers = str(self.staging_buffers)  # 1 and "1" alike

        def name(field_name: str) -> str:
            return where.get(field_name, field_name)

        for field_name in sorted(SIZE_FIELDS):  # chunk_bytes="4MiB" as an argument, too
            value = getattr(self, field_name)
            if isinstance(value, str):
                try:
                    setattr(self, field_name, sizes.parse_size(value))
                except ValueError as exc:
                    raise ValueError(f"{name(field_name)}={value!r}: {exc}") from None
        if not self.job:
            raise ValueError("no job name: set STRATA_JOB or pass job=... to CheckpointClient")
        for field_name, allowed in (
            ("resume", RESUME_POLICIES),
            ("when_busy", BUSY_POLICIES),
            ("shm", SHM_POLICIES),
            ("staging_buffers", STAGING_POLICIES),
            ("overlap", OVERLAP_POLICIES),
            ("replicas", REPLICA_POLICIES),
        ):
            value = getattr(self, field_name)
            if value not in allowed:
                raise ValueError(f"{name(field_name)}={value!r}: expected one of {', '.join(allowed)}")
        if self.shm == "on" and self.address:
            raise ValueError(
                f"{name('shm')}='on' needs the unix socket: a TCP sidecar may be on another host"
            )
        if self.world_size < 1:
            raise ValueError(f"{name('world_size')}={self.world_size}: expected at least 1")
        if not 0 <= self.rank < self.world_size:
            from_env = "rank" in where or "world_size" in where
            raise ValueError(
                f"rank {self.rank} is outside world size {self.world_size}"
                + (
                    f" ({name('rank')}={self.rank}, {name('world_size')}={self.world_size})"
                    if from_env
                    else ""
                )
            )
        if self.address and not self.token:
            raise ValueError("a TCP sidecar address needs a token (STRATA_TOKEN)")
        for field_name in ("connect_timeout_s", "rpc_timeout_s", "commit_timeout_s"):
            value = getattr(self, field_name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name(field_name)}={value!r}: expected positive seconds")
        if self.save_on_sigterm is not None and not 0 <= self.save_on_sigterm < math.inf:
            raise ValueError(
                f"{name('save_on_sigterm')}={self.save_on_sigterm!r}: expected seconds >= 0 or None"
            )
        if not 0 < self.chunk_bytes < self.max_message_bytes:
            raise ValueError(
                f"{name('chunk_bytes')} {self.chunk_bytes} must be below "
                f"{name('max_message_bytes')} ({self.max_message_bytes})"
            )

    @property
    def target(self) -> str:
        return self.address or f"unix:{self.socket}"
