"""What one request may make the sidecar hold, and how a bad one is answered, through a real
sidecar over real gRPC: state trees and tensor lists are bounded by documented limits and
charged to the memory budget, a tree is checked whole (depth, strict JSON) before the save is
acknowledged, a failure after the acknowledgement fails the step for every rank at once, and a
malformed job name in a read-only call is INVALID_ARGUMENT."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from sidecar import faults
from sidecar import manifest as mf
from sidecar.api import PROTOCOL_VERSION, channel_options, pb, pb_grpc
from trainer_client import SaveFailed

MiB = 1 << 20
GENERATION = "limits/0"


def identity(job: str, rank: int = 0, world: int = 1) -> pb.Identity:
    return pb.Identity(namespace="default", job=job, rank=rank, world_size=world, generation=GENERATION)


def stream(
    job: str, step: int, tree: bytes, tensors: list[pb.TensorMeta] | None = None
) -> list[pb.SaveRequest]:
    tensors = (
        tensors if tensors is not None else [pb.TensorMeta(name="w", dtype="float32", shape=[4], nbytes=16)]
    )
    total = sum(t.nbytes for t in tensors)
    head = pb.SaveHeader(
        protocol_version=PROTOCOL_VERSION,
        identity=identity(job),
        step=step,
        save_id=f"s{step}",
        tensors=tensors,
        tree=tree,
    )
    return [
        pb.SaveRequest(header=head),
        pb.SaveRequest(chunk=bytes(total)),
        pb.SaveRequest(footer=pb.SaveFooter(total_bytes=total)),
    ]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


@pytest.fixture
def stub(make_sidecar):
    server = make_sidecar()
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(64 * MiB))
    yield pb_grpc.CheckpointerStub(channel), server
    channel.close()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        (nested(5000), "nested deeper than"),  # past the interpreter's recursion limit
        (nested(200), "nested deeper than 128"),  # parses, but no reader should have to recurse that far
        (b'{"lr": NaN}', "NaN"),
        (b'{"lr": -Infinity}', "-Infinity"),
        (b'{"lr": 1e400}', "not finite"),  # parses to inf: no MANIFEST could hold it
    ],
    ids=["deep", "deeper-than-the-limit", "nan", "infinity", "overflow"],
)
def test_a_bad_tree_is_invalid_argument_before_the_save_is_acknowledged(stub, job_name, tree, match):
    s, server = stub
    code, details = status_of(lambda: s.Save(iter(stream(job_name, 1, tree)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "state tree" in details and match in details, details
    assert server.engine.snapshots() == [] and server.engine.memory.used == 0
    s.Save(iter(stream(job_name, 2, b'{"lr": 0.1}')), timeout=30)  # still serving
    done = s.WaitCommitted(
        pb.WaitCommittedRequest(identity=identity(job_name), step=2, save_id="s2", timeout_seconds=30)
    )
    assert done.state == pb.COMMIT_STATE_COMMITTED, done.message


def test_a_header_past_the_tensor_limit_is_refused_naming_it(stub, job_name):
    s, server = stub
    many = [pb.TensorMeta(name=f"t{i}", dtype="uint8", shape=[1], nbytes=1) for i in range(200_000)]
    code, details = status_of(lambda: s.Save(iter(stream(job_name, 1, b"{}", many)), timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "200000 tensors" in details and "--max-tensors" in details, details
    assert server.engine.snapshots() == []


def test_names_and_trees_past_their_limits_are_refused_naming_them(stub, job_name):
    s, _ = stub
    long_name = [pb.TensorMeta(name="n" * 5000, dtype="float32", shape=[4], nbytes=16)]
    code, details = status_of(lambda: s.Save(iter(stream(job_name, 1, b"{}", long_name)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1024 bytes" in details, details
    many_dims = [pb.TensorMeta(name="w", dtype="float32", shape=[1] * 100, nbytes=4)]
    code, details = status_of(lambda: s.Save(iter(stream(job_name, 1, b"{}", many_dims)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "100 dimensions" in details, details
    big = b'["' + b"x" * (17 * MiB) + b'"]'  # over the default --max-tree-bytes (16 MiB)
    code, details = status_of(lambda: s.Save(iter(stream(job_name, 1, big)), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-tree-bytes" in details, details


def test_describe_and_list_with_a_malformed_name_are_invalid_argument(stub):
    s, _ = stub
    for job in ("Bad Name", "evil/../x", ""):
        code, details = status_of(
            lambda job=job: s.ListCheckpoints(pb.ListCheckpointsRequest(namespace="default", job=job))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "job" in details, (job, details)
        code, details = status_of(
            lambda job=job: s.DescribeCheckpoint(
                pb.DescribeCheckpointRequest(namespace="default", job=job, step=1, rank=0)
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "job" in details, (job, details)
    code, details = status_of(
        lambda: s.DescribeCheckpoint(pb.DescribeCheckpointRequest(namespace="NS", job="ok", step=1))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in details, details


def test_a_failure_after_the_acknowledgement_fails_the_step_for_the_other_rank_at_once(
    make_sidecar, make_client, job_name
):
    """An unexpected error while persisting (here an injected one) leaves a skip for the gang:
    rank 0 stops waiting at once instead of at the commit timeout."""
    server = make_sidecar(commit_timeout_s=600)
    ranks = [make_client(server, job_name, rank=r, world_size=2, generation="lim/0") for r in range(2)]
    faults.arm("sidecar.upload.object@1=raise")
    try:
        with pytest.raises(SaveFailed, match="fault injected"):
            ranks[1].save(1, {"w": torch.ones(4)}).durable.result(60)
    finally:
        faults.arm(None)
    # Bounded wait far below the commit timeout: the failure must come from rank 1's skip.
    with pytest.raises(SaveFailed, match=r"rank\(s\) \[1\] did not save it"):
        ranks[0].save(1, {"w": torch.zeros(4)}).durable.result(60)
    assert not mf.is_committed(server.store, "default", job_name, 1)
    for r in range(2):  # the next step commits as usual
        handle = ranks[r].save(2, {"w": torch.full((4,), float(r))})
    assert handle.durable.result(60).step == 2


# --- the memory budget, measured on a sidecar process ------------------------------------


def _rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _explosive(nbytes: int) -> bytes:
    """A JSON list of empty objects: each 3 bytes on the wire, ~70 bytes once parsed."""
    n = max(1, nbytes // 3)
    return b"[" + b"{}," * (n - 1) + b"{}]"


def test_big_trees_are_charged_to_the_budget_and_the_sidecar_stays_within_it(tmp_path, short_tmp, job_name):
    budget = 64 * MiB
    sock = short_tmp / "b.sock"
    strata = str(Path(sys.executable).parent / "strata")
    proc = subprocess.Popen(
        [
            strata,
            "sidecar",
            "--storage",
            f"file://{tmp_path / 'store'}",
            "--socket",
            str(sock),
            "--metrics-port",
            "0",
            "--shm-dir",
            "",
            "--encode-workers",
            "1",
            "--memory-budget",
            str(budget),
        ],
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    channel = grpc.insecure_channel(f"unix:{sock}", options=channel_options(64 * MiB))
    try:
        s = pb_grpc.CheckpointerStub(channel)
        grpc.channel_ready_future(channel).result(timeout=60)

        def save(step: int, tree: bytes) -> str:
            """ "committed", or the status and details of a refusal."""
            try:
                s.Save(iter(stream(job_name, step, tree)), timeout=120)
            except grpc.RpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            done = s.WaitCommitted(
                pb.WaitCommittedRequest(
                    identity=identity(job_name), step=step, save_id=f"s{step}", timeout_seconds=120
                ),
                timeout=130,
            )
            return "committed" if done.state == pb.COMMIT_STATE_COMMITTED else done.message

        assert save(1, b'{"lr": 0.1}') == "committed"  # warm: gRPC, the store, the committer
        time.sleep(0.5)  # let the interpreter settle before the baseline (not an assertion)
        baseline, _ = _rss_mib(proc.pid)
        outcomes = [save(step, _explosive(4 * MiB)) for step in range(2, 6)]
        outcomes += [save(step, _explosive(256 * 1024)) for step in range(6, 10)]
        assert proc.poll() is None
        _, peak = _rss_mib(proc.pid)
        # The budget plus a generous fixed margin for what is not charged (gRPC's copy of one
        # message, allocator slack): far below what holding the trees would take.
        assert peak - baseline < budget / MiB + 96, (baseline, peak, outcomes)
        for outcome in outcomes[:4]:  # 4 MiB of "{}" needs more than the whole 64 MiB budget
            assert outcome != "committed" and "--memory-budget" in outcome, outcome
        assert outcomes[4:] == ["committed"] * 4  # small ones fit (charged, then given back)
        assert save(10, b'{"lr": 0.2}') == "committed"
    finally:
        channel.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_skip_reason_is_kept_bounded(stub, job_name):
    s, server = stub
    ident = identity(job_name)
    s.ReportSkip(pb.ReportSkipRequest(identity=ident, step=3, reason="r" * (8 * MiB)), timeout=30)
    gang = server.engine.gang(("default", job_name))
    (news,) = [n for (_, step), n in gang.steps.items() if step == 3]
    assert 0 < len(news.skipped[0]) <= 1024, len(news.skipped[0])
    marker = mf.skip_key("default", job_name, 3, next(iter(gang.steps))[0], 0)
    assert len(server.store.get(marker)) <= 4096


# --- per-rank state across identities -----------------------------------------------------


def _commit_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("strata-commit")]


def test_new_ranks_past_the_cap_are_refused_naming_it_while_another_job_saves(
    make_sidecar, make_client, job_name
):
    """Each (namespace, job, rank) a save names holds state here; a client naming ever new ones
    is refused at ``--max-ranks`` while a job already saving goes on saving and restoring."""
    server = make_sidecar(max_ranks=4)
    victim = make_client(server, job_name, rank=0, world_size=1, generation=GENERATION)
    assert victim.save(1, {"w": torch.ones(4)}).durable.result(60).step == 1
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(64 * MiB))
    s = pb_grpc.CheckpointerStub(channel)
    try:
        for i in range(3):  # world size 1: each commits and its copy stays held for restores
            hostile = f"{job_name}-h{i}"
            s.Save(iter(stream(hostile, 1, b"{}")), timeout=30)
            done = s.WaitCommitted(
                pb.WaitCommittedRequest(identity=identity(hostile), step=1, save_id="s1", timeout_seconds=30)
            )
            assert done.state == pb.COMMIT_STATE_COMMITTED, done.message
        code, details = status_of(lambda: s.Save(iter(stream(f"{job_name}-h3", 1, b"{}")), timeout=30))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "--max-ranks" in details and "STRATA_MAX_RANKS" in details, details
    finally:
        channel.close()
    assert victim.save(2, {"w": torch.full((4,), 2.0)}).durable.result(60).step == 2
    out = {"w": torch.zeros(4)}
    assert victim.restore(out) == 2
    assert torch.equal(out["w"], torch.full((4,), 2.0))


def test_idle_ranks_keep_no_committer_thread(stub, job_name):
    """A rank's committer thread lives while it has snapshots to persist: ranks that saved once
    do not each keep a thread (threads are what a client naming ever new ranks would exhaust)."""
    s, _ = stub
    before = len(_commit_threads())
    for i in range(24):
        job = f"{job_name}-{i}"
        s.Save(iter(stream(job, 1, b"{}")), timeout=30)
        done = s.WaitCommitted(
            pb.WaitCommittedRequest(identity=identity(job), step=1, save_id="s1", timeout_seconds=30)
        )
        assert done.state == pb.COMMIT_STATE_COMMITTED, done.message
    deadline = time.monotonic() + 30  # a committer ends just after its last commit is announced
    while len(_commit_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_commit_threads()) <= before, _commit_threads()


_HANDOVER_UNDER_A_LOW_LIMIT = r"""
import os, resource, socket, sys, tempfile, time
from sidecar.server.app import raise_nofile
from sidecar.shm import Handover

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
assert soft == 256, soft
h = Handover(tempfile.mkdtemp(dir=sys.argv[1]), ".strata-segments-0123456789abcdef.sock", 0o600)
held = h.max_connections * (1 + h.MAX_PENDING) + h.max_lent
assert 1 <= h.max_connections and held <= soft // 4, (h.max_connections, h.max_lent)
clients = []
for _ in range(100):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(h.path)
    clients.append(c)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:  # each connection past the limit is closed as accepted
    closed = 0
    for c in clients:
        try:
            closed += c.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
        except BlockingIOError:
            pass
    if closed == len(clients) - h.max_connections:
        break
    time.sleep(0.02)
assert len(h._by_conn) <= h.max_connections and closed == len(clients) - h.max_connections, closed
h.close()
assert raise_nofile() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
print("ok", h.max_connections, h.max_lent)
"""


def test_the_handover_socket_holds_at_most_a_quarter_of_the_open_files_limit(short_tmp):
    """Connections to the segment handover socket and the descriptors pending on them are
    bounded by the open-files limit, so they cannot starve the sidecar's own files; a sidecar
    raises its soft limit to the hard one."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"hard open-files limit {hard} below the 256 this test sets")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    done = subprocess.run(
        [sys.executable, "-c", _HANDOVER_UNDER_A_LOW_LIMIT, str(short_tmp)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low_limit,
        env={**os.environ, "PYTHONPATH": str(Path(faults.__file__).resolve().parents[1])},
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
