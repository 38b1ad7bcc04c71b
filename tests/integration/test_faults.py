"""Faults: storage failing, corrupted objects, trainers killed at chosen points.

Kill points come from the injection hook (STRATA_FAULTS, armed by the test-only switch
STRATA_TEST_FAULTS=1), never from sleeps.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TcpProxy, two_rank_job_with_a_damaged_step

from sidecar import manifest as mf
from trainer_client import SaveFailed

TRAINER = textwrap.dedent(
    """
    import sys, torch
    from trainer_client import CheckpointClient
    client = CheckpointClient()
    state = {"w": torch.zeros(64, 1024)}
    start = client.resume(state)
    print("RESUMED", start, flush=True)
    for step in range(int(sys.argv[1]), int(sys.argv[2])):
        state["w"].fill_(float(step))
        client.save(step, state).durable.result(60)
        print("COMMITTED", step, flush=True)
    client.close()
    """
)


def run_trainer(
    server, job: str, first: int, last: int, faults: str = "", attempt: int = 0, shm: str = "auto"
):
    env = dict(
        os.environ,
        STRATA_SHM=shm,
        STRATA_SOCKET=server.socket_path,
        STRATA_JOB=job,
        STRATA_RESTART=str(attempt),
        STRATA_FAULTS=faults,
        STRATA_TEST_FAULTS="1",  # fault injection is test-only: the switch arms STRATA_FAULTS
        STRATA_CHUNK_BYTES=str(64 * 1024),  # 256 KiB state -> 4 chunks, so "mid-stream" exists
    )
    return subprocess.run(
        [sys.executable, "-c", TRAINER, str(first), str(last)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("shm", "nth"),
    [("on", 1), ("off", 2)],  # shared memory: killed between header and footer; chunked: after chunk 1
    ids=["shm", "chunked"],
)
def test_trainer_killed_mid_stream_never_commits_and_the_previous_step_restores(
    make_sidecar, make_client, job_name, shm, nth
):
    server = make_sidecar()
    done = run_trainer(server, job_name, 0, 5, faults=f"client.stream.chunk@3#{nth}=kill", shm=shm)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "COMMITTED 2" in done.stdout and "COMMITTED 3" not in done.stdout
    assert mf.committed_steps(server.store, "default", job_name) == [0, 1, 2]
    # The torn attempt left no MANIFEST and no COMMIT; a resumed trainer restores step 2 ...
    state = {"w": torch.empty(64, 1024)}
    assert make_client(server, job_name).restore(state) == 2
    assert torch.equal(state["w"], torch.full((64, 1024), 2.0))
    # ... and may save step 3 again over the torn attempt.
    again = run_trainer(server, job_name, 3, 5, attempt=1)
    assert again.returncode == 0, again.stderr
    assert "RESUMED 2" in again.stdout
    assert mf.committed_steps(server.store, "default", job_name) == [0, 1, 2, 3, 4]


def test_a_completed_stream_commits_even_if_the_trainer_dies_right_after(make_sidecar, make_client, job_name):
    server = make_sidecar()
    done = run_trainer(server, job_name, 0, 3, faults="client.saved@1=kill")
    assert done.returncode == -signal.SIGKILL
    state = {"w": torch.empty(64, 1024)}
    assert make_client(server, job_name).restore(state) == 1  # acked before the kill, so committed
    assert torch.equal(state["w"], torch.full((64, 1024), 1.0))


def test_sidecar_killed_before_commit_leaves_the_previous_step(tmp_path, short_tmp, job_name):
    """A sidecar process dying between its MANIFEST and the COMMIT: the step never exists."""
    store = tmp_path / "store"
    sock = short_tmp / "k.sock"
    env = dict(os.environ, STRATA_FAULTS="sidecar.commit.before@2=kill", STRATA_TEST_FAULTS="1")
    strata = str(Path(sys.executable).parent / "strata")
    sidecar = subprocess.Popen(
        [strata, "sidecar", "--storage", f"file://{store}", "--socket", str(sock), "--metrics-port", "0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from trainer_client import CheckpointClient

        client = CheckpointClient(job=job_name, socket=str(sock), connect_timeout_s=30)
        for step in (1, 2):
            handle = client.save(step, {"w": torch.full((8,), float(step))})
            if step == 1:
                handle.durable.result(30)
        with pytest.raises(SaveFailed):
            handle.durable.result(30)
        assert sidecar.wait(30) == -signal.SIGKILL
        client.close(wait=False)
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()
    from sidecar.store import open_store

    files = open_store(f"file://{store}")
    assert mf.committed_steps(files, "default", job_name) == [1]
    assert mf.newest_committed(files, "default", job_name) == 1


def test_storage_unreachable_fails_durable_counts_it_and_keeps_the_last_commit(
    make_sidecar, make_client, job_name, s3_store_url, seaweed
):
    url, endpoint = s3_store_url
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))
    try:
        server = make_sidecar(url, s3_endpoint=proxy.endpoint, storage_attempts=2)
        client = make_client(server, job_name)
        client.save(1, {"w": torch.ones(1000)}).durable.result(30)
        proxy.cut()
        handle = client.save(2, {"w": torch.full((1000,), 2.0)})
        assert handle.staged.done()  # the training thread was not held up
        with pytest.raises(SaveFailed, match="step 2 not committed"):
            handle.durable.result(60)
        m = server.metrics.registry
        assert m.get_sample_value("strata_storage_errors_total", {"training_job": job_name, "op": "put"}) >= 1
        assert (
            m.get_sample_value("strata_checkpoints_total", {"training_job": job_name, "result": "failed"})
            == 1
        )
    finally:
        proxy.close()
    # Step 1 is intact and restorable from S3 by a sidecar that can reach it.
    healthy = make_sidecar(url, s3_endpoint=endpoint)
    out = {"w": torch.zeros(1000)}
    assert make_client(healthy, job_name).restore(out) == 1
    assert torch.equal(out["w"], torch.ones(1000))


def test_storage_unreachable_still_restores_from_memory(make_sidecar, make_client, job_name, s3_store_url):
    url, endpoint = s3_store_url
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))
    try:
        server = make_sidecar(url, s3_endpoint=proxy.endpoint, storage_attempts=1)
        client = make_client(server, job_name)
        client.save(1, {"w": torch.ones(10)}).durable.result(30)
        proxy.cut()
        out = {"w": torch.zeros(10)}
        assert client.restore(out) == 1
        assert client.last_restore["source"] == "memory"
    finally:
        proxy.close()


def test_corrupt_object_is_named_and_restore_falls_back(
    make_sidecar, make_client, job_name, tmp_path, caplog
):
    server = make_sidecar(f"file://{tmp_path}/store")
    client = make_client(server, job_name)
    for step in (1, 2):
        client.save(step, {"w": torch.full((4096,), float(step))}).durable.result(30)
    client.close()
    server.stop(grace=1)
    commit = mf.read_commit(server.store, "default", job_name, 2)
    obj = mf.load_manifest(server.store, commit, 0).objects[0]
    path = tmp_path / "store" / obj.key
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))

    fresh = make_sidecar(f"file://{tmp_path}/store")  # nothing in memory
    out = {"w": torch.zeros(4096)}
    client2 = make_client(fresh, job_name)
    # Asking for the corrupt step explicitly is an error naming the object, not a silent fallback.
    from trainer_client import RestoreError

    with pytest.raises(RestoreError, match=obj.key):
        client2.restore(out, step=2)
    caplog.set_level(logging.ERROR)
    assert client2.restore(out) == 1
    assert torch.equal(out["w"], torch.full((4096,), 1.0))
    assert obj.key in client2.last_restore["fallback_reason"]
    assert any(obj.key in r.getMessage() for r in caplog.records), "the fallback must be loud"
    assert (
        fresh.metrics.registry.get_sample_value("strata_restore_fallbacks_total", {"training_job": job_name})
        == 1
    )
    # The fallback is a new attempt restoring step 1: step 2 is marked unusable and fenced off
    # (a rollback stays rolled back), and training goes on from step 1.
    assert fresh.store.list(mf.unusable_prefix("default", job_name)).objects
    assert mf.committed_steps(fresh.store, "default", job_name) == [1]
    with pytest.raises(RestoreError, match=r"step 2 .*has no valid COMMIT"):
        client2.restore(out, step=2)
    assert client2.save(2, {"w": torch.full((4096,), 22.0)}).durable.result(30).step == 2
    assert mf.committed_steps(fresh.store, "default", job_name) == [1, 2]
    assert client2.restore(out) == 2 and out["w"][0] == 22.0


@pytest.mark.slow  # three sidecars on SeaweedFS: ~2.5 s
def test_an_object_corrupted_in_the_bucket_fails_the_restore_naming_it(
    make_sidecar, make_client, job_name, s3_store_url
):
    """S3 bodies go up without SDK checksums (no CRC, no MD5): the MANIFEST's xxh3 of every object,
    taken in the same pass as the tensors' digests, is what catches a damaged one."""
    from sidecar.store import open_store
    from trainer_client import RestoreError

    url, endpoint = s3_store_url
    server = make_sidecar(url, s3_endpoint=endpoint, policy="full", object_bytes=64 << 10)
    client = make_client(server, job_name)
    state = {"a": torch.randn(96, 1024), "b": torch.randn(1000)}  # several objects
    client.save(1, state).durable.result(30)
    client.close()
    server.stop(grace=1)
    bucket = open_store(url, endpoint_url=endpoint)
    manifest = mf.load_manifest(bucket, mf.read_commit(bucket, "default", job_name, 1), 0)
    assert len(manifest.objects) > 3
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert make_client(make_sidecar(url, s3_endpoint=endpoint), job_name).restore(out, step=1) == 1
    assert all(torch.equal(out[k], v) for k, v in state.items())

    obj = manifest.objects[2]
    data = bytearray(bucket.get(obj.key))
    data[len(data) // 2] ^= 0x01
    bucket.put(obj.key, bytes(data))
    bucket.close()
    with pytest.raises(RestoreError, match=obj.key):
        make_client(make_sidecar(url, s3_endpoint=endpoint), job_name).restore(out, step=1)


def test_a_corrupt_restore_step_stops_a_gang_and_the_next_restart_restores_an_older_one(
    make_sidecar, make_client, job_name, tmp_path
):
    storage, key, gang = two_rank_job_with_a_damaged_step(make_sidecar, make_client, job_name, tmp_path, "f")

    from trainer_client import RestoreError

    fresh = make_sidecar(storage)
    ranks = gang(fresh, "f/1")
    out = {"w": torch.zeros(4096)}
    assert ranks[0].restore(out) == 2 and out["w"][0] == 20.0
    # Every rank of an attempt restores the same step: rank 1 cannot fall back alone.
    with pytest.raises(RestoreError, match=key):
        ranks[1].restore(out)
    assert fresh.store.list(mf.unusable_prefix("default", job_name)).objects
    assert mf.newest_committed(fresh.store, "default", job_name) == 2  # not fenced off by a rank
    for c in ranks:
        c.close()
    # The next gang restart skips the step marked unusable: every rank restores step 1.
    ranks = gang(fresh, "f/2")
    for r, c in enumerate(ranks):
        out = {"w": torch.zeros(4096)}
        assert c.restore(out) == 1 and out["w"][0] == 10.0 + r
    handles = [c.save(2, {"w": torch.full((4096,), 2.0)}) for c in ranks]
    assert [h.durable.result(30).step for h in handles] == [2, 2]
    assert mf.valid_commits(fresh.store, "default", job_name) == [(0, 1), (2, 2)]


def test_s3_server_restarted_mid_upload(make_sidecar, make_client, job_name, tmp_path, monkeypatch):
    """SIGKILL the S3 server while a step uploads, then start it again: the step fails and
    never commits, training goes on, and the next step commits against the restarted server."""
    from sidecar.local.seaweed import SeaweedServer

    def host_port(endpoint: str) -> tuple[str, int]:
        host, port = endpoint.removeprefix("http://").split(":")
        return host, int(port)

    s3 = SeaweedServer(tmp_path / "s3").start()
    s3.create_bucket("restart")
    proxy = TcpProxy(*host_port(s3.endpoint))  # a stable endpoint across the restart
    restarted = None
    try:
        server = make_sidecar(
            "s3://restart/ckpt", s3_endpoint=proxy.endpoint, storage_attempts=2, object_bytes=1 << 16
        )
        client = make_client(server, job_name)
        state = {"w": torch.zeros(1 << 16)}

        def at(step: float) -> dict:
            state["w"].fill_(step)
            return state

        client.save(1, at(1)).durable.result(30)
        real_put = server.store.put
        stopped = []

        def put(key, data, **conditions):
            if "/000000000002/" in key and not stopped:
                stopped.append(key)
                s3.stop(timeout=0)  # SIGKILL, mid-upload
            return real_put(key, data, **conditions)

        monkeypatch.setattr(server.store, "put", put)
        handle = client.save(2, at(2))
        assert handle.staged.done()  # the training thread went on at once
        with pytest.raises(SaveFailed, match="step 2 not committed"):
            handle.durable.result(60)

        restarted = SeaweedServer(tmp_path / "s3").start()  # same data, new ports
        proxy.retarget(*host_port(restarted.endpoint))
        client.save(3, at(3)).durable.result(60)
        assert mf.committed_steps(server.store, "default", job_name) == [1, 3]
        out = {"w": torch.empty(1 << 16)}
        assert client.restore(out, step=1) == 1 and out["w"][0] == 1  # written before the crash, intact
    finally:
        proxy.close()
        s3.stop(timeout=0)
        if restarted is not None:
            restarted.stop(timeout=0)
