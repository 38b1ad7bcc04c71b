"""A hostile neighbour: two jobs on one sidecar, one of them attacking it while the other saves
and restores.

The sidecar runs as its own process (``python -m sidecar.cli sidecar``), as in a pod: an attack
that kills it (SIGBUS) kills only it, and the harness sees its exit status. Storage is a real
SeaweedFS. The victim is a two-rank job using the real trainer client over the unix socket, with
shared-memory saves on. The attacker speaks raw gRPC/protobuf (``sidecar.api``) and touches the
shared-memory directory directly, as a hostile process in the same pod could.

Each scenario (one per kind of attack) runs every victim step under a timeout, so a hang is a
failure, not a stuck test. Its :class:`Outcome` separates what happened to the victim (wrong bytes,
a failed or hung save or restore, its held snapshot removed, the sidecar gone) from how the
sidecar answered the attacker (it must refuse bad input, or fail that one request, with a status
that names the problem; never hang, die or answer UNKNOWN/INTERNAL). Used by
``test_hostile_neighbour.py`` (every scenario must come out clean) and by the bench section
``neighbour`` (which counts victim failures).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from sidecar.api import PROTOCOL_VERSION, SHM_LENT_PATTERN, channel_options, pb, pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
#: Longest a victim step (a save to durable, a restore) or an attacker call may take. A healthy
#: sidecar needs well under a second for these small states; a hang shows as this timeout.
STEP_TIMEOUT_S = 15.0
#: Memory budget of the sidecar in the oversized-request scenario, and the most its resident set
#: may grow beyond it (interpreter arenas, gRPC buffers, the victim's small snapshots).
BUDGET = 16 * MiB
RSS_SLACK = 48 * MiB
#: Status codes that are no answer to bad input: the sidecar is down or hung, or it failed
#: without saying what was wrong.
UNCLEAR = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


class VictimFailure(Exception):
    """Something the attacker must never cause: the victim's save or restore failed, hung, or
    returned other bytes; its held snapshot was removed; the sidecar died."""


@dataclass
class Outcome:
    scenario: str
    #: what the attack did to the victim (empty: nothing)
    victim: list[str] = field(default_factory=list)
    #: how the sidecar mishandled the attacker's requests (empty: each refused or failed clearly)
    handling: list[str] = field(default_factory=list)
    #: every attacker call and its answer, for the report
    answers: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.victim and not self.handling

    def report(self) -> str:
        lines = [f"scenario {self.scenario}:"]
        lines += [f"  victim: {v}" for v in self.victim]
        lines += [f"  sidecar's answer to the attacker: {h}" for h in self.handling]
        lines += [f"  attacker call: {a}" for a in self.answers[:12]]
        if len(self.answers) > 12:
            lines.append(f"  ... {len(self.answers) - 12} more attacker calls")
        return "\n".join(lines)


# --- the sidecar, in its own process ---------------------------------------------------------------


def take_handoff(shm_dir: str, name: str) -> None:
    from trainer_client._staging import open_segment

    if re.fullmatch(SHM_LENT_PATTERN, name):
        with contextlib.suppress(OSError):
            os.close(open_segment(shm_dir, name))
    else:
        (Path(shm_dir) / name).unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SidecarProcess:
    """``strata sidecar`` as a child process with its own socket, shm dir and peer port."""

    def __init__(self, work: Path, storage: str, endpoint: str, **flags: Any) -> None:
        self.work = work
        self.shm_dir = work / "shm"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.socket = str(work / "sc.sock")
        self.peer_port = free_port()
        self.log = work / "sidecar.log"
        args = {
            "storage": storage,
            "s3-endpoint": endpoint,
            "socket": self.socket,
            "shm-dir": str(self.shm_dir),
            "metrics-port": 0,
            "peer-port": self.peer_port,
            "keep": 0,
            "commit-timeout-s": 20,
            "encode-workers": 1,
            "nice": 0,
            **{k.replace("_", "-"): v for k, v in flags.items()},
        }
        cmd = [sys.executable, "-m", "sidecar.cli", "sidecar"]
        for key, value in args.items():
            cmd += [f"--{key}", str(value)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work)
        deadline = time.monotonic() + 60
        while "ready on" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the sidecar did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def down(self) -> str:
        """Why the sidecar is not up and answering, or ""."""
        code = self.proc.poll()
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            return f"the sidecar process died ({how})"
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            try:
                pb_grpc.CheckpointerStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
            except grpc.RpcError as exc:
                return f"the sidecar does not answer GetStatus ({exc.code().name}: {exc.details()})"
        return ""

    def rss(self) -> int:
        """Private resident memory of the sidecar process (RssAnon: not the segment pages it maps,
        not its encoding workers), in bytes."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^RssAnon:\s+(\d+) kB", text, re.M)
        assert match, text
        return int(match.group(1)) * 1024

    def stop(self) -> None:
        """SIGTERM, then SIGKILL: a hung sidecar must not outlive its scenario."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def within(seconds: float, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread; VictimFailure when it does not finish in ``seconds`` (the
    thread stays blocked until the sidecar is stopped)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True, name=f"step {what}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise VictimFailure(f"{what} hung (not done after {seconds:g} s)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# --- the victim: a two-rank job through the real trainer client -------------------------------------


def victim_state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "w": torch.randn(256, 256, generator=g),
        "emb": torch.randn(512, 32, generator=g).to(torch.bfloat16),
        "count": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "meta": {"step": step, "rank": rank, "lr": 0.1 / (step + 1), "tag": f"victim-{step}"},
    }


def blank_state() -> dict[str, Any]:
    return {
        "w": torch.zeros(256, 256),
        "emb": torch.zeros(512, 32, dtype=torch.bfloat16),
        "count": torch.zeros(1000, dtype=torch.int64),
        "meta": {},
    }


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What differs, bit for bit."""
    out = []
    for key, value in want.items():
        other = got.get(key)
        if isinstance(value, torch.Tensor):
            same = (
                isinstance(other, torch.Tensor)
                and other.dtype == value.dtype
                and other.shape == value.shape
                and torch.equal(other.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8))
            )
        else:
            same = other == value
        if not same:
            out.append(key)
    return out


