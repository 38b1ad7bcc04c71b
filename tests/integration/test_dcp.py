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
from trainer_client import RestoreError, export
from trainer_client.dcp import StrataReader, StrataWriter, committed_step

RANKS = Path(__file__).with_name("dcp_ranks.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    socket_path: str, job: str, generation: str, world: int, *args: str, script: Path = RANKS
) -> list[dict]:
    """Run ``world`` rank processes of ``script`` (dcp_ranks.py); their reports, by rank."""
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
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


# 4 ranks, then 2 and 3: test_launch_resumes_a_dcp_checkpoint_on_fewer_ranks runs in make test
@pytest.mark.slow
def test_fsdp2_saved_on_four_ranks_loads_on_two_and_three(make_sidecar, job_name, tmp_path):
    server = make_sidecar()
    saved_file = tmp_path / "saved.pt"
    wrote = run_ranks(server.socket_path, job_name, "dcp/0", 4, "save", str(saved_file))
    saved = torch.load(saved_file, weights_only=True)
    assert mf.committed_steps(server.store, "default", job_name) == [1, 2, 3]
    # the second async save staged into a segment the first one warmed for it (no allocation),
    # and neither save copied a tensor again after stage() (on DCP's coordinator or the others)
    assert [r["stage_reused"] for r in wrote] == [[False, True]] * 4
    assert [r["copied_after_stage"] for r in wrote] == [[0, 0]] * 4
    commit = mf.read_commit(server.store, "default", job_name, 3)
    assert commit.world_size == 4
    # one commit per step: the coordinator's snapshot carries DCP's metadata (what makes it
    # reshardable for the launcher), the others only their items
    assert [mf.load_manifest(server.store, commit, r).dcp for r in range(4)] == [True, False, False, False]
    # ... and its commit report tells the operator so (a gang of another size is not refused)
    [item] = stored_commit_items(server.store, "default", job_name, "file://x", [(commit.attempt, 3)])
    assert item["reshardable"] is True and item["world_size"] == 4

    # 4 -> 2: the newest step (an async save), held in this sidecar's memory, by client.resume()
    two = run_ranks(server.socket_path, job_name, "dcp/1", 2, "resume", str(tmp_path / "two.pt"), "-", "4")
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


def test_an_export_is_a_plain_dcp_checkpoint(make_sidecar, job_name, tmp_path, short_tmp):
    """`strata export --format dcp` writes what dcp.load with FileSystemReader reads, in a process
    that cannot import Strata, for a checkpoint saved by 4 FSDP2 ranks; `--format torch` one file of
    whole tensors."""
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
    # --format torch: the whole tensors DCP's planner assembles from the 4 ranks' chunks, nested (the
    # CLI's two halves in this process: the subprocess above already proved the CLI's)
    staging = tmp_path / "staging"
    staging.mkdir()
    cli.stage_export(server.store, mf.read_commit(server.store, "default", job_name, 3), staging)
    assert export.export(staging, tmp_path / "pt", "torch")[0].endswith("merged into whole tensors")
    nested = torch.load(tmp_path / "pt" / "state.pt", weights_only=True)
    merged = {k: v for k, v in export.flatten(nested) if isinstance(v, torch.Tensor)}
    assert_bitwise_equal(merged, tensors)
    assert nested["optim"]["param_groups"][0]["lr"] == saved["optim.param_groups.0.lr"]
    # safetensors holds tensors only: the optimizer's param_groups are named
    with pytest.raises(export.ExportError, match=r"not tensors: optim\.param_groups\. Use --format torch$"):
        export.export(staging, tmp_path / "st", "safetensors")


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


@pytest.mark.slow  # three launches of 4, 2, 4 ranks; the loader's resharding is unit-tested in make test
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


@pytest.fixture
def one_rank(tmp_path):
    """This process as a 1-rank gloo job (FSDP2 shards over a 1-rank mesh: DTensor state)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_state(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> dict:
    """One training step, then the sharded state DCP saves."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def local_tensors(state: dict) -> list[torch.Tensor]:
    """The tensors a rank writes, in the state's order (a DTensor's: its local shard)."""
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []

    def walk(v: object) -> None:
        if isinstance(v, DTensor):
            out.append(v.to_local())
        elif isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)

    walk(state)
    return out


