"""Version skew (rolling upgrades): a current sidecar serves a client one protocol older and
reads checkpoints one manifest format older. The old side is recorded, not simulated: the
requests an old client sent and a store an old sidecar wrote (tests/fixtures/README.md)."""

from __future__ import annotations

import json
import shutil
import threading
import zlib
from pathlib import Path

import grpc
import pytest

from sidecar import cli
from sidecar import manifest as mf
from sidecar.api import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, channel_options, pb, pb_grpc
from sidecar.errors import CorruptObject
from sidecar.store import open_store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
V1 = FIXTURES / "protocol-v1"
FORMAT1 = FIXTURES / "format-v1"


def expect_status(code: grpc.StatusCode, match: list[str], call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    for m in match:
        assert m in info.value.details(), info.value.details()
    return info.value.details()


def connect(server) -> pb_grpc.CheckpointerStub:
    channel = grpc.insecure_channel(f"unix:{server.socket_path}", options=channel_options(64 << 20))
    return pb_grpc.CheckpointerStub(channel)


def recorded() -> tuple[dict, dict[str, list[bytes]]]:
    index = json.loads((V1 / "index.json").read_text())
    by_method: dict[str, list[bytes]] = {}
    for entry in index["messages"]:
        by_method.setdefault(entry["method"], []).append((V1 / entry["file"]).read_bytes())
    return index, by_method


def test_the_recording_is_a_protocol_1_client():
    _, msgs = recorded()
    hello = pb.HandshakeRequest.FromString(msgs["Handshake"][0])
    header = pb.SaveRequest.FromString(msgs["Save"][0]).header
    assert hello.protocol_version == header.protocol_version == MIN_PROTOCOL_VERSION == 1
    assert PROTOCOL_VERSION == 2
    # What protocol 1 lacks: no generation (and it never opens Attach: nothing of it is recorded).
    assert hello.identity.generation == header.identity.generation == ""
    assert set(msgs) == {"Handshake", "Save", "WaitCommitted", "Restore"}
    kinds = [pb.SaveRequest.FromString(b).WhichOneof("msg") for b in msgs["Save"]]
    assert kinds[0] == "header" and kinds[-1] == "footer" and set(kinds[1:-1]) == {"chunk"}


@pytest.mark.parametrize("generation_file", [False, True], ids=["solo", "generation-file"])
def test_a_recorded_protocol_1_client_saves_and_restores(make_sidecar, short_tmp, generation_file):
    options = {}
    if generation_file:
        path = short_tmp / "generation"
        path.write_text("pod-run/0\n")
        options["generation_file"] = str(path)
    server = make_sidecar(**options)
    stub = connect(server)
    index, msgs = recorded()
    # Replayed as recorded: the sidecar parses the old bytes with the current classes.
    reply = stub.Handshake(pb.HandshakeRequest.FromString(msgs["Handshake"][0]), timeout=10)
    assert reply.protocol_version == PROTOCOL_VERSION and "save.stream" in reply.capabilities
    saves = [pb.SaveRequest.FromString(b) for b in msgs["Save"]]
    payload = b"".join(m.chunk for m in saves if m.WhichOneof("msg") == "chunk")
    assert payload.hex() == "".join(index["tensors"][k] for k in ("w", "ids"))
    ack = stub.Save(iter(saves), timeout=30)
    assert (ack.step, ack.bytes_received) == (index["step"], len(payload))
    status = stub.WaitCommitted(pb.WaitCommittedRequest.FromString(msgs["WaitCommitted"][0]), timeout=60)
    assert status.state == pb.COMMIT_STATE_COMMITTED, status.message
    assert mf.committed_steps(server.store, "default", index["job"]) == [index["step"]]
    commit = mf.read_commit(server.store, "default", index["job"], index["step"])
    assert commit.format_version == mf.FORMAT_VERSION == 2  # never format 1
    if generation_file:
        assert commit.generation == "pod-run/0"  # the file wins (protocol 1 declares none)
    else:
        assert commit.generation.startswith("solo-v1-")
    restore = pb.RestoreRequest.FromString(msgs["Restore"][0])
    assert not restore.HasField("step")
    responses = list(stub.Restore(restore, timeout=30))
    header = responses[0].header
    assert header.step == index["step"]
    assert [t.name for t in header.tensors] == ["w", "ids"]
    data = b"".join(r.chunk for r in responses[1:])
    assert data == payload and f"{zlib.crc32(data):08x}" == index["payload_crc32"]


def test_protocols_outside_1_and_2_are_refused(make_sidecar):
    stub = connect(make_sidecar())
    _, msgs = recorded()
    hello = pb.HandshakeRequest.FromString(msgs["Handshake"][0])
    for version, advice in ((0, "Upgrade the trainer client"), (3, "Upgrade the sidecar")):
        hello.protocol_version = version
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            [f"protocol version {version} is not supported", "serves clients of protocol 1 and 2", advice],
            lambda: stub.Handshake(hello, timeout=10),
        )
        saves = [pb.SaveRequest.FromString(b) for b in msgs["Save"]]
        saves[0].header.protocol_version = version
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            [f"protocol version {version}"],
            lambda saves=saves: stub.Save(iter(saves), timeout=10),
        )
        restore = pb.RestoreRequest.FromString(msgs["Restore"][0])
        restore.protocol_version = version
        expect_status(
            grpc.StatusCode.FAILED_PRECONDITION,
            [f"protocol version {version}"],
            lambda restore=restore: list(stub.Restore(restore, timeout=10)),
        )