class Victim:
    """A two-rank job on the sidecar at ``socket_path``: one real client per rank, shared-memory
    saves on (``shm``); ``down`` says why the sidecar is not up, when a step fails."""

    def __init__(
        self,
        socket_path: str,
        down: Callable[[], str] = lambda: "",
        *,
        generation: str = "victim/0",
        shm: str = "auto",
        job: str = "",
    ) -> None:
        from trainer_client import CheckpointClient

        self.job = job or "victim-" + uuid.uuid4().hex[:8]
        self.clients = [
            within(
                STEP_TIMEOUT_S,
                f"the victim's rank {rank} connecting",
                functools.partial(
                    CheckpointClient,
                    job=self.job,
                    socket=socket_path,
                    rank=rank,
                    world_size=2,
                    generation=generation,
                    capture_rng=False,
                    shm=shm,
                    connect_timeout_s=10,
                    commit_timeout_s=STEP_TIMEOUT_S,
                ),
            )
            for rank in range(2)
        ]
        self.down = down
        self.saved: int | None = None

    def save(self, step: int) -> None:
        def both() -> None:
            handles = [c.save(step, victim_state(step, r)) for r, c in enumerate(self.clients)]
            for r, h in enumerate(handles):
                if h.skipped:
                    raise VictimFailure(f"the victim's rank {r} skipped step {step}")
                h.durable.result(STEP_TIMEOUT_S)

        self._step(f"the victim's save of step {step}", both)
        self.saved = step

    def restore(self, step: int, *, memory: bool = True) -> None:
        """Both ranks restore ``step``: exactly what they saved (from the sidecar's memory when
        ``memory``)."""

        def both() -> None:
            for rank, client in enumerate(self.clients):
                out = blank_state()
                got = client.restore(out)
                if got != step:
                    raise VictimFailure(f"the victim's rank {rank} restored step {got}, not step {step}")
                wrong = differences(out, victim_state(step, rank))
                if wrong:
                    raise VictimFailure(
                        f"the victim's rank {rank} restored step {step} with other bytes in {wrong} "
                        f"(from {client.last_restore['source']}, shared memory "
                        f"{client.last_restore['shared_memory']})"
                    )
                source = client.last_restore["source"]
                if memory and source != "memory":
                    raise VictimFailure(
                        f"the victim's rank {rank} restored step {step} from {source}, not from the "
                        f"sidecar's memory (fallback: {client.last_restore['fallback_reason']!r})"
                    )

        self._step(f"the victim's restore of step {step}", both)

    def _step(self, what: str, fn: Callable[[], None]) -> None:
        try:
            within(STEP_TIMEOUT_S, what, fn)
        except VictimFailure as exc:
            down = self.down()
            raise VictimFailure(f"{exc}; {down}" if down else str(exc)) from None
        except Exception as exc:
            down = self.down()
            raise VictimFailure(
                f"{what} failed: {type(exc).__name__}: {exc}" + (f"; {down}" if down else "")
            ) from None

    def staging_prefixes(self) -> list[str]:
        """Names of the segments the victim's clients stage into themselves (not yet handed over)."""
        out = []
        for client in self.clients:
            instance = getattr(getattr(client, "_segments", None), "instance", None)
            if instance:
                out.append(f"strata-{instance}-")
        return out

    def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.close(wait=False)