@pytest.mark.parametrize("shm", ["on", "off"])
def test_an_async_save_copies_the_state_once_into_the_buffer_it_is_sent_from(
    one_rank, make_sidecar, make_client, job_name, monkeypatch, shm
):
    """dcp.async_save through StrataWriter copies each tensor once: stage() (the training thread's
    stall) copies the FSDP2 shards and Adam's state straight into the client's staging buffer
    (with shared memory: the segment the sidecar reads), and the save sends them from there: the
    client copies only DCP's pickled values, and every tensor sent lies exactly where stage()
    wrote it. A stage() while no buffer is free (shared memory: one held by the sidecar, one
    still being sent) stages into fresh memory and says so; the save in flight is not
    overwritten. Each step loads back bit for bit."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_client._staging import Stager
    from trainer_client.dcp import StrataWriter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    client = make_client(make_sidecar(), job_name, capture_rng=False, resume="never", shm=shm)
    assert (client._segments is not None) == (shm == "on")
    writer = StrataWriter(client)

    # bytes of the state's tensors the client's staging copies, by thread (DCP's pickled values,
    # uint8 tensors, not counted)
    copied = {"training": 0, "background": 0}
    original_copy = Stager.copy

    def counting_copy(self, views, tensors, indices):
        where = "training" if threading.current_thread() is threading.main_thread() else "background"
        copied[where] += sum(tensors[i][1].nbytes for i in indices if tensors[i][1].dtype != torch.uint8)
        return original_copy(self, views, tensors, indices)

    monkeypatch.setattr(Stager, "copy", counting_copy)
    sends = []  # per save: the buffer it sends from, where its tensors lie there, its header
    original_requests = client._requests
    sending = threading.Event()  # cleared: the save streams wait before their header
    sending.set()
    streaming = threading.Event()

    def recording_requests(bufs, *args):
        streaming.set()
        sending.wait(30)
        for msg in original_requests(bufs, *args):
            if msg.WhichOneof("msg") == "header":
                sends.append((bufs, args[-1], msg.header))
            yield msg

    monkeypatch.setattr(client, "_requests", recording_requests)
    staged: list[dict] = []
    original_stage = writer.stage
    monkeypatch.setattr(writer, "stage", lambda sd: staged.append(original_stage(sd)) or staged[-1])

    expected: dict[int, list[torch.Tensor]] = {}
    reused = []
    for step in (1, 2, 3):
        state = fsdp2_state(model, opt, step)
        expected[step] = [t.clone() for t in local_tensors(state)]
        copied.update(training=0, background=0)
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
        reused.append(writer.last_stage_reused)
        fsdp2_state(model, opt, 100 + step)  # training mutates the state: the checkpoint must not see it
        future.result(timeout=60)

        views = local_tensors(staged[-1])
        state_bytes = sum(t.nbytes for t in views)
        # one copy of the tensors, by stage(); the save copied DCP's pickled values only
        assert copied == {"training": state_bytes, "background": 0}
        assert 0 < client.stats["last_copied_bytes"] < 32 * 1024
        # every tensor is sent from where stage() wrote it (shared memory: the sidecar reads it there)
        bufs, slots, header = sends[-1]
        staged_at = {(v.data_ptr() - bufs.flat.data_ptr(), v.nbytes) for v in views}
        assert {(s.offset, s.nbytes) for s in slots if s.dtype != torch.uint8} == staged_at
        if shm == "on":
            assert header.shm.name == bufs.segment.name
            assert {(m.offset, m.nbytes) for m in header.tensors if m.dtype != "uint8"} == staged_at
    # the first allocates; the others stage into a buffer the save before used or warmed for them
    assert reused == [False, True, True]

    # No buffer free: step 4's is being sent (held back here; shared memory: the sidecar holds
    # step 3's in the other).
    sending.clear()
    streaming.clear()
    four = fsdp2_state(model, opt, 4)
    expected[4] = [t.clone() for t in local_tensors(four)]
    future = dcp.async_save(four, storage_writer=writer, checkpoint_id=4)
    assert streaming.wait(30)
    five = writer.stage(fsdp2_state(model, opt, 5))  # nowhere free: fresh memory, step 4 untouched
    assert writer.last_stage_reused is False
    flats = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.nbytes) for b in client._buffers]
    assert not any(lo <= v.data_ptr() < hi for v in local_tensors(five) for lo, hi in flats)
    sending.set()
    future.result(timeout=60)

    for step, tensors in expected.items():
        target = fsdp2_state(model, opt, 1000 + step)  # other values, the same layout
        dcp.load(target, storage_reader=StrataReader(client, step=step))
        assert_bitwise_equal(local_tensors(target), tensors)


def test_a_buffer_lent_to_a_save_that_never_sent_it_is_taken_back_intact(
    one_rank, make_sidecar, make_client, job_name
):
    """A DCP save that fails before sending (here: in planning) leaves its staged buffer lent; the
    next stage() takes it back (a new allocation, said so) and that step saves whole. And a
    stage() whose save has not sent yet when another stage() takes its buffer keeps what it
    staged: that save copies it from there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_client.dcp import ITEMS_KEY, StrataWriter, _items

    class FailingPlanner(DefaultSavePlanner):
        def create_local_plan(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("planning failed")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    client = make_client(make_sidecar(), job_name, capture_rng=False, resume="never")
    writer = StrataWriter(client)
    reused, expected = [], {}
    for step, planner in ((1, None), (2, FailingPlanner()), (3, None)):
        state = fsdp2_state(model, opt, step)
        expected[step] = [t.clone() for t in local_tensors(state)]
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=step, planner=planner)
        reused.append(writer.last_stage_reused)
        if planner is None:
            future.result(timeout=60)
        else:
            with pytest.raises(CheckpointException, match="planning failed"):
                future.result(timeout=60)
    assert reused == [False, True, False]  # step 3: step 2's buffer taken back, laid out anew
    for step in (1, 3):
        target = fsdp2_state(model, opt, 1000 + step)
        dcp.load(target, storage_reader=StrataReader(client, step=step))
        assert_bitwise_equal(local_tensors(target), expected[step])

    # Two stage()s before either save sends: the second takes the first's buffer back.
    staged = [writer.stage(fsdp2_state(model, opt, 10 + i)) for i in range(2)]
    values = [[t.clone() for t in local_tensors(s)] for s in staged]
    for step, s in zip((4, 5), staged, strict=True):
        items = {f"t{i}": t for i, t in enumerate(local_tensors(s))}
        client._save_plain(step, {ITEMS_KEY: items}).result(60)
        header, tensors = client._read_rank(0, step)
        saved = _items(header, tensors, f"step {step}")
        assert_bitwise_equal([saved[k] for k in items], values[step - 4])


