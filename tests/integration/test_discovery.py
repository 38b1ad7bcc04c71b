"""Asynchronous discovery: the sidecar reads the newest step ahead of the restore."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import settled


@pytest.mark.parametrize("shm", ["off", "on"])
def test_restore_is_served_from_the_prefetch_started_at_connect(
    make_sidecar, make_client, job_name, tmp_path, shm
):
    store = f"file://{tmp_path}/store"
    first = make_sidecar(store, object_bytes=1 << 16)
    writer = make_client(first, job_name)
    writer.save(7, {"w": torch.arange(100_000, dtype=torch.float32)}).durable.result(30)
    writer.close()
    first.stop(grace=1)

    second = make_sidecar(store, object_bytes=1 << 16)  # empty memory
    reader = make_client(second, job_name, shm=shm)  # connecting starts the prefetch
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        entry = second.engine.restorer.prefetched.get(("default", job_name, 0))
        if entry is not None and entry[1].is_set():
            break
        time.sleep(0.02)
    before = dict(second.store.requests)
    out = {"w": torch.zeros(100_000)}
    assert reader.restore(out) == 7
    # Discovery ran when the attempt was allocated at connect (its EPOCH names the restore step),
    # and the 7 data objects came from the prefetch: the restore itself reads nothing from storage.
    if shm == "off":  # read into memory ahead: the restore asks storage nothing
        assert dict(second.store.requests) == before
    else:  # a full step in files: read into the page cache ahead; the MANIFEST read and the 7
        # objects opened again to be lent (their bytes are the trainer's to read)
        opened = {k: v - before.get(k, 0) for k, v in second.store.requests.items() if v != before.get(k, 0)}
        assert opened == {"get": 1 + 7} and reader.last_restore["storage_files"] == 7
    assert reader.last_restore["source"] == "storage"
    assert torch.equal(out["w"], torch.arange(100_000, dtype=torch.float32))


def test_no_prefetch_when_resume_is_never(make_sidecar, make_client, job_name):
    server = make_sidecar()
    make_client(server, job_name, resume="never")
    time.sleep(0.2)
    assert server.engine.restorer.prefetched == {}


def test_the_sidecar_keeps_only_the_newest_steps(make_sidecar, make_client, job_name):
    from sidecar import manifest as mf

    server = make_sidecar(keep=2)
    client = make_client(server, job_name, when_busy="wait")
    for step in range(5):
        client.save(step, {"w": torch.full((10,), float(step))}).durable.result(30)
    assert settled(lambda: mf.committed_steps(server.store, "default", job_name), [3, 4]) == [3, 4]
    out = {"w": torch.zeros(10)}
    assert client.restore(out) == 4 and out["w"][0] == 4