# --- the attacker: raw gRPC and direct file access ------------------------------------------------


class Attacker:
    """Another job's trainer on the same sidecar, as hostile as a local process can be."""

    def __init__(self, sidecar: SidecarProcess, outcome: Outcome) -> None:
        self.sidecar = sidecar
        self.outcome = outcome
        self.job = "attacker-" + uuid.uuid4().hex[:8]
        self.instance = uuid.uuid4().hex[:16]
        self.channel = grpc.insecure_channel(f"unix:{sidecar.socket}", options=channel_options(128 * MiB))
        self.stub = pb_grpc.CheckpointerStub(self.channel)
        self._count = 0

    def identity(self, rank: int = 0, world_size: int = 1, job: str | None = None) -> pb.Identity:
        return pb.Identity(
            namespace="default",
            job=job or self.job,
            rank=rank,
            world_size=world_size,
            attempt=0,
            generation="attacker/0",
        )

    def segment(self, size: int, name: str | None = None) -> tuple[Path, int]:
        """A segment file in the shm dir, filled; its path and an open read-write descriptor."""
        if name is None:
            name = f"strata-{self.instance}-{self._count}"
            self._count += 1
        path = self.sidecar.shm_dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(fd, os.urandom(size), 0)
        return path, fd

    def save(
        self,
        what: str,
        step: int,
        nbytes: int,
        *,
        segment: str = "",
        tensors: list[pb.TensorMeta] | None = None,
        wire_tensors: bytes = b"",
        tree: bytes = b"",
        rank: int = 0,
        world_size: int = 1,
        job: str | None = None,
        between: Callable[[], None] | None = None,
        timeout: float = STEP_TIMEOUT_S,
    ) -> pb.SaveAck | None:
        """One Save stream: the header, then (streamed) the bytes, then the footer. The answer is
        checked (a clear refusal or an ack) and recorded; the ack, or None. ``wire_tensors``: more
        TensorMeta entries, as header wire bytes."""
        if tensors is None:
            tensors = [pb.TensorMeta(name="w", dtype="uint8", shape=[nbytes], nbytes=nbytes)]
        header = pb.SaveHeader(
            protocol_version=PROTOCOL_VERSION,
            identity=self.identity(rank, world_size, job),
            step=step,
            save_id=uuid.uuid4().hex[:16],
            tensors=tensors,
            tree=tree,
        )
        if segment:
            header.shm.CopyFrom(pb.SharedSegment(name=segment, size=nbytes))
        header.MergeFromString(wire_tensors)

        def requests() -> Iterator[pb.SaveRequest]:
            yield pb.SaveRequest(header=header)
            if between is not None:
                between()
            if not segment:
                for start in range(0, nbytes, 4 * MiB):
                    yield pb.SaveRequest(chunk=bytes(min(4 * MiB, nbytes - start)))
            yield pb.SaveRequest(footer=pb.SaveFooter(total_bytes=nbytes))

        return self.call(what, lambda: self.stub.Save(requests(), timeout=timeout))

    def wait_committed(self, what: str, step: int, ack: pb.SaveAck, **ident: Any) -> pb.CommitStatus | None:
        req = pb.WaitCommittedRequest(
            identity=self.identity(**ident),
            step=step,
            save_id=ack.save_id,
            timeout_seconds=STEP_TIMEOUT_S - 5,
        )
        status = self.call(what, lambda: self.stub.WaitCommitted(req, timeout=STEP_TIMEOUT_S))
        if status is not None and status.state == pb.COMMIT_STATE_FAILED and not status.message:
            self.outcome.handling.append(f"{what}: the commit failed without saying why")
        return status

    def restore(self, what: str, *, shm_ok: bool = True) -> None:
        req = pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=self.identity(), shm_ok=shm_ok)

        def read() -> int:
            n = 0
            for msg in self.stub.Restore(req, timeout=STEP_TIMEOUT_S):
                n += len(msg.chunk)
                if msg.HasField("header") and msg.header.shm_handoff:
                    # A copy handed over: the call ends once the client took it, as a client does
                    # (fetched the lent descriptor, or removed the file without a handover socket).
                    take_handoff(str(self.sidecar.shm_dir), msg.header.shm.name)
            return n

        self.call(what, read)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run one attacker call: record its answer; an unclear one (down, hung, UNKNOWN, INTERNAL,
        no details) is a handling failure."""
        try:
            value = fn()
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            self.outcome.answers.append(f"{what}: {code.name}: {details[:160]}")
            if code in UNCLEAR or not details:
                self.outcome.handling.append(f"{what} answered {code.name}: {details[:300]!r}")
            return None
        self.outcome.answers.append(f"{what}: OK")
        return value

    def close(self) -> None:
        self.channel.close()


# --- the scenarios --------------------------------------------------------------------------------


def truncated_segment(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 1: the attacker shrinks its segment after handing it over, before its footer, and again
    once its snapshot is committed and held, then asks for a restore from it."""
    victim.save(1)
    size = 1 * MiB
    path, fd = attacker.segment(size)
    try:

        def shrink_after_handover() -> None:
            deadline = time.monotonic() + 3
            while path.exists() and time.monotonic() < deadline:  # taken over (renamed), or refused
                time.sleep(0.01)
            os.ftruncate(fd, 0)

        ack = attacker.save(
            "save whose segment shrinks before its footer",
            1,
            size,
            segment=path.name,
            between=shrink_after_handover,
        )
        if ack is not None:
            attacker.wait_committed("commit of the shrunk save", 1, ack)
    finally:
        os.close(fd)
    victim.save(2)
    path, fd = attacker.segment(size)
    try:
        ack = attacker.save("save of a segment shrunk once held", 2, size, segment=path.name)
        if ack is not None and attacker.wait_committed("commit of that save", 2, ack) is not None:
            os.ftruncate(fd, 0)
            attacker.restore("restore of the shrunk held segment")
    finally:
        os.close(fd)
    victim.restore(2)