def test_dcp_items_named_by_quantize_match_are_stored_quantized(
    one_rank, make_sidecar, make_client, job_name
):
    """``--quantize-match`` names DCP items by ``dcp.<fqn>@<chunk offsets>``: an embedding table's
    shard is stored at 4 bits with its error in the manifest, and loads back within it; the rest
    of the model and the optimizer state stay exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sidecar.pipeline import quantize as qz

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.table = torch.nn.Embedding(4096, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + self.table(torch.arange(len(x)))

    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # the stored class: the restore gives the table as storage holds it (its error is checked)
    server = make_sidecar(quantize="4", quantize_match="dcp.model.table.weight*", restore_class="stored")
    client = make_client(server, job_name, capture_rng=False, resume="never")
    state = fsdp2_state(model, opt, 1)
    before = {k: v.full_tensor().clone() for k, v in state["model"].items()}
    optim_before = {
        name: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in per.items()}
        for name, per in state["optim"]["state"].items()
    }
    dcp.save(state, storage_writer=StrataWriter(client), checkpoint_id=7)

    m = mf.load_manifest(server.store, mf.read_commit(server.store, "default", job_name, 7), 0)
    lossy = {t.name: t for t in m.tensors if t.bits}
    assert list(lossy) == ["dcp.model.table.weight@0,0"], [t.name for t in m.tensors]
    error = lossy["dcp.model.table.weight@0,0"].rel_l2_error
    assert error is not None and 0 < error < 0.1

    target = fsdp2_state(model, opt, 2)  # moved on: the load must bring step 7 back
    dcp.load(target, storage_reader=StrataReader(client, step=7))
    for name, value in target["model"].items():
        got = value.full_tensor()
        if name == "table.weight":
            want = qz.dequantize_rows(qz.quantize_rows(before[name].numpy(), 4))
            assert torch.equal(got, torch.from_numpy(want))  # what the sidecar stored, exactly
            assert qz.relative_l2_error(before[name].numpy(), got.numpy()) == pytest.approx(error, rel=1e-5)
        else:
            assert torch.equal(got, before[name]), name
    for name, per_param in target["optim"]["state"].items():
        for key, v in per_param.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(got, optim_before[name][key]), (name, key)  # Adam's state: exact


def test_a_save_that_fails_before_it_is_sent_frees_its_staging_buffer(
    make_sidecar, make_client, job_name, monkeypatch
):
    """A failure between taking a staging buffer and handing the save to the sender (here: the
    roles) frees the buffer again: a buffer left marked busy could never be lent to a stage()."""
    import trainer_client._state as state_module

    client = make_client(make_sidecar(), job_name, capture_rng=False, resume="never")
    state = {"w": torch.randn(256, 256)}
    client.save(1, state).durable.result(30)

    def boom(*_: object) -> list[str]:
        raise RuntimeError("boom")

    monkeypatch.setattr(state_module, "roles", boom)
    with pytest.raises(RuntimeError, match="boom"):
        client.save(2, state)
    assert client._busy == {}
    monkeypatch.undo()
    for step in (3, 4):
        client.save(step, state).durable.result(30)
    assert committed_step(client) == 4


def test_resume_on_dtensor_state_starts_fresh_then_loads_through_dcp(
    one_rank, make_sidecar, make_client, job_name
):
    """``client.resume()`` on FSDP2 state: nothing committed yet is a fresh start (None), and a
    step ``client.save()`` saved (through DCP: ``dcp.async_save`` staged by the client's
    ``StrataWriter``) comes back through DCP, with ``last_restore`` saying so."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)  # resume="auto"
    assert client.resume(fsdp2_state(model, opt, 1)) is None
    saved = fsdp2_state(model, opt, 2)
    want = [t.clone() for t in local_tensors(saved)]
    handle = client.save(5, saved)
    assert handle.staged.done()  # stage() copied the shards before save() returned
    fsdp2_state(model, opt, 4)  # training goes on: the checkpoint must not see it
    assert handle.result(60).step == 5
    commit = mf.read_commit(server.store, "default", job_name, 5)
    assert mf.load_manifest(server.store, commit, 0).dcp  # DCP's metadata: reshardable

    later = make_client(server, job_name, capture_rng=False)  # a restarted trainer
    state = fsdp2_state(model, opt, 3)  # moved on
    assert later.resume(state) == 5
    assert_bitwise_equal(local_tensors(state), want)
    assert later.last_restore is not None
    assert later.last_restore["source"] == "dcp" and later.last_restore["saved_by"] == 1
    assert later.last_restore["restore_class"] == "exact"  # lossless: exact whatever the class


