"""The wire contract shared by the trainer client and the sidecar.

Generated protobuf/gRPC modules live in ``sidecar.api.strata.v1`` (``make
proto`` regenerates them). The hand-written modules beside them hold the few
constants both sides must agree on. This package must stay importable without
torch and without the rest of the sidecar.
"""

import os
from pathlib import Path

from sidecar.api.strata.v1 import strata_pb2 as pb
from sidecar.api.strata.v1 import strata_pb2_grpc as pb_grpc

#: Bumped on wire changes. 2: Identity.generation, the Attach stream, the Peer service.
PROTOCOL_VERSION = 2
#: The oldest client protocol the sidecar still serves (one release back, for rolling
#: upgrades); it refuses anything outside MIN_PROTOCOL_VERSION..PROTOCOL_VERSION.
MIN_PROTOCOL_VERSION = 1
#: gRPC metadata key carrying the shared token on TCP connections.
TOKEN_METADATA_KEY = "x-strata-token"
#: Default largest gRPC message on both ends (chunks are smaller).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Default chunk the client cuts the byte stream into.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: Reserved trainer exit codes, for a Job's podFailurePolicy (onExitCodes with the trainer's
#: containerName): a peer died, the gang restarts (Ignore); Strata's restart limit is spent (FailJob).
EXIT_PEER_DIED = 75
EXIT_LIMIT_SPENT = 76
#: The trainer exits with this when its gang restarts in place (AttachEvent.restart_generation):
#: a container restart rule restarts it, with its pod, sidecar and memory kept.
EXIT_RESTART_IN_PLACE = 77
#: The sidecar refuses a trainer with this text when the operator stopped the job (its restart limit
#: is spent); the client then exits with EXIT_LIMIT_SPENT.
LIMIT_SPENT_MARKER = "strata: the restart limit is spent"
#: The sidecar's refusal of a restore whose step another number of ranks saved starts with this: the
#: client then restores it through reads of the ranks that saved it, when the state allows.
RESHARD_MARKER = "strata: saved by another number of ranks"
#: Key of the coordinator's (rank 0's) state under which trainer_client.dcp's StrataWriter stores DCP's
#: global checkpoint metadata (JSON): a checkpoint holding it was saved through
#: torch.distributed.checkpoint, and DCP's planner can load it on any number of ranks.
DCP_METADATA_KEY = "dcp_metadata"
#: Key under which the client saves the process's random generators beside the user's state: each
#: rank's own streams, never a replica (a resharded restore leaves them out of its checks).
RNG_STATE_KEY = "__strata_rng__"
#: The largest step a checkpoint may have: keys spell steps as 12 decimal digits (``steps/<step:012d>/``),
#: which list and sort in step order only up to here. Client and sidecar refuse larger steps at save.
MAX_STEP = 10**12 - 1
#: The most ranks a job may have: saves refuse more, and a COMMIT or MANIFEST saying more is damage.
MAX_WORLD_SIZE = 65536
#: Shared-memory segment names: ``strata-<client instance>-<n>``, a file name and nothing more.
SHM_NAME_PATTERN = r"strata-[A-Za-z0-9][A-Za-z0-9._-]{0,200}"
#: What a Save header may name (a full match): ``strata-<instance>-<n>``, the instance 1-64 letters
#: or digits (no dash, so no name stands for another instance's), n a decimal index.
SHM_SEGMENT_PATTERN = r"strata-([A-Za-z0-9]{1,64})-([0-9]{1,9})"
#: A client staging into such files holds a lock on ``.strata-owner-<instance>`` beside them while
#: they live; anyone may remove them once that lock is free (``sidecar.api.shm_owners``).
#: A sidecar that takes segments as sealed memfds offers the capability ``save.shm.fd=<name>``:
#: ``<name>`` (a full match of SHM_HANDOVER_SOCKET) is its SOCK_SEQPACKET socket in its shm dir. A
#: client hands each segment over as a memfd sealed against shrinking and growing, one message per
#: segment, its name (SHM_SEGMENT_PATTERN) as data and the descriptor as SCM_RIGHTS; the sidecar
#: answers ``ok`` or ``error: <why>``. A Save header then names the segment. Segments handed over
#: on a connection and never named by a save are dropped when the connection closes.
#: A Restore header may name a held segment lent back instead of a file: ``strata-fd-<tag>-<token>``
#: (SHM_LENT_PATTERN). The client sends ``get <name>`` (no descriptor) on the socket
#: ``.strata-segments-<tag>.sock`` in the shm dir and gets ``ok`` with a read-only descriptor of the
#: segment (SCM_RIGHTS), or ``error: <why>``. A token is good once, for two minutes.
SHM_HANDOVER_CAPABILITY = "save.shm.fd="
#: The sidecar takes back a segment before it is staged into again: on the connection that handed
#: it over, the client sends ``drop <name>`` (no descriptor) and the sidecar answers ``ok`` once the
#: committed snapshot held in it is gone from memory (no restore, holdings report or diff reads it
#: any more; storage has it), or ``error: <why>`` (then the client stages into a new segment).
#: A sidecar that does so offers ``save.shm.staging=<n>``: the staging segments it suggests per
#: rank (``STRATA_STAGING_BUFFERS=auto``), 1, or 2 where it pushes copies to peers (redundancy:
#: the second keeps the newest committed snapshot in memory, and readable for the push, while the
#: next save stages).
SHM_STAGING_CAPABILITY = "save.shm.staging="
SHM_LENT_PATTERN = r"strata-fd-([0-9a-f]{16})-([0-9a-f]{32})"
SHM_HANDOVER_SOCKET = r"\.strata-segments-([0-9a-f]{16})\.sock"


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options both ends set, so a limit never differs by side."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def default_socket_path() -> str:
    """The sidecar's unix socket when none is configured: a private per-user
    directory, so only this user's processes (or the pod, via a shared
    emptyDir mounted at $XDG_RUNTIME_DIR) can reach it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/strata-{os.getuid()}"
    return str(Path(base) / "strata" / "sidecar.sock")


__all__ = [
    "DCP_METADATA_KEY",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "RESHARD_MARKER",
    "RNG_STATE_KEY",
    "SHM_HANDOVER_CAPABILITY",
    "SHM_HANDOVER_SOCKET",
    "SHM_LENT_PATTERN",
    "SHM_NAME_PATTERN",
    "SHM_SEGMENT_PATTERN",
    "TOKEN_METADATA_KEY",
    "channel_options",
    "default_socket_path",
    "pb",
    "pb_grpc",
]