def fifo_segment(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 2: a FIFO named as the segment of a save, while the victim saves and restores."""
    victim.save(1)
    name = f"strata-{attacker.instance}-0"
    os.mkfifo(sidecar.shm_dir / name, 0o600)
    done = threading.Event()

    def attack() -> None:
        try:
            attacker.save("save naming a FIFO as its segment", 1, 4096, segment=name)
        finally:
            done.set()

    threading.Thread(target=attack, daemon=True).start()
    done.wait(1.0)  # refused at once, or (the failure) blocked in the sidecar: either way, go on
    try:
        victim.save(2)
        victim.restore(2)
    finally:
        if not done.wait(STEP_TIMEOUT_S + 5):
            outcome.handling.append("the save naming a FIFO never got an answer")


def strata_0_sweep(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 3: a segment named ``strata-0``, then a save from another instance, which makes the
    sidecar forget the first: no file of the victim's may go with it."""
    victim.save(1)
    before = {p.name: p.stat().st_ino for p in sidecar.shm_dir.iterdir()}
    for name, step in (("strata-0", 1), (f"strata-{attacker.instance}-0", 2)):
        path, fd = attacker.segment(64 * 1024, name=name)
        os.close(fd)
        ack = attacker.save(f"save of segment {name}", step, 64 * 1024, segment=name)
        if ack is not None:
            attacker.wait_committed(f"commit of segment {name}", step, ack)
    # The attacker also starts over as a new trainer of its job would (the sidecar sweeps its old
    # instance's segments then).
    path, fd = attacker.segment(64 * 1024, name=f"strata-{uuid.uuid4().hex[:16]}-0")
    os.close(fd)
    attacker.save("save from a new instance", 3, 64 * 1024, segment=path.name)
    gone = sorted(
        name
        for name, inode in before.items()
        if not (sidecar.shm_dir / name).exists() or (sidecar.shm_dir / name).stat().st_ino != inode
    )
    if gone:
        raise VictimFailure(f"the attacker's saves removed the victim's shared-memory files {gone}")
    victim.restore(1)
    victim.save(2)
    victim.restore(2)


def tree_bytes(nbytes: int) -> bytes:
    """A valid state skeleton of about ``nbytes``: one tensor and a long list of plain ints."""
    count = nbytes // 8
    junk = ",".join(str(10_000_000 + i % 9_000_000) for i in range(count))
    head = json.dumps({"format": "strata.tree", "version": 1, "num_tensors": 1}, separators=(",", ":"))
    return (head[:-1] + ',"root":{"w":{"$tensor":0},"junk":[' + junk + "]}}").encode()


def wide_tensor_list(count: int) -> bytes:
    """``count`` one-byte tensors ``t0``, ``t1``, ... as SaveHeader wire bytes, to merge into a
    header (building them as messages in a Python loop takes seconds)."""
    entries = []
    for i in range(count):
        name = f"t{i}".encode()
        # TensorMeta: name (1), dtype (2) "uint8", shape (3, packed) [1], nbytes (4) 1
        meta = b"\x0a" + bytes([len(name)]) + name + b"\x12\x05uint8\x1a\x01\x01\x20\x01"
        entries.append(b"\x2a" + bytes([len(meta)]) + meta)  # SaveHeader.tensors (5)
    return b"".join(entries)


def oversized_requests(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 4: saves whose trees and tensor lists far exceed the sidecar's --memory-budget. Every
    byte the sidecar keeps is charged or bounded: its resident set stays within the budget (plus
    slack), and the victim is unaffected."""
    victim.save(1)
    rss_before = sidecar.rss()
    tree = tree_bytes(8 * MiB)
    for step in (1, 2):  # a four-rank job: every rank's tree is held by the same sidecar
        threads = [
            threading.Thread(
                target=attacker.save,
                args=(f"rank {r}'s save of step {step} with an 8 MiB tree", step, 64),
                kwargs={"tree": tree, "rank": r, "world_size": 4},
                daemon=True,
            )
            for r in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(STEP_TIMEOUT_S + 5)
    attacker.save(
        "save declaring 200,000 tensors",
        1,
        200_000,
        tensors=[],
        wire_tensors=wide_tensor_list(200_000),
        job=attacker.job + "-wide",
    )
    victim.save(2)
    grown = sidecar.rss() - rss_before
    if grown > BUDGET + RSS_SLACK:
        outcome.handling.append(
            f"the sidecar's resident set grew by {grown / MiB:.0f} MiB under a {BUDGET / MiB:.0f} MiB "
            f"--memory-budget (allowed: budget + {RSS_SLACK / MiB:.0f} MiB)"
        )
    victim.restore(2)


def forged_hints(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 5: unsigned peer hints sent to the sidecar's peer port: skips and departures of the
    victim's ranks, hints with huge reasons, hints for a thousand job names. Each is refused."""
    victim.save(1)
    job = victim.job
    hints: list[tuple[str, pb.HintRequest]] = []
    for attempt in range(4):  # whichever attempt the victim runs as, the steps it saves next
        for step in range(1, 6):
            for rank in range(2):
                skip = pb.HintRequest(
                    namespace="default", job=job, attempt=attempt, step=step, skip=pb.SkipHint(rank=rank)
                )
                gone = pb.HintRequest(
                    namespace="default", job=job, attempt=attempt, step=step, gone=pb.GoneHint(rank=rank)
                )
                hints += [("forged skip hint", skip), ("forged gone hint", gone)]
    huge = pb.SkipHint(rank=1, reason="r" * (8 * MiB))
    hints += [
        ("hint with an 8 MiB reason", pb.HintRequest(namespace="default", job=job, step=100 + i, skip=huge))
        for i in range(4)
    ]
    hints += [
        ("hint for a new job name", pb.HintRequest(namespace="default", job=f"flood-{i}", gone=pb.GoneHint()))
        for i in range(1000)
    ]
    accepted: dict[str, int] = {}
    address = f"127.0.0.1:{sidecar.peer_port}"
    with grpc.insecure_channel(address, options=channel_options(64 * MiB)) as channel:
        stub = pb_grpc.PeerStub(channel)
        for kind, req in hints:
            try:
                stub.Hint(req, timeout=5)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code in UNCLEAR or not details:
                    outcome.handling.append(f"a {kind} answered {code.name}: {details[:200]!r}")
                    break  # down or hung: the rest would only wait out their timeouts
                if len(outcome.answers) < 12:
                    outcome.answers.append(f"{kind}: {code.name}: {details[:160]}")
                continue
            accepted[kind] = accepted.get(kind, 0) + 1
    for kind, n in accepted.items():
        outcome.handling.append(f"the sidecar accepted {n} unsigned {kind}(s)")
    victim.save(2)
    victim.restore(2)


def renamed_over_held(sidecar: SidecarProcess, victim: Victim, attacker: Attacker, outcome: Outcome) -> None:
    """Item 6: before the victim restores, the attacker renames files of its own over every file in
    the shm dir that holds the victim's committed snapshot (same size, other bytes)."""
    victim.save(1)
    own = tuple(victim.staging_prefixes())
    targets = [p for p in sidecar.shm_dir.iterdir() if p.is_file() and not p.name.startswith(own)]
    for target in targets:
        size = target.stat().st_size
        path, fd = attacker.segment(size)
        os.close(fd)
        os.rename(path, target)
        outcome.answers.append(f"renamed a {size}-byte file of random bytes over {target.name}")
    victim.restore(1)
    victim.save(2)
    victim.restore(2)


Scenario = Callable[[SidecarProcess, Victim, Attacker, Outcome], None]
#: name -> (attack, extra sidecar flags)
SCENARIOS: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "1-truncated-segment": (truncated_segment, {}),
    "2-fifo-segment": (fifo_segment, {}),
    "3-strata-0-sweep": (strata_0_sweep, {}),
    "4-oversized-requests": (oversized_requests, {"memory_budget": BUDGET}),
    "5-forged-hints": (forged_hints, {}),
    "6-renamed-over-held": (renamed_over_held, {}),
}


def run_scenario(name: str, work: Path, storage: str, endpoint: str) -> Outcome:
    """Run one scenario on a fresh sidecar; afterwards, a fresh sidecar on the same bucket must
    restore the victim's newest step exactly (the checkpoint in storage is unaffected too)."""
    attack, flags = SCENARIOS[name]
    outcome = Outcome(name)
    sidecar = SidecarProcess(work, storage, endpoint, **flags)
    victim = attacker = None
    try:
        victim = Victim(sidecar.socket, sidecar.down)
        attacker = Attacker(sidecar, outcome)
        attack(sidecar, victim, attacker, outcome)
        down = sidecar.down()
        if down:
            raise VictimFailure(down)
    except VictimFailure as exc:
        outcome.victim.append(str(exc))
    finally:
        if attacker is not None:
            attacker.close()
        if victim is not None:
            victim.close()
        sidecar.stop()
    if victim is not None and victim.saved is not None and not outcome.victim:
        try:
            check_storage(work / "check", storage, endpoint, victim)
        except VictimFailure as exc:
            outcome.victim.append(f"in storage: {exc}")
    return outcome


def check_storage(work: Path, storage: str, endpoint: str, victim: Victim) -> None:
    """The victim's newest step as a new sidecar (in this process: no attacker here) reads it from
    the bucket: bit for bit."""
    from sidecar.config import SidecarSettings
    from sidecar.metrics import Metrics
    from sidecar.server import SidecarServer

    work.mkdir(parents=True, exist_ok=True)
    settings = SidecarSettings(
        storage=storage, s3_endpoint=endpoint, socket=str(work / "check.sock"), shm_dir="", metrics_port=0
    )
    fresh = SidecarServer(settings, metrics=Metrics()).start()
    reader = None
    try:
        reader = Victim(fresh.socket_path, generation="victim/1", shm="off", job=victim.job)
        assert victim.saved is not None
        reader.restore(victim.saved, memory=False)
    finally:
        if reader is not None:
            reader.close()
        fresh.stop(grace=1)
