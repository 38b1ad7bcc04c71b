"""One sidecar per pod: two sidecars that tell each other of manifests and commits over real
gRPC (peer hints), a dead trainer noticed in seconds, a preempted pod that does not abort a
step the others completed, and quantized restores that agree between memory and storage."""

from __future__ import annotations

import time

import pytest
import torch

from sidecar import manifest as mf
from sidecar.store import open_store
from trainer_client import SaveFailed


def _ranks(make_client, pods, job, generation="pods/0", **options):
    return [
        make_client(pods[r], job, rank=r, world_size=2, generation=generation, capture_rng=False, **options)
        for r in range(2)
    ]


def test_two_pods_commit_through_hints_without_polling_storage(two_pods, make_client, job_name):
    make, url, endpoint = two_pods
    pods = make(hint_fallback_s=120)  # a storage poll would take minutes: only hints can be this fast
    ranks = _ranks(make_client, pods, job_name)
    for step in range(1, 4):
        handles = [ranks[r].save(step, {"w": torch.full((64,), float(10 * step + r))}) for r in range(2)]
        t0 = time.monotonic()
        assert [h.durable.result(30).step for h in handles] == [step, step]
        assert time.monotonic() - t0 < 10
    store = open_store(url, endpoint_url=endpoint)
    assert mf.committed_steps(store, "default", job_name) == [1, 2, 3]
    # Both pods resume from the same step, each its own rank's values.
    later = _ranks(make_client, pods, job_name, generation="pods/1")
    outs = [{"w": torch.empty(64)} for _ in range(2)]
    assert [later[r].restore(outs[r]) for r in range(2)] == [3, 3]
    assert [float(o["w"][0]) for o in outs] == [30.0, 31.0]
    store.close()


@pytest.mark.parametrize("dead", [1, 0], ids=["rank-1", "rank-0-the-committer"])
def test_a_dead_trainer_fails_the_step_on_the_other_pod_in_seconds(two_pods, make_client, job_name, dead):
    make, _, _ = two_pods
    pods = make(hint_fallback_s=120, commit_timeout_s=300)
    ranks = _ranks(make_client, pods, job_name)
    for r in range(2):
        ranks[r].save(1, {"w": torch.zeros(64)})
    for r in range(2):
        ranks[r].wait(30)
    pending = ranks[1 - dead].save(2, {"w": torch.zeros(64)})
    time.sleep(0.5)
    ranks[dead].close(wait=False)  # its trainer goes away without saving step 2
    t0 = time.monotonic()
    with pytest.raises(SaveFailed, match=rf"rank\(s\) \[{dead}\] left attempt"):
        pending.durable.result(60)
    assert time.monotonic() - t0 < 10  # not the 300 s commit timeout


def test_a_dropped_attach_stream_is_opened_again_and_the_rank_counts_again(two_pods, make_client, job_name):
    """A dropped Attach stream marks the rank gone on every pod; the client opens it again and the
    rank's sidecar tells the others it is back, so its next save is waited for."""
    make, _, _ = two_pods
    pods = make(hint_fallback_s=120)
    ranks = _ranks(make_client, pods, job_name)
    handles = [ranks[r].save(1, {"w": torch.zeros(64)}) for r in range(2)]
    assert [h.durable.result(30).step for h in handles] == [1, 1]
    gang0 = pods[0].engine.gang(("default", job_name))

    def gone_on_pod_0() -> bool:
        with gang0.cond:
            return 1 in gang0.gone.get(0, {})

    ranks[1]._attach.cancel()  # the stream drops; the trainer lives on and re-attaches
    deadline = time.monotonic() + 10
    seen_gone = False
    while time.monotonic() < deadline:
        seen_gone |= gone_on_pod_0()
        if seen_gone and not gone_on_pod_0():
            break
        time.sleep(0.02)
    assert seen_gone and not gone_on_pod_0()
    handles = [ranks[r].save(2, {"w": torch.ones(64)}) for r in range(2)]
    assert [h.durable.result(30).step for h in handles] == [2, 2]


def test_a_preempted_pod_does_not_abort_a_step_the_others_completed(two_pods, make_client, job_name):
    make, url, endpoint = two_pods
    pods = make(hint_fallback_s=1)
    ranks = _ranks(make_client, pods, job_name)
    # Rank 0 holds its save of step 1 back; rank 1 saves it (MANIFEST durable) and its pod is
    # deleted (SIGTERM -> the sidecar stops) while it waits for rank 0's COMMIT.
    h1 = ranks[1].save(1, {"w": torch.ones(64)})
    store = open_store(url, endpoint_url=endpoint)
    deadline = time.monotonic() + 20
    while not mf.step_state(store, "default", job_name, 1, 0).manifests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 1 in mf.step_state(store, "default", job_name, 1, 0).manifests
    pods[1].stop(grace=1)
    with pytest.raises(SaveFailed):
        h1.durable.result(10)
    state = mf.step_state(store, "default", job_name, 1, 0)
    assert state.skipped == []  # no marker: the step still commits without that pod
    assert ranks[0].save(1, {"w": torch.zeros(64)}).durable.result(30).step == 1
    assert mf.committed_steps(store, "default", job_name) == [1]
    store.close()


@pytest.mark.parametrize(
    ("quantize", "restore_class"), [("4", "stored"), ("float16", "stored"), ("4", "auto")]
)
def test_quantized_restores_agree_between_memory_and_storage(
    make_sidecar, make_client, job_name, quantize, restore_class
):
    """Stored class: memory gives the lossy values storage gives, bit for bit. Auto: a lone rank
    restores the exact snapshot from memory; storage still gives the lossy values."""
    server = make_sidecar(
        quantize=quantize, quantize_match="emb", policy="intermittent", restore_class=restore_class
    )
    client = make_client(server, job_name, capture_rng=False)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(4096, 32, generator=gen)
    state = {"emb": table, "dense": torch.randn(300, 64, generator=gen)}
    for step in range(4):
        rows = torch.randint(0, 4096, (200,), generator=gen)
        table[rows] += 0.01 * torch.randn(200, 32, generator=gen)
        client.save(step, state).durable.result(60)
    manifest = mf.Manifest.from_json(server.engine.describe("default", job_name, 3, 0)[1])
    assert manifest.checkpoint == "diff" and next(t for t in manifest.tensors if t.name == "emb").lossy
    same_gang = client.settings.generation
    from_memory = {"emb": torch.empty(4096, 32), "dense": torch.empty(300, 64)}
    reader = make_client(server, job_name, capture_rng=False, generation=same_gang)
    assert reader.restore(from_memory) == 3 and reader.last_restore["source"] == "memory"
    from_storage = {"emb": torch.empty(4096, 32), "dense": torch.empty(300, 64)}
    fresh = make_sidecar(
        server.settings.storage, quantize=quantize, quantize_match="emb", restore_class=restore_class
    )
    stored = make_client(fresh, job_name, capture_rng=False)
    assert stored.restore(from_storage) == 3 and stored.last_restore["restore_class"] == "stored"
    assert torch.equal(from_memory["dense"], state["dense"]) and torch.equal(
        from_storage["dense"], state["dense"]
    )
    assert not torch.equal(from_storage["emb"], table)  # storage holds the lossy values
    if restore_class == "stored":
        assert reader.last_restore["restore_class"] == "stored"
        assert torch.equal(from_memory["emb"], from_storage["emb"])  # bit for bit, lossy values alike
    else:
        assert reader.last_restore["restore_class"] == "exact"
        assert torch.equal(from_memory["emb"], table)  # as saved