def test_client_resume_through_dcp_restores_readers_plain_values_and_random_streams(
    one_rank, make_sidecar, make_client, job_name
):
    """``client.save`` / ``client.resume`` of sharded state beside the rest of a training state:
    a data reader nested in the state (its position: every rank's, as one value), a plain value
    beside it (DCP replaces it in the copied container: written back into the user's own) and the
    global random streams (``capture_rng``) come back as they were at the save."""
    import random

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    from trainer_client.data import ResumableDistributedSampler, ResumableLoader

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, ResumableLoader]:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        data = list(range(40))
        loader = ResumableLoader(
            DataLoader(data, batch_size=4, sampler=ResumableDistributedSampler(data, seed=3))
        )
        return model, torch.optim.Adam(model.parameters(), lr=0.01), loader

    torch.manual_seed(0)
    model, opt, loader = build()
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=True)
    state = {**fsdp2_state(model, opt, 1), "train": {"data": loader, "epoch": 2}, "step": 0}
    assert client.resume(state) is None
    batches = iter(loader)
    read = [next(batches).tolist() for _ in range(3)]
    state["train"]["epoch"], state["step"] = 3, 7
    client.save(5, state).result(60)
    want = [random.random(), *torch.rand(2).tolist()]
    rest = [b.tolist() for b in batches]

    model, opt, loader = build()
    train = {"data": loader, "epoch": 0}
    again = {**fsdp2_state(model, opt, 2), "train": train, "step": 0}
    random.seed(9)
    torch.manual_seed(9)
    assert make_client(server, job_name, capture_rng=True).resume(again) == 5
    assert again["train"] is train and train["epoch"] == 3 and again["step"] == 7
    assert [random.random(), *torch.rand(2).tolist()] == want
    assert [b.tolist() for b in loader] == rest
    assert sorted(i for b in read + rest for i in b) == list(range(40))


