"""Client settings: constructor arguments, then environment, then defaults.

Identity comes from the environment the launcher (torchrun, ``strata
launch``, the Kubernetes webhook) sets: ``RANK``/``WORLD_SIZE`` are honoured,
``STRATA_*`` variables win over them.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from sidecar.api import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES, default_socket_path

RESUME_POLICIES = ("auto", "never", "require")
BUSY_POLICIES = ("skip", "wait")
SHM_POLICIES = ("auto", "on", "off")
OVERLAP_POLICIES = ("auto", "off")
REPLICA_POLICIES = ("auto", "off")


def _torchelastic_generation() -> str | None:
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run else None


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


@dataclass
class ClientSettings:
    job: str = ""
    namespace: str = "default"
    rank: int = 0
    world_size: int = 1
    attempt: int = 0
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
        env: dict[str, Any] = {
            "job": _env("STRATA_JOB"),
            "namespace": _env("STRATA_NAMESPACE", "POD_NAMESPACE"),
            "rank": _env("STRATA_RANK", "RANK"),
            "world_size": _env("STRATA_WORLD_SIZE", "WORLD_SIZE"),
            "attempt": _env("STRATA_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"),
            "generation": _env("STRATA_GENERATION") or _torchelastic_generation(),
            "socket": _env("STRATA_SOCKET"),
            "address": _env("STRATA_ADDRESS"),
            "token": _env("STRATA_TOKEN"),
            "resume": _env("STRATA_RESUME"),
            "when_busy": _env("STRATA_WHEN_BUSY"),
            "shm": _env("STRATA_SHM"),
            "overlap": _env("STRATA_OVERLAP"),
            "replicas": _env("STRATA_REPLICAS"),
            "chunk_bytes": _env("STRATA_CHUNK_BYTES"),
            "max_message_bytes": _env("STRATA_MAX_MESSAGE_BYTES"),
            "commit_timeout_s": _env("STRATA_COMMIT_TIMEOUT_S"),
            "save_on_sigterm": _env("STRATA_SAVE_ON_SIGTERM_S"),
        }
        values: dict[str, Any] = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for name, raw in env.items():
            if raw is None:
                continue
            kind = str(kinds[name]).removesuffix(" | None")
            try:
                values[name] = int(raw) if kind == "int" else float(raw) if kind == "float" else raw
            except ValueError:
                raise ValueError(f"{name}: cannot parse {raw!r} from the environment as {kind}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        if not settings.generation and settings.world_size == 1:
            settings.generation = f"solo-{uuid.uuid4().hex[:16]}/0"
        settings.validate()
        return settings

    def validate(self) -> None:
        if not self.job:
            raise ValueError("no job name: set STRATA_JOB or pass job=... to CheckpointClient")
        if self.resume not in RESUME_POLICIES:
            raise ValueError(f"resume={self.resume!r}: expected one of {', '.join(RESUME_POLICIES)}")
        if self.when_busy not in BUSY_POLICIES:
            raise ValueError(f"when_busy={self.when_busy!r}: expected one of {', '.join(BUSY_POLICIES)}")
        if self.shm not in SHM_POLICIES:
            raise ValueError(f"shm={self.shm!r}: expected one of {', '.join(SHM_POLICIES)}")
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(f"overlap={self.overlap!r}: expected one of {', '.join(OVERLAP_POLICIES)}")
        if self.replicas not in REPLICA_POLICIES:
            raise ValueError(f"replicas={self.replicas!r}: expected one of {', '.join(REPLICA_POLICIES)}")
        if self.shm == "on" and self.address:
            raise ValueError("shm='on' needs the unix socket: a TCP sidecar may be on another host")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.address and not self.token:
            raise ValueError("a TCP sidecar address needs a token (STRATA_TOKEN)")
        if self.save_on_sigterm is not None and not self.save_on_sigterm >= 0:
            raise ValueError(f"save_on_sigterm={self.save_on_sigterm!r}: expected seconds >= 0 or None")
        if not 0 < self.chunk_bytes < self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must be below max_message_bytes")

    @property
    def target(self) -> str:
        return self.address or f"unix:{self.socket}"
