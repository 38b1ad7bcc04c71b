"""Sidecar settings: one object, filled from flags, then ``STRATA_*``
environment variables, then defaults (torchsnapshot's knobs habit: every
tunable in one place with an env override)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from sidecar.api import default_socket_path, envvars, sizes
from sidecar.pipeline.settings import check_encoding_settings


def _opt(default: Any, help: str, env: str | None = None, secret: bool = False, size: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "env": env, "secret": secret, "size": size})


def _size(default: int, help: str) -> Any:
    """A setting in bytes, also read with units (4G, 512MiB: sidecar.api.sizes)."""
    return _opt(default, help, size=True)


@dataclass
class SidecarSettings:
    storage: str = _opt("", "where checkpoints go: s3://bucket/prefix or file:///path (required)")
    socket: str = _opt(
        "", "unix socket to serve on (default: $XDG_RUNTIME_DIR/strata/sidecar.sock or /tmp/strata-$UID/...)"
    )
    socket_mode: int = _opt(0o600, "permission bits of the socket (0o660 to share with a group)")
    tcp_port: int = _opt(0, "also serve on TCP 127.0.0.1:PORT (0: off); requires --token")
    tcp_host: str = _opt("127.0.0.1", "address for --tcp-port")
    token: str = _opt("", "shared secret clients must send on TCP", secret=True)
    metrics_port: int = _opt(9464, "Prometheus /metrics HTTP port (0: off)")
    metrics_host: str = _opt("0.0.0.0", "address for the metrics endpoint")
    s3_endpoint: str = _opt("", "S3 endpoint URL (empty: AWS)", env="STRATA_S3_ENDPOINT")
    s3_region: str = _opt("us-east-1", "S3 region")
    object_bytes: int = _size(64 << 20, "largest storage object a snapshot is cut into")
    upload_concurrency: int = _opt(4, "objects uploaded in parallel per snapshot")
    max_message_bytes: int = _size(64 << 20, "largest gRPC message accepted or sent")
    max_snapshot_bytes: int = _size(64 << 30, "largest snapshot one save may carry")
    max_held_snapshots: int = _opt(2, "snapshots held in memory per rank (committed + in flight)")
    max_ranks: int = _opt(
        1024,
        "ranks (namespace, job, rank) this sidecar holds snapshots of at once, over all jobs; a save "
        "of one more is refused with RESOURCE_EXHAUSTED (ranks holding nothing make room)",
    )
    max_tree_bytes: int = _size(
        16 << 20,
        "largest state tree (the JSON of a save's non-tensor values) one save may carry; parsing it "
        "is charged to --memory-budget as well (up to ~32x its bytes until parsed)",
    )
    max_tensors: int = _opt(100_000, "most tensors (replicated ones included) one save may declare")
    memory_budget: int = _size(
        0,
        "bytes of the sidecar's own memory (snapshots received over gRPC, save headers and their state "
        "trees, restore buffers, encode scratch) it may hold; beyond, requests are refused with "
        "RESOURCE_EXHAUSTED (0: 0.75 x its "
        "container's cgroup memory limit, else of the machine's RAM). Shared-memory segments are the "
        "trainer's and do not count",
    )
    max_blocking_rpcs: int = _opt(
        48,
        "blocking calls (WaitCommitted, Restore, Attach, DescribeCheckpoint) served at once; one more "
        "is refused with RESOURCE_EXHAUSTED and retried by the client",
    )
    commit_timeout_s: float = _opt(300.0, "how long rank 0 waits for every rank's MANIFEST")
    storage_attempts: int = _opt(5, "tries per storage request (the first included) before a save fails")
    shm_dir: str = _opt(
        "/dev/shm", "tmpfs shared with the trainers for zero-copy saves (empty: chunked gRPC saves only)"
    )
    policy: str = _opt(
        "intermittent",
        "checkpoint policy: full, one-shot (rows changed since the last full), consecutive (since the "
        "last checkpoint), intermittent (one-shot, new full when cheaper)",
    )
    max_diffs: int = _opt(32, "diffs after which a full checkpoint is written regardless of policy")
    quantize: str = _opt(
        "off",
        "lossy storage of matched tensors: off, auto (bits from the restores expected from storage), "
        "2, 3, 4, 8, "
        "float16 or bfloat16",
    )
    quantize_match: str = _opt(
        "",
        "comma-separated globs of tensor names to quantize (default: embedding tables, as the client marks)",
    )
    expected_restores: int = _opt(
        20,
        "restores a checkpoint is expected to see; picks the bit width under --quantize auto with "
        "--restore-class stored",
    )
    restore_class: str = _opt(
        "auto",
        "auto: a gang restores the exact snapshots held in memory or by peers when every rank can, "
        "storage's lossy form otherwise (one class for all ranks); stored: every restore gives what "
        "storage holds",
    )
    expected_storage_restores: int = _opt(
        1,
        "restores from storage (a lost gang) a checkpoint is expected to see; picks the bit width "
        "under --quantize auto with --restore-class auto (20 failures, 1 in 20 losing the gang)",
    )
    restore_bits: str = _opt(
        "1:4", "--quantize auto table: up to N restores -> B bits, as N:B pairs; 8 bits beyond"
    )
    encode_workers: int = _opt(2, "worker processes that quantize a snapshot (1: in the sidecar's own)")
    nice: int = _opt(
        19, "niceness the sidecar process adds to itself at start, so training wins contended cores (0: off)"
    )
    keep: int = _opt(3, "committed steps to keep per job; older ones are deleted (0: keep all)")
    tracking_check_fraction: float = _opt(
        0.001,
        "tracked tables: catch untracked changes to at least this fraction of the untracked rows ...",
    )
    tracking_check_confidence: float = _opt(
        0.999, "... with at least this probability per save (sizes the spot check of untracked rows)"
    )
    generation_file: str = _opt(
        "",
        "file naming the gang generation (run id + restart count), written by the launcher or a "
        "downward-API volume; empty: trust the generation each trainer declares",
    )
    generation: str = _opt(
        "",
        "the gang generation RUN/RESTART of this process, fixed at start (the injection composes a "
        "JobSet pod's from its labels); --generation-file wins; empty: as the trainers declare",
    )
    conditional_writes: str = _opt(
        "require",
        "storage must honour If-None-Match/If-Match (probed at start): require (refuse to start "
        "without) or warn (run, with a warning and strata_storage_conditional_writes 0)",
    )
    peer_port: int = _opt(
        0,
        "serve hints and held ranks' tensors to the job's other sidecars on TCP PORT (0: off)",
    )
    peer_host: str = _opt("127.0.0.1", "address for --peer-port")
    peers: str = _opt(
        "",
        "comma-separated host:port of the job's other sidecars (commit hints; replicas fetched from memory)",
    )
    peer_fetch_timeout_s: float = _opt(
        30.0, "seconds a fetch of another rank's tensors from a peer's memory may take before storage is read"
    )
    hint_fallback_s: float = _opt(
        10.0, "seconds a commit waits for a peer's hint before it asks storage (then every as long)"
    )
    redundancy: str = _opt(
        "off",
        "protect committed snapshots against a lost pod in the memory of other pods: off, buddy (a "
        "full copy on the next member) or parity (XOR parity spread over groups of --parity-group "
        "members; any one lost member per group is rebuilt). Needs --peer-port and --members",
    )
    parity_group: int = _opt(4, "members per parity group (>= 3; a smaller last group joins the one before)")
    members: str = _opt(
        "",
        "every member's (sidecar's) peer address in order, this one included: host:port,... or a "
        "template with {index} (e.g. train-{index}.train:9411) and --member-count",
    )
    member_count: int = _opt(0, "members of the job when --members is a template")
    member_index: int = _opt(-1, "this sidecar's index in --members (-1: $STRATA_RANK, one rank per pod)")
    redundancy_dir: str = _opt(
        "",
        "memory-backed directory for copies and parity held for other members, kept across a sidecar "
        "restart (default: <shm-dir>/strata-redundancy); its pages count in --memory-budget",
    )
    redundancy_rate_mb_s: float = _opt(
        200.0, "MB/s the redundancy pushes may send, so they never crowd training traffic (0: unthrottled)"
    )
    drain_timeout_s: float = _opt(
        30.0,
        "on SIGTERM, keep serving attached trainers (their save on SIGTERM) until they exit or this "
        "long, then finish uploads and exit; keep it below terminationGracePeriodSeconds (0: no drain)",
    )

    report_url: str = _opt(
        "",
        "operator URL the sidecar reports commits, retention deletes and heartbeats to, best effort and "
        "never on the commit path (https://...; empty: no reports)",
    )
    report_token_file: str = _opt(
        "",
        "file holding the bearer token sent with each report, read again at every send (a projected "
        "service-account token rotates); empty: no token",
    )
    report_ca_file: str = _opt(
        "", "CA bundle that verifies the operator's HTTPS certificate (empty: the system's CAs)"
    )
    heartbeat_s: float = _opt(
        10.0, "seconds between heartbeats per rank to the operator (hang detection; 0: off)"
    )
    restore_request_file: str = _opt(
        "",
        "file holding the operator's one-shot restore request for a new generation (a committed step, "
        "none for a fresh start, or stop: the restart limit is spent and trainers are refused, so they "
        "exit 76; a downward-API volume); missing or empty: restore the newest",
    )

    def __post_init__(self) -> None:
        if not self.socket:
            self.socket = default_socket_path()

    def validate(self) -> None:
        """Raise ValueError naming the setting that is wrong: its flag, or its environment variable
        when the value came from there (``from_sources``)."""
        try:
            self._check()
        except ValueError as exc:
            message = str(exc)
            for name in sorted(getattr(self, "_from_env", ()), key=len, reverse=True):
                flag = "--" + name.replace("_", "-")
                if re.match(rf"{re.escape(flag)}\b(?!-)", message):
                    raise ValueError(f"{_env_of(name)} ({flag}){message[len(flag) :]}") from None
            raise

    def _check(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"--{f.name.replace('_', '-')} is not a number (nan)")
        for name in ("tcp_port", "peer_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                port = getattr(self, name)
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a TCP port, 0 to 65535 (0: off), got {port}"
                )
        if not 0 < self.commit_timeout_s < math.inf:
            raise ValueError(f"--commit-timeout-s must be positive seconds, got {self.commit_timeout_s}")
        if self.keep < 0:
            raise ValueError(f"--keep must be >= 0 (0: keep every committed step), got {self.keep}")
        if self.storage_attempts < 1:
            raise ValueError(f"--storage-attempts must be >= 1, got {self.storage_attempts}")
        if self.generation_file and not os.path.isfile(self.generation_file):
            raise ValueError(
                f"--generation-file {self.generation_file}: no such file (the launcher or a downward-API "
                "volume writes it before the sidecar starts)"
            )
        if not self.storage:
            raise ValueError(
                "--storage (STRATA_STORAGE) is required, e.g. s3://bucket/prefix or file:///path"
            )
        if self.tcp_port and not self.token:
            raise ValueError(
                "--tcp-port needs --token (STRATA_TOKEN): on a host-network pod 127.0.0.1 is the node's"
            )
        for name in (
            "object_bytes",
            "upload_concurrency",
            "max_message_bytes",
            "max_snapshot_bytes",
            "max_tree_bytes",
            "max_tensors",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        check_encoding_settings(self)
        if not 0 <= self.nice <= 19:
            raise ValueError(f"--nice must be between 0 and 19, got {self.nice}")
        if self.memory_budget < 0:
            raise ValueError(
                f"--memory-budget must be >= 0 bytes (0: from the cgroup), got {self.memory_budget}"
            )
        if self.max_blocking_rpcs < 4:
            raise ValueError(f"--max-blocking-rpcs must be >= 4, got {self.max_blocking_rpcs}")
        if self.max_ranks < 1:
            raise ValueError(f"--max-ranks must be >= 1, got {self.max_ranks}")
        if self.max_held_snapshots < 2:
            raise ValueError("--max-held-snapshots must be >= 2 (the committed one plus one in flight)")
        if not 0 < self.tracking_check_fraction <= 1 or not 0 < self.tracking_check_confidence < 1:
            raise ValueError(
                "--tracking-check-fraction must be in (0, 1] and --tracking-check-confidence in (0, 1)"
            )
        if self.conditional_writes not in ("require", "warn"):
            raise ValueError(f"--conditional-writes must be require or warn, got {self.conditional_writes!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.peer_fetch_timeout_s <= 0:
            raise ValueError(f"--peer-fetch-timeout-s must be positive, got {self.peer_fetch_timeout_s}")
        if self.hint_fallback_s <= 0:
            raise ValueError(f"--hint-fallback-s must be positive, got {self.hint_fallback_s}")
        if self.redundancy not in ("off", "buddy", "parity"):
            raise ValueError(f"--redundancy must be off, buddy or parity, got {self.redundancy!r}")
        if self.parity_group < 3:
            raise ValueError(f"--parity-group must be >= 3 (2 members is buddy), got {self.parity_group}")
        if not self.redundancy_rate_mb_s >= 0:
            raise ValueError(
                f"--redundancy-rate-mb-s must be >= 0 (0: unthrottled), got {self.redundancy_rate_mb_s}"
            )
        if self.member_count < 0:
            raise ValueError(f"--member-count must be >= 0, got {self.member_count}")
        if self.redundancy != "off" and not self.peer_port:
            raise ValueError(f"--redundancy {self.redundancy} needs --peer-port (members push to each other)")
        if self.redundancy != "off" and not self.members:
            raise ValueError(f"--redundancy {self.redundancy} needs --members (every member's peer address)")
        if self.report_url:
            parts = urllib.parse.urlsplit(self.report_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"--report-url must be http(s)://HOST[:PORT][/PATH], got {self.report_url!r}"
                )
            if parts.username or parts.password or parts.query or parts.fragment:
                raise ValueError("--report-url must carry no credentials, query or fragment")
        if self.report_ca_file and not os.path.isfile(self.report_ca_file):
            raise ValueError(f"--report-ca-file {self.report_ca_file!r} is not a file")
        if not self.heartbeat_s >= 0:
            raise ValueError(f"--heartbeat-s must be >= 0 (0: off), got {self.heartbeat_s}")
        if self.generation:
            run, sep, restart = self.generation.strip().rpartition("/")
            if not (sep and run and restart.isdigit()) or any(c.isspace() for c in run):
                raise ValueError(
                    f"--generation must look like RUN/RESTART (e.g. 7f3c9a/2), got {self.generation!r}: "
                    "in a JobSet pod the labels jobset.sigs.k8s.io/jobset-uid and restart-attempt compose it"
                )
        if len(self.socket.encode()) > 107:
            raise ValueError(f"--socket path is {len(self.socket.encode())} bytes; unix sockets allow 107")

    def redacted(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["socket_mode"] = oct(self.socket_mode)
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name]:
                out[f.name] = "***"
        return out


def env_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("env") or "STRATA_" + f.name.upper()


def _env_of(name: str) -> str:
    return env_name(next(f for f in dataclasses.fields(SidecarSettings) if f.name == name))


def unknown_env(env: dict[str, str] | None = None) -> list[str]:
    """Warnings for ``STRATA_*`` variables nobody reads (misspellings), naming the closest known one."""
    known = envvars.KNOWN | {env_name(f) for f in dataclasses.fields(SidecarSettings)}
    return envvars.unknown(dict(os.environ) if env is None else env, known)


def is_size(f: dataclasses.Field[Any]) -> bool:
    return bool(f.metadata.get("size"))


def _convert(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = type(f.default)
    if is_size(f):
        try:
            return sizes.parse_size(raw)
        except ValueError as exc:
            raise ValueError(f"{env_name(f)}={raw!r}: {exc}") from None
    try:
        if kind is int:
            return int(raw, 0)
        if kind is float:
            return float(raw)
    except ValueError:
        article = "an" if kind is int else "a"
        raise ValueError(f"{env_name(f)}={raw!r}: expected {article} {kind.__name__}") from None
    return raw


def _int(text: str) -> int:
    """Integers in any base Python reads (0o660 for a socket mode, 0x...)."""
    return int(text, 0)


def size_argument(text: str) -> int:
    """argparse ``type=`` of a size flag: its error names the flag and what a size looks like."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(SidecarSettings):
        kind = type(f.default)
        size = is_size(f)
        default = sizes.format_size(int(f.default)) if size else repr(f.default)  # type: ignore[arg-type]
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=size_argument if size else _int if kind is int else kind,
            default=None,
            metavar="SIZE" if size else f.name.split("_")[-1].upper(),
            help=f"{f.metadata['help']} [env {env_name(f)}; default {default}]",
        )


def from_sources(
    args: argparse.Namespace | None = None, env: dict[str, str] | None = None
) -> SidecarSettings:
    """Flags win over environment variables, which win over defaults."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    from_env = set()
    for f in dataclasses.fields(SidecarSettings):
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
        elif env_name(f) in env:
            values[f.name] = _convert(f, env[env_name(f)])
            from_env.add(f.name)
    settings = SidecarSettings(**values)
    # Not a field (no flag, not printed): errors name these settings by their variable.
    setattr(settings, "_from_env", frozenset(from_env))  # noqa: B010
    return settings
