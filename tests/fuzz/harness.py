"""The fuzz harness: targets, the properties they must keep, and the counters.

Targets
  grpc:<Method>   one real sidecar process over a real unix socket (a persistent channel)
  peer:<Method>   the same sidecar's peer port over TCP (requests signed with the job's real key
                  half the time, so mutated fields get past the signature check)
  parse:<kind>    an in-process reader of a bucket object, on fuzzed bytes
  bucket:<kind>   fuzzed bytes written into a real file store beside a valid job layout, then
                  every reader of that job (fences, LATEST, listings, COMMIT, MANIFEST, objects,
                  markers, `strata ls`)
  restore:<kind>  the same, in a fresh job, read back by the sidecar (Restore, List, Describe)

Properties, checked on every case
  - the sidecar process lives and answers another client (a health Handshake between cases);
  - its peak RSS (VmHWM, reset per case) stays within --memory-budget + a fixed margin over its idle size;
  - no call outlives its deadline (a hang);
  - every failure is a named status (never INTERNAL or UNKNOWN, never an empty message); an
    in-process reader raises the project's own error types only (never a bare KeyError,
    TypeError, RecursionError, ...);
  - any restore that succeeds returns the bytes that were committed (a victim job saved before the
    run is restored bit for bit after it).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION, channel_options, pb, pb_grpc
from sidecar.errors import StrataError
from sidecar.store.file import FileStore
from tests.fuzz import strategies as fs

MiB = 1 << 20
NS = "default"
#: the sidecar's --memory-budget, and what its RSS may exceed it by (interpreter, gRPC, caches)
MEMORY_BUDGET = 32 * MiB
RSS_MARGIN = 64 * MiB
MAX_MESSAGE = 4 * MiB
#: what the harness's own in-process readers may allocate beyond its size at start
READER_MEMORY = 4 << 30
#: the sidecar process's heap and private mappings (its threads' stacks included)
SIDECAR_DATA_LIMIT = 4 << 30
#: seconds one call may take before it counts as a hang
DEADLINE_S = 15.0
VICTIM = "victim"
VICTIM_STEP = 5
GEN = "fz/0"

#: request and stream types of every fuzzed method
UNARY = {
    "Handshake": pb.HandshakeRequest,
    "WaitCommitted": pb.WaitCommittedRequest,
    "ListCheckpoints": pb.ListCheckpointsRequest,
    "DescribeCheckpoint": pb.DescribeCheckpointRequest,
    "GetStatus": pb.StatusRequest,
    "ReportSkip": pb.ReportSkipRequest,
    "Prefetch": pb.PrefetchRequest,
}
PEER_UNARY = {"Hint": pb.HintRequest}


def ident(job: str, rank: int = 0, world: int = 1, generation: str = GEN) -> pb.Identity:
    return pb.Identity(namespace=NS, job=job, rank=rank, world_size=world, attempt=0, generation=generation)


def save_stream(
    job: str, step: int, data: bytes, save_id: str = "", tree: bytes = b""
) -> list[pb.SaveRequest]:
    header = pb.SaveHeader(
        protocol_version=PROTOCOL_VERSION,
        identity=ident(job),
        step=step,
        save_id=save_id or f"s{step}",
        tensors=[pb.TensorMeta(name="w", dtype="uint8", shape=[len(data)], nbytes=len(data))],
        tree=tree or b'{"w": {"__tensor__": 0}}',
    )
    return [
        pb.SaveRequest(header=header),
        pb.SaveRequest(chunk=data),
        pb.SaveRequest(footer=pb.SaveFooter(total_bytes=len(data))),
    ]


# --- cases and findings -------------------------------------------------------------------------


@dataclass(repr=False)
class Case:
    """One input: the target it goes to and what it sends (protobuf messages serialized, or the
    bucket object: which, its body, and how it is placed)."""

    target: str
    messages: list[Message] = field(default_factory=list)
    obj: str = ""
    body: bytes = b""
    #: bucket cases: "replace" the object, "reseal" it (also fix the digests that name it), or
    #: "add" it under ``key`` (relative to the job's prefix)
    mode: str = "replace"
    key: str = ""

    def __repr__(self) -> str:  # short: hypothesis formats every case it draws
        return (
            f"Case({self.target!r}, {len(self.messages)} messages, {self.obj or '-'} {len(self.body)} bytes)"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis's printer, which expands dataclasses
        p.text(repr(self))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target": self.target}
        if self.messages:
            out["messages"] = [
                {"type": m.DESCRIPTOR.full_name, "b64": base64.b64encode(m.SerializeToString()).decode()}
                for m in self.messages
            ]
        if self.obj:
            out.update(obj=self.obj, mode=self.mode, key=self.key)
        if self.obj or self.body:
            out["body_b64"] = base64.b64encode(self.body).decode()
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Case:
        msgs = []
        for m in raw.get("messages", []):
            cls_ = getattr(pb, m["type"].rsplit(".", 1)[1])
            msgs.append(cls_.FromString(base64.b64decode(m["b64"])))
        return cls(
            raw["target"],
            msgs,
            raw.get("obj", ""),
            base64.b64decode(raw.get("body_b64", "")),
            raw.get("mode", "replace"),
            raw.get("key", ""),
        )


@dataclass
class Finding:
    kind: str  # crash, hang, budget, wrong_restore
    signature: str
    detail: str
    case: Case | None
    count: int = 1


@dataclass
class Counters:
    execs: int = 0
    crashes: int = 0
    hangs: int = 0
    budget_violations: int = 0
    wrong_restores: int = 0
    by_target: dict[str, int] = field(default_factory=dict)
    findings: dict[str, Finding] = field(default_factory=dict)
    max_rss: int = 0

    def note(self, kind: str, target: str, detail: str, case: Case | None) -> None:
        attr = {"crash": "crashes", "hang": "hangs", "budget": "budget_violations"}.get(
            kind, "wrong_restores"
        )
        setattr(self, attr, getattr(self, attr) + 1)
        sig = f"{kind} {target}: " + re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", detail))[:90]
        if sig in self.findings:
            self.findings[sig].count += 1
        else:
            self.findings[sig] = Finding(kind, sig, detail[:2000], case)

    def summary(self) -> dict[str, int]:
        return {
            "fuzz_execs": self.execs,
            "fuzz_crashes": self.crashes,
            "fuzz_hangs": self.hangs,
            "fuzz_budget_violations": self.budget_violations,
            "fuzz_wrong_restores": self.wrong_restores,
        }


# --- the sidecar process ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vm_data() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def _die_with_parent() -> None:
    """In the child: SIGKILL when the harness dies (a killed test run leaves no sidecar behind), and
    a cap on its heap, so an input that makes it allocate without bound is a finding (its RSS, or a
    MemoryError), not the machine's out-of-memory killer."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (SIDECAR_DATA_LIMIT, resource.RLIM_INFINITY))