def test_several_protocol_1_ranks_need_the_generation_file(make_sidecar):
    stub = connect(make_sidecar())
    _, msgs = recorded()
    hello = pb.HandshakeRequest.FromString(msgs["Handshake"][0])
    hello.identity.world_size = 2
    expect_status(
        grpc.StatusCode.FAILED_PRECONDITION,
        ["no gang generation", "protocol 1"],
        lambda: stub.Handshake(hello, timeout=10),
    )


# --- format 1 ----------------------------------------------------------------------------------


@pytest.fixture
def old_store(short_tmp) -> str:
    """A copy of the store the previous release wrote (the tests write into it)."""
    shutil.copytree(FORMAT1 / "store", short_tmp / "old-store")
    return f"file://{short_tmp / 'old-store'}"


def expected() -> dict:
    return json.loads((FORMAT1 / "expected.json").read_text())


def ident(rank: int, generation: str) -> pb.Identity:
    return pb.Identity(namespace="default", job="old-job", rank=rank, world_size=2, generation=generation)


def restore(stub, rank: int, generation: str, step: int | None = None) -> tuple[pb.RestoreHeader, bytes]:
    req = pb.RestoreRequest(protocol_version=PROTOCOL_VERSION, identity=ident(rank, generation))
    if step is not None:
        req.step = step
    responses = list(stub.Restore(req, timeout=30))
    return responses[0].header, b"".join(r.chunk for r in responses[1:])


def tensors_of(header: pb.RestoreHeader, data: bytes) -> dict[str, bytes]:
    return {t.name: data[t.offset : t.offset + t.nbytes] for t in header.tensors}


def check_bitwise(header: pb.RestoreHeader, data: bytes, step: int, rank: int) -> None:
    want = expected()["steps"][str(step)][str(rank)]
    got = tensors_of(header, data)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].hex() == w["hex"], (step, rank, name)
        assert f"{zlib.crc32(got[name]):08x}" == w["crc32"]


def test_format_1_discovery(old_store):
    store = open_store(old_store)
    assert mf.newest_valid(store, "default", "old-job") == (mf.LEGACY_ATTEMPT, 20)
    assert mf.committed_steps(store, "default", "old-job") == [10, 20]
    commit = mf.read_commit(store, "default", "old-job", 20)
    assert (commit.format_version, commit.attempt, commit.requires) == (1, mf.LEGACY_ATTEMPT, [10])
    m = mf.load_manifest(store, commit, 1)
    assert m.checkpoint == "diff" and m.base_commit is not None and m.base_commit.step == 10
    # Discovery also without LATEST (a full listing finds the format-1 COMMITs).
    store.delete([mf.latest_key("default", "old-job")])
    assert mf.newest_valid(store, "default", "old-job") == (mf.LEGACY_ATTEMPT, 20)


