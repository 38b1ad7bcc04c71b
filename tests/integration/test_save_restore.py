"""Save and restore through a real sidecar over a unix socket: lossless and bitwise."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from statecheck import assert_bitwise_equal, flat_tensors, small_model, train_steps

from trainer_client import RestoreError, SaveSkipped


@pytest.mark.parametrize("shm", ["on", "off"])
def test_roundtrip_is_bitwise_including_lazy_optimizer_state_and_rng(
    make_sidecar, make_client, job_name, shm
):
    server = make_sidecar()
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_steps(model, opt, 3)
    extra = {"bf16": torch.randn(5, 3).to(torch.bfloat16), "flag": torch.tensor(True), "note": ("a", 1, -0.0)}
    state = {"model": model, "opt": opt, "extra": extra, "epoch": 7}
    client = make_client(server, job_name, shm=shm)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    assert client.save(3, state).durable.result(30).step == 3
    expected = (random.random(), np.random.rand(), torch.rand(4))

    # A fresh process-like state: new model, optimizer without any state yet.
    model2 = small_model(seed=99)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    state2 = {"model": model2, "opt": opt2, "extra": {}, "epoch": 0}
    random.seed(0)
    torch.manual_seed(0)
    assert client.restore(state2) == 3
    assert_bitwise_equal(model2, model)
    assert_bitwise_equal(opt2, opt)
    assert_bitwise_equal(state2["extra"], extra)
    assert state2["epoch"] == 7 and state2["extra"]["note"] == ("a", 1, -0.0)
    # The next random numbers continue exactly where the saved run would have.
    after = (random.random(), np.random.rand(), torch.rand(4))
    assert after[0] == expected[0] and after[1] == expected[1] and torch.equal(after[2], expected[2])
    # Training on from the restored state stays bitwise equal to training on from the original.
    rng = torch.get_rng_state()
    train_steps(model, opt, 2, seed=3)
    torch.set_rng_state(rng)  # same dropout masks for both
    train_steps(model2, opt2, 2, seed=3)
    assert_bitwise_equal(model2, model)
    assert_bitwise_equal(opt2, opt)


def test_restore_reads_storage_after_a_sidecar_restart(make_sidecar, make_client, job_name, s3_store_url):
    url, endpoint = s3_store_url
    first = make_sidecar(url, s3_endpoint=endpoint)
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, 2)
    client = make_client(first, job_name)
    client.save(10, {"model": model, "opt": opt}).durable.result(30)
    assert client.last_restore is None
    client.close()
    first.stop(grace=1)

    second = make_sidecar(url, s3_endpoint=endpoint)  # empty memory: must read S3
    client2 = make_client(second, job_name)
    model2, opt2 = small_model(seed=3), None
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    assert client2.restore({"model": model2, "opt": opt2}) == 10
    assert client2.last_restore["source"] == "storage"
    assert_bitwise_equal(model2, model)
    assert_bitwise_equal(opt2, opt)


def test_restore_prefers_memory_when_it_holds_the_newest_step(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name)
    t = {"w": torch.arange(10.0)}
    client.save(1, t).durable.result(30)
    client.save(2, {"w": torch.arange(10.0) * 2}).durable.result(30)
    out = {"w": torch.zeros(10)}
    assert client.restore(out) == 2
    assert client.last_restore["source"] == "memory"
    assert torch.equal(out["w"], torch.arange(10.0) * 2)
    assert client.restore(out, step=1) == 1  # older step: from storage
    assert client.last_restore["source"] == "storage"
    assert torch.equal(out["w"], torch.arange(10.0))


@pytest.mark.parametrize("shm", ["on", "off"])
def test_mutation_after_save_returns_never_leaks_into_the_snapshot(make_sidecar, make_client, job_name, shm):
    server = make_sidecar()
    client = make_client(server, job_name, shm=shm)
    model = small_model()
    before = flat_tensors(model)
    handle = client.save(1, {"model": model})
    with torch.no_grad():  # the training loop goes on at once
        for p in model.parameters():
            p.add_(1.0)
    handle.durable.result(30)
    fresh = small_model(seed=42)
    client.restore({"model": fresh})
    for name, tensor in flat_tensors(fresh).items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("shm", ["on", "off"])
@pytest.mark.parametrize("how", ["passed", "found in the state"])
def test_overlapped_staging_excludes_every_later_mutation(make_sidecar, make_client, job_name, shm, how):
    """Parameters and optimizer state are staged while forward/backward run; BatchNorm
    statistics and Embedding(max_norm) weights change in forward, so they are captured in save().
    By default (overlap="auto") the optimizers in the saved state get this without being passed."""
    server = make_sidecar()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8, max_norm=0.5),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randint(0, 50, (16, 2))
    model(x).sum().backward()
    opt.step()
    client = make_client(server, job_name, shm=shm, optimizers=[opt] if how == "passed" else [])
    state = {"model": model, "opt": opt}
    expected = flat_tensors(state)
    handle = client.save(1, state)
    assert client._overlap.optimizers == [opt]
    # Next iteration right away: forward mutates BN stats and renormalises embedding rows.
    opt.zero_grad()
    model(torch.randint(0, 50, (16, 2)) * 1).pow(2).sum().backward()
    opt.step()  # the pre-hook waits for staging
    assert handle.staged.done()
    handle.durable.result(30)
    assert any(not torch.equal(v, expected[k]) for k, v in flat_tensors(state).items()), "nothing changed?"

    model2 = torch.nn.Sequential(
        torch.nn.Embedding(50, 8, max_norm=0.5),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 1),
    )
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.05)
    client.restore({"model": model2, "opt": opt2})
    got = flat_tensors({"model": model2, "opt": opt2})
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


def test_a_save_while_the_previous_streams_is_skipped_and_counted(
    make_sidecar, make_client, job_name, monkeypatch
):
    server = make_sidecar()
    client = make_client(server, job_name)
    gate = __import__("threading").Event()
    original = client._requests

    def held(*args, **kwargs):
        gate.wait(30)  # the first stream cannot start until the test says so
        yield from original(*args, **kwargs)

    monkeypatch.setattr(client, "_requests", held)
    first = client.save(1, {"w": torch.ones(4)})
    second = client.save(2, {"w": torch.ones(4) * 2})
    assert second.skipped and client.stats["skipped"] == 1
    with pytest.raises(SaveSkipped):
        second.durable.result(5)
    gate.set()
    assert first.durable.result(30).step == 1
    client.save(3, {"w": torch.ones(4) * 3}).durable.result(30)  # reports the skip to the sidecar
    skipped = server.metrics.registry.get_sample_value(
        "strata_saves_skipped_total", {"training_job": job_name}
    )
    assert skipped == 1


def test_wait_policy_blocks_instead_of_skipping(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name, when_busy="wait")
    handles = [client.save(s, {"w": torch.full((1000,), float(s))}) for s in range(5)]
    assert not any(h.skipped for h in handles)
    assert [h.durable.result(30).step for h in handles] == list(range(5))
    # Snapshots of a rank commit in order, and only the newest stays in memory.
    held = server.engine.snapshots()
    assert [(s.step, s.state) for s in held] == [(4, "committed")]


def test_resume_policies(make_sidecar, make_client, job_name):
    server = make_sidecar()
    assert make_client(server, job_name, resume="auto").resume({"w": torch.zeros(1)}) is None
    assert make_client(server, job_name, resume="never").resume({"w": torch.zeros(1)}) is None
    with pytest.raises(RestoreError, match="no committed checkpoint"):
        make_client(server, job_name, resume="require").resume({"w": torch.zeros(1)})
    make_client(server, job_name).save(4, {"w": torch.ones(1)}).durable.result(30)
    out = {"w": torch.zeros(1)}
    assert make_client(server, job_name, resume="never").resume(out) is None and out["w"].item() == 0
    assert make_client(server, job_name, resume="require").resume(out) == 4 and out["w"].item() == 1


def test_restore_refuses_a_state_that_does_not_match(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name)
    client.save(1, {"a": torch.ones(2)}).durable.result(30)
    with pytest.raises(RestoreError, match="b"):
        client.restore({"a": torch.zeros(2), "b": torch.zeros(2)})


def test_overlap_off_stages_everything_inside_save(make_sidecar, make_client, job_name):
    server = make_sidecar()
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    train_steps(model, opt, 1)
    client = make_client(server, job_name, overlap="off")
    handle = client.save(1, {"model": model, "opt": opt})
    assert client._overlap.optimizers == [] and handle.staged.done()  # copied before save() returned
    handle.durable.result(30)
    with pytest.raises(ValueError, match="overlap='sometimes': expected one of auto, off"):
        make_client(server, job_name, overlap="sometimes")


@pytest.mark.parametrize("shm", ["on", "off"])
def test_staging_is_prefaulted_off_the_training_thread_before_the_first_save(
    make_sidecar, make_client, job_name, shm, monkeypatch
):
    """resume() on a fresh run knows the state: the buffers are allocated and pre-faulted in the
    warm thread, again after the first optimizer step (Adam's lazy state changes the layout), so
    the first save() only copies. After a restore the same happens for the restored layout."""
    from trainer_client import _staging

    threads: list[str] = []
    original = _staging.HostBuffers._allocate

    def spy(self: Any, size: int, pin: bool) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, size, pin)

    monkeypatch.setattr(_staging.HostBuffers, "_allocate", spy)
    server = make_sidecar()
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "opt": opt}
    client = make_client(server, job_name, shm=shm)
    assert client.resume(state) is None  # nothing committed yet: a fresh start
    client._wait_warm()
    per_buffer = len(client._buffers)
    assert [b.allocations for b in client._buffers] == [1] * per_buffer
    train_steps(model, opt, 1)  # the post-step hook warms for the layout with Adam's moments
    client._wait_warm()
    assert [b.allocations for b in client._buffers] == [2] * per_buffer
    client.save(1, state).durable.result(30)
    assert [b.allocations for b in client._buffers] == [2] * per_buffer  # the save allocated nothing
    assert threads and all(name.startswith("strata-warm") for name in threads), threads
    assert client.stats["first_save_stall_s"] > 0
    # a new process restores step 1 and is warmed for it before its first save
    threads.clear()
    model2 = small_model()
    opt2 = torch.optim.Adam(model2.parameters())
    again = make_client(server, job_name, shm=shm)
    restored = {"model": model2, "opt": opt2}
    assert again.resume(restored) == 1
    again._wait_warm()
    assert [b.allocations for b in again._buffers] == [1] * per_buffer
    train_steps(model2, opt2, 1)
    again.save(2, restored).durable.result(30)
    assert [b.allocations for b in again._buffers] == [1] * per_buffer
    assert threads and all(name.startswith("strata-warm") for name in threads), threads


@pytest.mark.parametrize("shm", ["on", "off"])
def test_host_buffers_are_allocated_once_and_reused(make_sidecar, make_client, job_name, shm):
    server = make_sidecar()
    client = make_client(server, job_name, shm=shm)
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "opt": opt}
    client.save(0, state).durable.result(30)  # Adam has no state yet
    train_steps(model, opt, 1)
    for step in range(1, 4):  # the layout grew once (lazy Adam state), then stays
        client.save(step, state).durable.result(30)
        train_steps(model, opt, 1)
    # One staging segment by default, streamed or shared (the sidecar keeps the committed
    # snapshot in it until the next save).
    assert [b.allocations for b in client._buffers] == [2]
    assert all(b.shared == (shm == "on") for b in client._buffers)
    assert client.stats["first_save_stall_s"] > 0


def test_unsupported_dtype_is_refused_in_save_naming_the_tensor(make_sidecar, make_client, job_name):
    server = make_sidecar()
    client = make_client(server, job_name)
    with pytest.raises(TypeError, match=r"weird: dtype torch.uint1"):
        client.save(1, {"weird": torch.zeros(8, dtype=torch.uint1)})