class Sidecar:
    """One real sidecar process (``strata sidecar``) on a file store under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store_dir = root / "store"
        self.shm_dir = root / "shm"
        self.socket = str(root / "sc.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.peer_port = 0
        self.log = root / "sidecar.log"
        self.idle_rss = 0

    def start(self) -> Sidecar:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.shm_dir.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        self.peer_port = _free_port()
        argv = [
            sys.executable, "-m", "sidecar.cli", "sidecar",
            f"--storage=file://{self.store_dir}",
            f"--socket={self.socket}",
            f"--shm-dir={self.shm_dir}",
            f"--memory-budget={MEMORY_BUDGET}",
            # gRPC parses a message before the sidecar can charge it (a header's parsed form is ~6x
            # its wire size): a small budget comes with small messages (README, Limits on one request)
            f"--max-message-bytes={MAX_MESSAGE}",
            "--metrics-port=0",
            f"--peer-port={self.peer_port}",
            "--commit-timeout-s=5",
            "--hint-fallback-s=1",
            "--keep=0",
            "--encode-workers=1",
            "--nice=0",
            "--heartbeat-s=0",
            "--drain-timeout-s=0",
        ]  # fmt: skip
        # the sidecar package this process imported (a checkout under test, not necessarily this one)
        import sidecar

        here = str(Path(sidecar.__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        log = open(self.log, "ab")  # noqa: SIM115 (the child holds it)
        # cwd: `python -m` puts it first on the path
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=log, env=env, cwd=here, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            stub = pb_grpc.CheckpointerStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"sidecar exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                    )
                try:
                    stub.Handshake(pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=2)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss(self, field: str = "VmRSS") -> int:
        assert self.proc is not None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def peak_rss(self) -> int:
        """The resident peak since the last call (VmHWM, then reset): a spike during a request
        counts, not only what is left after it."""
        peak = self.rss("VmHWM")
        assert self.proc is not None
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        return peak

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# --- bucket layouts ----------------------------------------------------------------------------------


def build_job(store: FileStore, job: str, steps: dict[int, bytes]) -> None:
    """A valid job layout, written by the manifest module's own writers: EPOCH 0, and for each step
    a data object, its MANIFEST, the COMMIT and LATEST."""
    epoch = mf.create_epoch(store, NS, job, mf.Generation.parse(GEN), 1, None, mf.Fences())
    for step, data in steps.items():
        prefix = mf.rank_prefix(NS, job, step, epoch.attempt, f"s{step}", 0)
        key = prefix + "obj-000"
        store.put(key, data)
        digest = mf.xxh3(data)
        manifest = mf.Manifest(
            NS, job, step, 0, 1, epoch.attempt, f"s{step}", len(data),
            tree={"w": {"__tensor__": 0}},
            tensors=[mf.TensorEntry("w", "uint8", [len(data)], len(data), 0, xxh3=digest)],
            objects=[mf.ObjectEntry(key, len(data), xxh3=digest)],
            generation=GEN,
        )  # fmt: skip
        mf.write_manifest(store, prefix, manifest)
        mf.write_commit(store, NS, job, step, 1, epoch.attempt)


#: where each bucket object kind lies in a layout built by build_job (relative to the job prefix)
def object_key(kind: str, step: int) -> str:
    sp = f"steps/{step:012d}/"
    return {
        "EPOCH": "EPOCH/00000000",
        "LATEST": "LATEST",
        "COMMIT": sp + "a0000/COMMIT",
        "MANIFEST": sp + f"a0000-s{step}/rank-0/MANIFEST",
        "DATA": sp + f"a0000-s{step}/rank-0/obj-000",
        "PEER_KEY": "PEER_KEY",
    }[kind]


BUCKET_KINDS = ["EPOCH", "LATEST", "COMMIT", "MANIFEST", "DATA", "EPOCH+", "UNUSABLE", "STEPDIR", "PEER_KEY"]
DCP_BASE = {
    "format": "strata.dcp-metadata",
    "version": 1,
    "dcp_version": "1.0.0",
    "state_dict_metadata": {
        "w": {
            "tensor": {
                "dtype": "float32",
                "requires_grad": False,
                "memory_format": "contiguous_format",
                "pin_memory": False,
                "size": [6, 8],
                "chunks": [[[0, 0], [3, 8]], [[3, 0], [3, 8]]],
            }
        },
        "b": {"bytes": {}},
    },
    "planner_data": {"w": ["w"], "b": ["b"]},
    "storage": [
        ["w", [0, 0], 0, 0, "w@0,0", 96],
        ["w", [3, 0], 1, 1, "w@3,0", 96],
        ["b", None, None, 0, "b", 5],
    ],
    "storage_meta": {"checkpoint_id": None, "save_id": "s", "load_id": None, "modules": []},
}
TREE_BASE = {
    "format": "strata.tree",
    "version": 1,
    "num_tensors": 1,
    "root": {"w": {"$tensor": 0}, "lr": 0.1, "xs": [1, 2, {"$tuple": [3, "x"]}]},
}


# --- the harness --------------------------------------------------------------------------------------


class Harness:
    """A sidecar, its store, a victim job committed before any fuzzing, and the counters."""

    def __init__(self, root: Path | None = None, log: Callable[[str], None] | None = None) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = root or Path(tempfile.mkdtemp(prefix="strata-fuzz-", dir=base))
        self._own_root = root is None
        self.sidecar = Sidecar(self.root)
        self.counters = Counters()
        self.store: FileStore | None = None
        self.log = log or (lambda s: None)
        self.victim_data = os.urandom(3 * 1000 + 7)
        #: per restore job: step -> the bytes committed
        self.committed: dict[str, dict[int, bytes]] = {}
        self._jobs = 0
        self._template: dict[str, bytes] = {}
        self._data_limit = resource.getrlimit(resource.RLIMIT_DATA)
        self.peer_keys: dict[str, bytes] = {}
        #: (job, step) -> bytes of the fuzzed saves that committed
        self.saved: dict[tuple[str, str, int, int], list[bytes]] = {}
        #: status of the case's (first) call
        self.last_code = grpc.StatusCode.OK

    # lifecycle
    def __enter__(self) -> Harness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        # the readers log what they skip: thousands of lines a second here (level restored in close())
        self._log_level = logging.getLogger("sidecar").level
        logging.getLogger("sidecar").setLevel(logging.CRITICAL)
        # the readers' modules (torch with the client's): imported once, not on the first case
        import sidecar.cli  # noqa: F401
        import trainer_client._dcp_metadata
        import trainer_client._tree  # noqa: F401

        # An in-process reader that allocates by a fuzzed size must fail (a finding), not take the
        # machine down: heap and private mappings capped at 4 GiB more than now, undone in close().
        self._data_limit = resource.getrlimit(resource.RLIMIT_DATA)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + READER_MEMORY, self._data_limit[1]))
        self.sidecar.start()
        self.store = FileStore(self.sidecar.store_dir)
        self._connect()
        self._save_victim()
        build_job(self.store, "tmpl", {1: b"\x01" * 64, 2: b"\x02" * 96})
        prefix = mf.job_prefix(NS, "tmpl")
        self._template = {o.key: self.store.get(o.key) for o in self.store.list(prefix).objects}
        self.sidecar.idle_rss = self.sidecar.rss()
        self.sidecar.peak_rss()  # the start's peak is not a case's

    def _connect(self) -> None:
        opts = channel_options(256 * MiB)
        self.channel = grpc.insecure_channel(f"unix:{self.sidecar.socket}", options=opts)
        self.health_channel = grpc.insecure_channel(f"unix:{self.sidecar.socket}")
        self.peer_channel = grpc.insecure_channel(f"127.0.0.1:{self.sidecar.peer_port}", options=opts)
        self.stub = pb_grpc.CheckpointerStub(self.channel)
        self.health = pb_grpc.CheckpointerStub(self.health_channel)
        self.peer = pb_grpc.PeerStub(self.peer_channel)

    def _disconnect(self) -> None:
        for ch in (self.channel, self.health_channel, self.peer_channel):
            ch.close()

    def close(self) -> None:
        logging.getLogger("sidecar").setLevel(self._log_level)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, self._data_limit)
        self._disconnect()
        self.sidecar.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def restart(self) -> None:
        self._disconnect()
        self.sidecar.stop()
        self.sidecar.start()
        self._connect()

    def _save_victim(self) -> None:
        ack = self.stub.Save(iter(save_stream(VICTIM, VICTIM_STEP, self.victim_data)), timeout=30)
        status = self.stub.WaitCommitted(
            pb.WaitCommittedRequest(
                identity=ident(VICTIM), step=ack.step, save_id=ack.save_id, timeout_seconds=30
            ),
            timeout=40,
        )
        if status.state != pb.COMMIT_STATE_COMMITTED:
            raise RuntimeError(f"victim save did not commit: {status}")

    def victim_intact(self, generation: str = "victim-check/0") -> str | None:
        """Restore the victim in a new generation: None when its bytes are the committed ones,
        else what went wrong."""
        req = pb.RestoreRequest(
            protocol_version=PROTOCOL_VERSION, identity=ident(VICTIM, generation=generation)
        )
        try:
            header, data = self._read_restore(req)
        except grpc.RpcError as exc:
            return f"victim restore failed: {exc.code().name}: {exc.details()}"
        if header.step != VICTIM_STEP or data != self.victim_data:
            return f"victim restore returned step {header.step}, {len(data)} bytes, not the committed ones"
        return None

    # the checks between cases
    def check_health(self, case: Case | None) -> None:
        c, sc = self.counters, self.sidecar
        if not sc.alive():
            c.note(
                "crash",
                case.target if case else "?",
                f"sidecar exited with {sc.proc and sc.proc.returncode}",
                case,
            )
            self.log(f"sidecar died: {sc.log.read_text()[-1500:]}")
            self.restart()
            return
        try:
            self.health.Handshake(pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=DEADLINE_S)
        except grpc.RpcError as exc:
            kind = "hang" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "crash"
            c.note(
                kind,
                case.target if case else "?",
                f"health Handshake: {exc.code().name} {exc.details()}",
                case,
            )
            self.restart()
            return
        rss = sc.peak_rss()
        c.max_rss = max(c.max_rss, rss)
        if rss > sc.idle_rss + MEMORY_BUDGET + RSS_MARGIN:
            c.note("budget", case.target if case else "?", f"peak RSS {rss >> 20} MiB over budget", case)
            self.restart()  # a fresh process, so one finding is not counted on every later case

    # running one case
    def run(self, case: Case, health: bool = True) -> None:
        self.counters.execs += 1
        kind = case.target.split(":", 1)[0]
        self.counters.by_target[case.target] = self.counters.by_target.get(case.target, 0) + 1
        if kind in ("grpc", "peer"):
            self._run_rpc(case)
        elif kind == "parse":
            self._run_parse(case)
        elif kind == "bucket":
            self._run_bucket(case)
        elif kind == "restore":
            self._run_restore(case)
        else:
            raise ValueError(f"unknown target {case.target!r}")
        if health and kind in ("grpc", "peer", "restore"):
            self.check_health(case)

    def _status(self, case: Case, exc: grpc.RpcError, waits: bool = False) -> None:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if not waits:
                self.counters.note("hang", case.target, f"no answer within {DEADLINE_S} s", case)
        elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) or not details.strip():
            self.counters.note("crash", case.target, f"{code.name}: {details}", case)
        elif code == grpc.StatusCode.UNAVAILABLE and not self.sidecar.alive():
            pass  # counted by the health check

    def _run_rpc(self, case: Case) -> None:
        kind, method = case.target.split(":", 1)
        msgs = case.messages
        waits = False
        self.last_code = grpc.StatusCode.OK
        try:
            if method == "Save":
                ack = self.stub.Save(iter(msgs), timeout=DEADLINE_S)
                self._check_committed(case, msgs[0], ack)
            elif method == "Restore":
                self._check_restore(case, msgs[0])
            elif method == "WaitCommitted":
                # a client may ask to wait long: its own deadline ending then is no hang
                t = msgs[0].timeout_seconds
                waits = not (0 <= t < DEADLINE_S - 2)
                self.stub.WaitCommitted(msgs[0], timeout=DEADLINE_S)
            elif kind == "grpc":
                getattr(self.stub, method)(msgs[0], timeout=DEADLINE_S)
            elif method == "Hint":
                self.peer.Hint(msgs[0], timeout=DEADLINE_S)
            elif method == "Protect":
                self.peer.Protect(iter(msgs), timeout=DEADLINE_S)
            elif method in ("Fetch", "Parity", "Chain"):
                for _ in getattr(self.peer, method)(msgs[0], timeout=DEADLINE_S):
                    pass
        except grpc.RpcError as exc:
            self.last_code = exc.code()
            self._status(case, exc, waits)

    def _check_committed(self, case: Case, first: pb.SaveRequest, ack: pb.SaveAck) -> None:
        """An acknowledged save commits, or fails with a reason that names what went wrong (the
        trainer has moved on: a failure after the acknowledgement is the only word it gets)."""
        if first.header.identity.world_size > 1:
            return  # it waits for ranks that never come (the commit timeout): not worth the time
        status = self.stub.WaitCommitted(
            pb.WaitCommittedRequest(
                identity=first.header.identity, step=ack.step, save_id=ack.save_id, timeout_seconds=DEADLINE_S
            ),
            timeout=DEADLINE_S + 2,
        )
        if status.state == pb.COMMIT_STATE_FAILED and (
            "internal error" in status.message or not status.message.strip()
        ):
            self.counters.note("crash", case.target, f"acknowledged, then failed: {status.message}", case)
        elif status.state == pb.COMMIT_STATE_COMMITTED and first.header.identity.job.startswith("fz-"):
            who = first.header.identity
            key = (who.namespace, who.job, who.rank, ack.step)
            self.saved.setdefault(key, []).append(b"".join(m.chunk for m in case.messages))

    def _read_restore(self, req: pb.RestoreRequest) -> tuple[pb.RestoreHeader, bytes]:
        header: pb.RestoreHeader | None = None
        chunks: list[bytes] = []
        call = self.stub.Restore(req, timeout=DEADLINE_S)
        for msg in call:
            if msg.HasField("header"):
                header = msg.header
                if header.HasField("shm") and header.shm.name:
                    # as the client reads it: a descriptor the sidecar lends, or a file in the shm dir
                    from trainer_client._staging import open_segment

                    fd = open_segment(str(self.sidecar.shm_dir), header.shm.name)
                    try:
                        chunks.append(os.pread(fd, header.total_bytes, 0))
                    finally:
                        os.close(fd)
                        if header.shm_handoff:
                            with contextlib.suppress(OSError):
                                (self.sidecar.shm_dir / header.shm.name).unlink()
                    if not header.shm_handoff:
                        break
            else:
                chunks.append(msg.chunk)
        call.cancel()
        assert header is not None
        return header, b"".join(chunks)

    def _check_restore(self, case: Case, req: pb.RestoreRequest) -> None:
        header, data = self._read_restore(req)
        if req.header_only:
            return
        job = req.identity.job
        if req.HasField("of_rank") and req.of_rank != 0:
            return
        if req.identity.namespace == NS and (job == VICTIM or job in self.committed):
            committed = {VICTIM_STEP: self.victim_data} if job == VICTIM else self.committed[job]
            want = [committed[header.step]] if header.step in committed else []
        else:  # a fuzzed save's job: only steps seen to commit are known
            who = req.identity
            want = self.saved.get((who.namespace, job, who.rank, header.step), [data])
        if data not in want:
            what = "a step never committed" if not want else f"{len(data)} bytes that differ"
            self.counters.note("wrong_restore", case.target, f"{job}: step {header.step}: {what}", case)

    # readers of bucket objects, in process
    def _run_parse(self, case: Case) -> None:
        obj = case.target.split(":", 1)[1]
        try:
            if obj == "MANIFEST":
                mf.Manifest.from_json(case.body, "MANIFEST")
            elif obj == "COMMIT":
                mf.Commit.from_json(case.body, "COMMIT")
            elif obj == "EPOCH":
                mf.Epoch.from_json(case.body, "EPOCH")
            elif obj == "DCP":
                from trainer_client import _dcp_metadata

                _dcp_metadata.decode(case.body.decode("utf-8", "replace"))
            elif obj == "TREE":
                from trainer_client import _tree

                try:
                    _tree.decode_skeleton(case.body)
                except _tree.StateError:
                    pass
                except ValueError as exc:  # the documented contract: ValueError naming the place
                    if not str(exc).startswith("skeleton"):
                        raise TypeError(f"unnamed ValueError: {exc}") from None
        except Exception as exc:
            self._reader_error(case, exc)

    def _reader_error(self, case: Case, exc: BaseException) -> None:
        from trainer_client._dcp_metadata import MetadataError

        if isinstance(exc, StrataError | MetadataError):
            return
        self.counters.note("crash", case.target, f"{type(exc).__name__}: {str(exc)[:300]}", case)

    def _place(self, store: FileStore, job: str, case: Case, steps: dict[int, bytes]) -> list[str]:
        """Write the case's object into ``job``'s layout; the keys written."""
        prefix = mf.job_prefix(NS, job)
        newest = max(steps)
        kind = case.obj
        if kind in ("EPOCH+", "UNUSABLE", "STEPDIR") or case.mode == "add":
            try:
                store.put(prefix + case.key, case.body)
            except ValueError:  # a key the store refuses: nothing placed
                return []
            return [prefix + case.key]
        key = prefix + object_key(kind, newest)
        if case.mode == "copy":  # another object of the job, moved here (a valid body, the wrong place)
            try:
                store.put(key, store.get(prefix + case.key))
            except (ValueError, StrataError):
                return []
            return [key]
        store.put(key, case.body)
        if case.mode == "reseal" and kind == "MANIFEST":
            ckey = prefix + object_key("COMMIT", newest)
            commit = json.loads(store.get(ckey))
            commit["manifests"][0]["sha256"] = mf.sha256(case.body)
            commit["manifests"][0]["size"] = len(case.body)
            store.put(ckey, json.dumps(commit).encode())
            return [key, ckey]
        return [key]

    def _readers(self, store: FileStore, job: str, case: Case, steps: dict[int, bytes]) -> None:
        """Every reader of the job's bucket objects; each may fail, with the project's errors only."""
        from sidecar import cli

        calls: list[Callable[[], Any]] = [
            lambda: mf.read_fences(store, NS, job),
            lambda: mf.newest_valid(store, NS, job),
            lambda: mf.unusable_commits(store, NS, job),
            lambda: mf.peer_key(store, NS, job, create=False),
        ]
        for c in calls:
            try:
                c()
            except Exception as exc:
                self._reader_error(case, exc)
        try:
            for step in mf.committed_steps(store, NS, job):
                commit = mf.read_commit(store, NS, job, step)
                manifest = mf.load_manifest(store, commit, 0)
                data = b"".join(mf.read_object(store, o) for o in manifest.objects)
                if step in steps and data != steps[step]:
                    self.counters.note(
                        "wrong_restore", case.target, f"step {step}: objects read back differ", case
                    )
        except Exception as exc:
            self._reader_error(case, exc)
        args = Namespace(storage=f"file://{self.sidecar.store_dir}", s3_endpoint=None, namespace=NS, job=job)
        try:
            with contextlib.redirect_stdout(StringIO()):
                cli.cmd_ls(args)
        except SystemExit:
            pass
        except Exception as exc:
            self._reader_error(case, exc)

    def _run_bucket(self, case: Case) -> None:
        """The template job with one object replaced or added; reverted afterwards."""
        assert self.store is not None
        steps = {1: b"\x01" * 64, 2: b"\x02" * 96}
        written = self._place(self.store, "tmpl", case, steps)
        try:
            self._readers(self.store, "tmpl", case, steps)
        finally:
            for key in written:
                if key in self._template:
                    self.store.put(key, self._template[key])
                else:
                    self.store.delete([key])

    def _run_restore(self, case: Case) -> None:
        """A fresh job with the case's object, read back by the sidecar."""
        assert self.store is not None
        self._jobs += 1
        job = f"rs-{self._jobs}"
        steps = {1: os.urandom(64), 2: os.urandom(96)}
        build_job(self.store, job, steps)
        self.committed[job] = steps
        self._place(self.store, job, case, steps)
        calls: list[Callable[[], Any]] = [
            lambda: self._check_restore(
                case,
                pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=ident(job, generation="fz/1")),
            ),
            lambda: self.stub.ListCheckpoints(
                pb.ListCheckpointsRequest(namespace=NS, job=job), timeout=DEADLINE_S
            ),
            lambda: self.stub.DescribeCheckpoint(
                pb.DescribeCheckpointRequest(namespace=NS, job=job, step=max(steps)), timeout=DEADLINE_S
            ),
        ]
        self.last_code = grpc.StatusCode.OK
        for i, call in enumerate(calls):
            try:
                call()
            except grpc.RpcError as exc:
                if i == 0:
                    self.last_code = exc.code()
                self._status(case, exc)
        self.committed.pop(job, None)

    # signing, for peer requests that should get past authentication
    def peer_key(self, job: str) -> bytes | None:
        if job not in self.peer_keys:
            try:
                assert self.store is not None
                self.peer_keys[job] = mf.peer_key(self.store, NS, job, create=False)
            except Exception:
                return None
        return self.peer_keys[job]