def test_a_format_1_job_restores_bitwise_and_goes_on_in_format_2(make_sidecar, old_store):
    server = make_sidecar(storage=old_store, policy="consecutive")
    stub = connect(server)
    # The newest format-1 step (a diff on the full step 10), every rank, bit for bit.
    for rank in (0, 1):
        header, data = restore(stub, rank, "upgrade/0")
        assert (header.step, header.source) == (20, "storage")
        check_bitwise(header, data, 20, rank)
    header, data = restore(stub, 1, "upgrade/0", step=10)  # an explicit older format-1 step
    check_bitwise(header, data, 10, 1)

    # New saves on top: format 2, and the first one full (no diff against the old base).
    new_values: dict[int, dict[str, bytes]] = {}
    for rank in (0, 1):
        got = tensors_of(*restore(stub, rank, "upgrade/0"))
        emb = bytearray(got["emb"])
        emb[:4] = bytes([rank + 1] * 4)
        new_values[rank] = {"emb": bytes(emb), "bias": got["bias"]}

    def save(rank: int, step: int, values: dict[str, bytes], out: list) -> None:
        metas = [
            pb.TensorMeta(name="emb", dtype="float32", shape=[8, 4], nbytes=128),
            pb.TensorMeta(name="bias", dtype="float32", shape=[5], nbytes=20),
        ]
        payload = values["emb"] + values["bias"]
        msgs = [
            pb.SaveRequest(
                header=pb.SaveHeader(
                    protocol_version=PROTOCOL_VERSION,
                    identity=ident(rank, "upgrade/0"),
                    step=step,
                    save_id=f"r{rank}s{step}",
                    tensors=metas,
                    tree=b'{"emb": {"__tensor__": 0}, "bias": {"__tensor__": 1}}',
                )
            ),
            pb.SaveRequest(chunk=payload),
            pb.SaveRequest(footer=pb.SaveFooter(total_bytes=len(payload))),
        ]
        stub.Save(iter(msgs), timeout=30)
        req = pb.WaitCommittedRequest(
            identity=ident(rank, "upgrade/0"), step=step, save_id=f"r{rank}s{step}", timeout_seconds=60
        )
        out.append(stub.WaitCommitted(req, timeout=90))

    statuses: list = []
    threads = [threading.Thread(target=save, args=(r, 30, new_values[r], statuses)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s.state for s in statuses] == [pb.COMMIT_STATE_COMMITTED] * 2, [s.message for s in statuses]
    store = server.store
    assert mf.newest_valid(store, "default", "old-job") == (0, 30)
    commit = mf.read_commit(store, "default", "old-job", 30)
    assert commit.key == "default/old-job/steps/000000000030/a0000/COMMIT"
    assert commit.format_version == 2 and commit.required_commits == []
    for rank in (0, 1):
        m = mf.load_manifest(store, commit, rank)
        assert (m.format_version, m.checkpoint, m.base_commit) == (2, "full", None)
        assert all(t.xxh3 for t in m.tensors)  # written by this version: xxh3 digests
    latest = json.loads(store.get(mf.latest_key("default", "old-job")))
    assert (latest["attempt"], latest["step"]) == (0, 30)
    assert mf.committed_steps(store, "default", "old-job") == [10, 20, 30]

    # A later generation (another sidecar: nothing in memory) restores the new step from storage.
    again = connect(make_sidecar(storage=old_store))
    for rank in (0, 1):
        header, data = restore(again, rank, "upgrade/1")
        assert (header.step, header.source) == (30, "storage")
        assert tensors_of(header, data) == new_values[rank]


def test_strata_ls_show_verify_read_format_1(old_store, capsys):
    args = ["--storage", old_store, "--job", "old-job"]
    assert cli.main(["ls", *args]) == 0
    out = capsys.readouterr().out
    assert "10" in out and "20" in out
    assert cli.main(["show", *args, "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "step       20" in out and "format     v1" in out and "diff on step 10" in out
    assert cli.main(["verify", *args, "--all"]) == 0
    out = capsys.readouterr().out
    assert "step 10: OK" in out and "step 20: OK" in out
    # A damaged base: verify says so for it (the diff's own objects are whole).
    root = Path(old_store.removeprefix("file://"))
    obj = next(root.glob("default/old-job/steps/000000000010/*/rank-0/obj-00000"))
    obj.write_bytes(b"\0" * obj.stat().st_size)
    assert cli.main(["verify", *args, "--step", "10"]) == 1
    assert "step 10: CORRUPT" in capsys.readouterr().out


def test_a_future_format_is_refused_clearly(old_store):
    store = open_store(old_store)
    key = mf.commit_key("default", "old-job", 20, mf.LEGACY_ATTEMPT)
    body = json.loads(store.get(key))
    for version in (0, 3):
        body["format_version"] = version
        store.put(key, json.dumps(body).encode())
        with pytest.raises(CorruptObject, match=f"format_version {version} is not supported"):
            mf.read_commit(store, "default", "old-job", 20)


def test_the_first_attempt_after_an_old_release_is_above_its_torn_saves(old_store):
    """A format-1 release numbered save directories by the trainer's attempt: a torn save of
    a step above the restore step (attempt 2 here) must not look like the new attempt's own."""
    store = open_store(old_store)
    torn = "default/old-job/steps/000000000030/a0002-0123456789abcdef/rank-0/MANIFEST"
    store.put(torn, b"{}")
    fences = mf.read_fences(store, "default", "old-job")
    restore = mf.newest_valid(store, "default", "old-job")
    assert restore == (mf.LEGACY_ATTEMPT, 20)
    epoch = mf.create_epoch(store, "default", "old-job", mf.Generation.parse("up/0"), 2, restore, fences)
    assert epoch.attempt == 3
    assert mf.step_state(store, "default", "old-job", 30, epoch.attempt).manifests == {}
