"""torch.distributed.checkpoint through the sidecar: FSDP2 (DTensor) state saved on 4 ranks with
StrataWriter (dcp.save, and dcp.async_save staged by the writer) loads on 2 and on 3 ranks with
StrataReader, bit for bit (gathered parameters and Adam state); the first checkpoint after the
resharded load is a full one; a checkpoint not saved through DCP is named as such. Real rank
processes (gloo, CPU), a real sidecar, real storage."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from statecheck import assert_bitwise_equal

from sidecar import cli
from sidecar import manifest as mf
from sidecar.reporting import stored_commit_items
from trainer_client import RestoreError
from trainer_client.dcp import StrataReader, committed_step

RANKS = Path(__file__).with_name("dcp_ranks.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(socket_path: str, job: str, generation: str, world: int, *args: str) -> list[dict]:
    """Run ``world`` rank processes of dcp_ranks.py; their reports, by rank."""
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANKS), *args],
            env=dict(
                os.environ,
                STRATA_SOCKET=socket_path,
                STRATA_JOB=job,
                STRATA_RANK=str(r),
                STRATA_WORLD_SIZE=str(world),
                STRATA_GENERATION=generation,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outs)
    reports = [
        json.loads(line[7:]) for out in outs for line in out.splitlines() if line.startswith("REPORT ")
    ]
    return sorted(reports, key=lambda r: r["rank"])


def test_fsdp2_saved_on_four_ranks_loads_on_two_and_three(make_sidecar, job_name, tmp_path):
    server = make_sidecar()
    saved_file = tmp_path / "saved.pt"
    wrote = run_ranks(server.socket_path, job_name, "dcp/0", 4, "save", str(saved_file))
    saved = torch.load(saved_file, weights_only=True)
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2, 3]
    # the second async save staged into the buffers the first one used (no allocation)
    assert [r["stage_reused"] for r in wrote] == [[False, True]] * 4
    commit = mf.read_commit(server.store, "default", job_name, 3)
    assert commit.world_size == 4
    # one commit per step: the coordinator's snapshot carries DCP's metadata (what makes it
    # reshardable for the launcher), the others only their items
    assert [mf.load_manifest(server.store, commit, r).dcp for r in range(4)] == [True, False, False, False]
    # ... and its commit report tells the operator so (a gang of another size is not refused)
    [item] = stored_commit_items(server.store, "default", job_name, "file://x", [(commit.attempt, 3)])
    assert item["reshardable"] is True and item["world_size"] == 4

    # 4 -> 2: the newest step (an async save), held in this sidecar's memory.
    two = run_ranks(server.socket_path, job_name, "dcp/1", 2, "load", str(tmp_path / "two.pt"), "newest", "4")
    assert [r["step"] for r in two] == [3, 3] and [r["saved_by"] for r in two] == [4, 4]
    assert [r["committed"] for r in two] == [3, 3]
    assert_bitwise_equal(torch.load(tmp_path / "two.pt", weights_only=True), saved[3])
    # FSDP2 shards dim 0: rank 0 of 2 reads what ranks 0 and 1 of 4 saved, rank 1 ranks 2 and 3
    # (the optimizer's replicated step counters lie on the rank DCP chose to write them)
    assert {"0", "1"} <= set(two[0]["sources"]) and {"2", "3"} <= set(two[1]["sources"])
    assert {src for r in two for src in r["sources"].values()} == {"memory"}
    # the first checkpoint after the resharded load: full on every rank
    step4 = mf.read_commit(server.store, "default", job_name, 4)
    assert step4.world_size == 2
    assert [mf.load_manifest(server.store, step4, r).checkpoint for r in range(2)] == ["full", "full"]

    # 4 -> 3: an older step, named, from storage (memory holds only each rank's newest).
    three = run_ranks(server.socket_path, job_name, "dcp/2", 3, "load", str(tmp_path / "three.pt"), "1", "5")
    assert [r["step"] for r in three] == [1, 1, 1]
    assert_bitwise_equal(torch.load(tmp_path / "three.pt", weights_only=True), saved[1])
    assert "storage" in {src for r in three for src in r["sources"].values()}


PLAIN_DCP = """
import sys

class NoStrata:  # prove the checkpoint needs nothing of Strata: importing it fails here
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("trainer_client", "sidecar"):
            raise ImportError(f"{name} must not be needed to load a plain DCP checkpoint")
        return None

sys.meta_path.insert(0, NoStrata())
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