def test_client_resume_through_dcp_keeps_readers_in_lists_and_subclasses_per_rank(
    one_rank, make_sidecar, make_client, job_name
):
    """A reader in a list (DCP replaces a list without tensors whole: the user's list and the
    reader in it must stay), and a subclass of a reader (found along its MRO, saved per rank, not
    pickled whole), resume at their position, save it again, and resume there a second time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    from trainer_client.data import ResumableDistributedSampler, ResumableLoader

    class MyLoader(ResumableLoader):
        pass

    data = list(range(40))

    def build(n: int) -> dict:
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        loaders = [
            kind(DataLoader(data, batch_size=4, sampler=ResumableDistributedSampler(data, seed=3)))
            for kind in (ResumableLoader, MyLoader)
        ]
        return {**fsdp2_state(model, opt, n), "loaders": loaders}

    server = make_sidecar()
    state = build(1)
    assert make_client(server, job_name).resume(state) is None
    its = [iter(x) for x in state["loaders"]]
    for it in its:
        [next(it) for _ in range(3)]
    make_client(server, job_name).save(5, state).result(60)

    state = build(2)
    resumed = make_client(server, job_name)
    assert resumed.resume(state) == 5
    loaders = state["loaders"]
    assert [type(x).__name__ for x in loaders] == ["ResumableLoader", "MyLoader"]
    its = [iter(x) for x in loaders]
    for it in its:
        [next(it) for _ in range(2)]  # 5 batches read: the position a second resume must give
    resumed.save(6, state).result(60)
    rest = [[b.tolist() for b in it] for it in its]

    state = build(3)
    assert make_client(server, job_name).resume(state) == 6
    assert [[b.tolist() for b in x] for x in state["loaders"]] == rest


def test_modules_and_optimizers_below_the_top_level_are_refused_on_the_dcp_route(
    one_rank, make_sidecar, make_client, job_name
):
    """DCP calls ``state_dict()`` on the state's top-level values only: a module or optimizer
    nested deeper (``state["train"]["optimizer"]``) would be pickled whole at a save and could
    never be loaded. The save is refused naming it, and so is a resume, before anything is
    written."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer_client._tree import StateError

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, opt = build(0)
    fsdp2_state(model, opt, 1)  # one step: Adam's state exists
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    nested = r"state\['train'\]\['optimizer'\] \(Adam\): state (saved|loaded) through torch.distributed"
    with pytest.raises(StateError, match=r"step 3: " + nested):
        client.save(3, {"model": model, "train": {"optimizer": opt}})
    client.save(3, {"model": model, "optimizer": opt}).result(60)

    model, opt = build(1)
    before = [t.clone() for t in local_tensors(model.state_dict())]
    with pytest.raises(RestoreError, match="^" + nested):
        make_client(server, job_name, capture_rng=False).resume({"model": model, "train": {"optimizer": opt}})
    assert_bitwise_equal(local_tensors(model.state_dict()), before)


@pytest.mark.parametrize("shm", ["on", "off"])  # the restore's header from a shared segment, or gRPC
def test_resume_loads_plain_state_that_dcp_saved(one_rank, make_sidecar, make_client, job_name, shm):
    """The DCP guide's loop on a plain (non-DTensor) model: what
    ``dcp.save`` wrote through a ``StrataWriter`` comes back with ``client.resume()`` (DCP's
    state dict names, not the client's tree), bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()

    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    assert client.resume(state()) is None  # a first run
    train_step()
    dcp.save(state(), storage_writer=StrataWriter(client), checkpoint_id=200)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    train_step()  # moves on past the checkpoint

    later = make_client(server, job_name, capture_rng=False, shm=shm)  # the second run
    s = state()
    assert later.resume(s) == 200
    set_state_dict(model, opt, model_state_dict=s["model"], optim_state_dict=s["optim"])
    assert_bitwise_equal(model.state_dict(), want)
    assert_bitwise_equal([opt.state[p]["exp_avg"] for p in model.parameters()], want_exp_avg)
    assert later.last_restore is not None and later.last_restore["source"] == "dcp"