def sign(h: Harness, msg: Message) -> None:
    """Sign a peer request with its job's real key, when the job has one (in place)."""
    from sidecar import gang, redundancy

    job = getattr(msg, "job", "") or (msg.header.job if isinstance(msg, pb.ProtectRequest) else "")
    key = h.peer_key(job) if job else None
    if key is None:
        return
    with contextlib.suppress(Exception):
        if isinstance(msg, pb.FetchRequest):
            msg.issued_at = time.time()
            msg.mac = gang.fetch_mac(key, msg)
        elif isinstance(msg, pb.ParityRequest):
            msg.issued_at = time.time()
            msg.mac = redundancy.parity_mac(key, msg)
        elif isinstance(msg, pb.ChainRequest):
            msg.issued_at = time.time()
            msg.mac = redundancy.chain_mac(key, msg)
        elif isinstance(msg, pb.ProtectRequest) and msg.HasField("header"):
            msg.header.issued_at = time.time()
            msg.header.mac = redundancy.header_mac(key, msg.header)


def _huge_headers() -> list[Case]:
    """A save whose header declares 200,000 tensors with long names (~26 MB): what the sidecar
    holds for it must be charged to its budget or refused."""
    out = []
    for j in range(1):
        msgs = save_stream(f"fz-huge-{j}", 1, b"")
        h = msgs[0].header
        del h.tensors[:]
        h.tensors.extend(
            pb.TensorMeta(name=f"{i:0100d}", dtype="float32", shape=[0], nbytes=0) for i in range(200_000)
        )
        out.append(Case("grpc:Save", msgs))
    return out