directory, out = sys.argv[1], sys.argv[2]
metadata = FileSystemReader(directory).read_metadata()
state = {
    fqn: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    for fqn, md in metadata.state_dict_metadata.items()
}
dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
torch.save(state, out)
"""


def dotted(full: dict) -> dict:
    """A gathered state in DCP's flat names ("model.0.weight", "optim.state.0.weight.exp_avg")."""
    out = {f"model.{k}": v for k, v in full["model"].items()}
    for param, per in full["optim"]["state"].items():
        out.update({f"optim.state.{param}.{k}": v for k, v in per.items()})
    for i, group in enumerate(full["optim"]["param_groups"]):
        out.update({f"optim.param_groups.{i}.{k}": v for k, v in group.items()})
    return out


def test_an_export_is_a_plain_dcp_checkpoint(make_sidecar, make_client, job_name, tmp_path, short_tmp):
    """`strata export --format dcp` writes what dcp.load with FileSystemReader reads, in a process
    that cannot import Strata, for a checkpoint saved by 4 FSDP2 ranks."""
    server = make_sidecar()
    run_ranks(server.socket_path, job_name, "dcp/0", 4, "save", str(tmp_path / "saved.pt"))
    saved = dotted(torch.load(tmp_path / "saved.pt", weights_only=True)[3])
    out = tmp_path / "exported"
    store = ["--storage", server.settings.storage, "--job", job_name]
    assert cli.main(["export", *store, "--format", "dcp", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    loaded = subprocess.run(
        [sys.executable, "-c", PLAIN_DCP, str(out), str(tmp_path / "plain.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=short_tmp,  # not the repository: nothing of it on sys.path
    )
    assert loaded.returncode == 0, loaded.stderr
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert plain.keys() == saved.keys()
    tensors = {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}
    assert_bitwise_equal({k: plain[k] for k in tensors}, tensors)
    assert {k: plain[k] for k in saved if k not in tensors} == {
        k: v for k, v in saved.items() if k not in tensors
    }
    # a checkpoint not saved through DCP has no metadata to export
    other = make_client(server, job_name + "-plain", capture_rng=False)
    other.save(1, {"w": torch.ones(3)}).result(30)
    with pytest.raises(SystemExit, match=r"not saved through torch\.distributed\.checkpoint"):
        cli.main(
            [
                "export",
                "--storage",
                server.settings.storage,
                "--job",
                job_name + "-plain",
                "--format",
                "dcp",
                "--out",
                str(tmp_path / "x"),
            ]
        )


def test_a_checkpoint_not_saved_through_dcp_is_named(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    assert committed_step(client) is None  # nothing committed yet: a first run
    client.save(7, {"w": torch.ones(3)}).result(30)
    with pytest.raises(RestoreError, match=r"step 7 .* was not saved through torch.distributed.checkpoint"):
        StrataReader(client, step=7).read_metadata()
    # reads of a rank the commit does not have, or of a step without a commit, say so
    with pytest.raises(RestoreError, match=r"INVALID_ARGUMENT: rank 3: step 7 .* was saved by 1 ranks"):
        client._read_rank(3, step=7)
    with pytest.raises(RestoreError, match=r"NOT_FOUND: step 8 .* has no valid COMMIT"):
        StrataReader(client, step=8).read_metadata()


def test_launch_resumes_a_dcp_checkpoint_on_fewer_ranks(tmp_path):
    """`strata launch` refuses a changed world size only where the checkpoint cannot be resharded:
    one saved through DCP by 4 ranks resumes on 2."""
    store = f"file://{tmp_path}/store"

    def launch(nproc: int, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(Path(sys.executable).parent / "strata"),
                "launch",
                "--nproc",
                str(nproc),
                "--job",
                "dcp",
                "--storage",
                store,
                "--workdir",
                str(tmp_path / "w"),
                "--",
                sys.executable,
                str(RANKS),
                *command,
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )

    first = launch(4, "save", str(tmp_path / "saved.pt"))
    assert first.returncode == 0, first.stdout + first.stderr
    second = launch(2, "load", str(tmp_path / "two.pt"), "newest", "4")
    assert second.returncode == 0, second.stdout + second.stderr  # not refused (exit 2)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert_bitwise_equal(torch.load(tmp_path / "two.pt", weights_only=True), saved[3])


def test_any_rank_of_another_world_size_comes_from_the_pod_that_holds_it(two_pods, make_client, job_name):
    """The sidecar side of a resharded load, without DCP: a job of 1 rank reads each rank of a
    step 2 ranks saved on two pods: rank 0 from its own sidecar's memory, rank 1 from the other
    pod's (a peer), bit for bit; its next checkpoint is full."""
    pods = two_pods[0]()
    states = [{"w": torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256) + r} for r in range(2)]
    old = [
        make_client(pods[r], job_name, rank=r, world_size=2, generation="two/0", capture_rng=False)
        for r in range(2)
    ]
    for h in [c.save(4, s) for c, s in zip(old, states, strict=True)]:
        h.result(60)
    for c in old:
        c.close()
    one = make_client(pods[0], job_name, generation="one/0", capture_rng=False, resume="never")
    for rank in range(2):
        header, tensors = one._read_rank(rank)  # the step this attempt restores: 4
        assert (header.step, header.world_size) == (4, 2)
        assert header.source == ("memory" if rank == 0 else "peer")
        assert torch.equal(tensors[0], states[rank]["w"])
    assert pods[0].metrics.reshard_reads.labels(job_name, "peer")._value.get() == 1
    # one row changed since what rank 0 of the old job saved on this sidecar: a diff, but for the
    # chain having ended with the read of a step another world size saved
    changed = states[0]["w"].clone()
    changed[0] += 1
    one.save(5, {"w": changed}).result(60)
    store = pods[0].store
    assert mf.load_manifest(store, mf.read_commit(store, "default", job_name, 5), 0).checkpoint == "full"


def test_samples_are_read_once_across_four_two_four_ranks(make_sidecar, job_name, tmp_path):
    """A ResumableLoader's position of every rank, saved through DCP as one value (AllRanksState):
    4 ranks read 3 batches each and save step 1; 2 ranks load it (the rest of the epoch partitioned
    over them), read 4 batches each and save step 2; 4 ranks load that and read the rest. Each of
    the epoch's 48 samples was read exactly once."""
    server = make_sidecar()
    sock = server.socket_path
    first = run_ranks(sock, job_name, "data/0", 4, "data", "-", "-", "1", "3")
    second = run_ranks(sock, job_name, "data/1", 2, "data", "-", "1", "2", "4")
    third = run_ranks(sock, job_name, "data/2", 4, "data", "-", "2", "-", "all")
    assert [len(r["seen"]) for r in first + second + third] == [6] * 4 + [8] * 2 + [2] * 4
    seen = [i for r in first + second + third for i in r["seen"]]
    assert sorted(seen) == list(range(48))
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2]


def test_a_plain_dcp_checkpoint_is_imported_and_loads_on_three_ranks(make_sidecar, job_name, tmp_path):
    """`strata import`: a checkpoint plain DCP (FileSystemWriter) saved from 2 FSDP2 ranks becomes a
    committed step of a new job, which StrataReader loads on 3 ranks, bit for bit; a second import
    into the same job is refused."""
    server = make_sidecar()
    directory = tmp_path / "plain-dcp"
    run_ranks(server.socket_path, job_name, "plain/0", 2, "plain", str(tmp_path / "saved.pt"), str(directory))
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    store = ["--storage", server.settings.storage, "--job", job_name]
    assert cli.main(["import", *store, "--from", str(directory), "--step", "7"]) == 0
    commit = mf.read_commit(server.store, "default", job_name, 7)
    assert commit.world_size == 1 and mf.load_manifest(server.store, commit, 0).dcp
    three = run_ranks(
        server.socket_path, job_name, "imp/1", 3, "load", str(tmp_path / "three.pt"), "newest", "8"
    )
    assert [r["step"] for r in three] == [7, 7, 7] and [r["saved_by"] for r in three] == [1, 1, 1]
    assert_bitwise_equal(torch.load(tmp_path / "three.pt", weights_only=True), saved)
    with pytest.raises(SystemExit, match="already has committed steps"):
        cli.main(["import", *store, "--from", str(directory)])
    # a .metadata that would run code when unpickled: refused, naming the global; nothing ran
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "ran"
    (evil / ".metadata").write_bytes(
        b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."  # os.system("touch ...")
    )
    other = ["--storage", server.settings.storage, "--job", job_name + "-evil"]
    with pytest.raises(SystemExit, match=r"posix\.system, which is not part of DCP's metadata"):
        cli.main(["import", *other, "--from", str(evil)])
    assert not marker.exists()
    assert mf.committed_steps(server.store, "default", job_name + "-evil") == []