def _huge_trees() -> list[Case]:
    """Two saves with 3.5 MB JSON state trees (under the 4 MiB message cap: the budget must refuse
    or charge them; a larger one gRPC refuses before the sidecar sees it)."""
    tree = json.dumps({"w": {"__tensor__": 0}, "x": ["y" * 100] * 34_000}).encode()
    return [Case("grpc:Save", save_stream(f"fz-tree-{j}", 1, b"\0" * 8, tree=tree)) for j in range(2)]


RECIPES: dict[str, Callable[[], list[Case]]] = {"huge-headers": _huge_headers, "huge-trees": _huge_trees}


def replay(h: Harness, raw: dict[str, Any]) -> list[str]:
    """Run one corpus entry; what went wrong (empty: it held). An entry may add an expectation of
    its own: ``expect`` a status code name for its call, "refused" (any status but OK),
    "restore-ok" (a damaged object must not make the job's checkpoints unreachable) or
    "committed-or-refused" (a save is refused, or a restore in a new generation returns it bit
    for bit)."""
    before = {sig: f.count for sig, f in h.counters.findings.items()}
    cases = RECIPES[raw["recipe"]]() if "recipe" in raw else [Case.from_json(raw)]
    for case in cases:
        h.run(case)
    problems = [
        f"{f.signature} (x{f.count - before.get(sig, 0)}): {f.detail[:300]}"
        for sig, f in h.counters.findings.items()
        if f.count > before.get(sig, 0)
    ]
    expect = raw.get("expect", "")
    case = cases[0]
    if expect == "restore-ok":
        if h.last_code != grpc.StatusCode.OK:
            problems.append(f"restore of a job with one damaged {case.obj} failed: {h.last_code.name}")
    elif expect == "refused":
        if h.last_code == grpc.StatusCode.OK:
            problems.append("accepted")
    elif expect == "committed-or-refused":
        problems += _committed_or_refused(h, case)
    elif expect and h.last_code.name != expect:
        problems.append(f"expected {expect}, got {h.last_code.name}")
    return problems


def _committed_or_refused(h: Harness, case: Case) -> list[str]:
    if h.last_code == grpc.StatusCode.INVALID_ARGUMENT:
        return []
    if h.last_code != grpc.StatusCode.OK:
        return [f"save neither committed nor refused as INVALID_ARGUMENT: {h.last_code.name}"]
    head = case.messages[0].header
    who = pb.Identity()
    who.CopyFrom(head.identity)
    who.generation = "fz-check/1"
    try:
        header, data = h._read_restore(pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=who))
    except grpc.RpcError as exc:
        return [f"restore after a committed save of step {head.step}: {exc.code().name}: {exc.details()}"]
    sent = b"".join(m.chunk for m in case.messages)
    if header.step != head.step or data != sent:
        return [f"save of step {head.step} committed, a new generation restores step {header.step}"]
    return []


def write_results(path: Path, summary: dict[str, Any]) -> None:
    """Merge ``summary`` into the JSON object at ``path`` (as the benchmarks and chaos runs do)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(summary)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def iter_corpus(directory: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    for p in sorted(directory.glob("*.json")):
        yield p, json.loads(p.read_text())


__all__ = ["Case", "Counters", "Harness", "fs", "write_results"]
