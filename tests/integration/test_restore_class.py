"""The gang's restore class over real gRPC and storage: when every rank can restore the attempt's
step exactly (its own sidecar's memory, or a buddy's copy after its pod was lost) every rank
restores it as saved, quantized tables included, and the EPOCH records the class; when one rank
cannot (its pod lost with no copy anywhere), every rank restores what storage holds, so the ranks
never mix exact and lossy state. Later checkpoints carry which restores were lossy, and ``auto``
sizes its bits by those."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sidecar import manifest as mf
from sidecar.store import open_store
from tests.fixtures.member_pods import Pods, data_gets, on_every_rank, restore_all, save_all, settled

ROWS, DIM = 4096, 32


@pytest.fixture
def pods(short_tmp):
    made: list[Pods] = []

    def make(n: int, mode: str, **options: Any) -> Pods:
        made.append(Pods(short_tmp, n, mode, **{"quantize": "auto", "quantize_match": "table", **options}))
        return made[-1]

    yield make
    for p in made:
        p.close()


def state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"table": torch.randn(ROWS, DIM, generator=g), "dense": torch.randn(999, generator=g)}


def blank() -> dict[str, Any]:
    return {"table": torch.zeros(ROWS, DIM), "dense": torch.zeros(999)}


def epoch(p: Pods, job: str) -> mf.Epoch:
    store = open_store(p.storage)
    try:
        return mf.read_fences(store, "default", job).newest  # type: ignore[return-value]
    finally:
        store.close()


def rank_manifest(p: Pods, job: str, step: int, rank: int) -> mf.Manifest:
    server = p.servers[rank]
    assert server is not None
    return mf.Manifest.from_json(server.engine.describe("default", job, step, rank)[1])


def test_a_gang_whose_ranks_all_hold_the_step_restores_it_exactly(pods, job_name):
    p = pods(2, "off")
    saved = [state(r, 5) for r in range(2)]
    clients = save_all(p, job_name, 5, states=saved)
    table = next(t for t in rank_manifest(p, job_name, 5, 0).tensors if t.name == "table")
    assert table.bits == 4  # auto: 1 restore expected from storage -> 4 bits
    results = restore_all(p, job_name, "run/1", [blank(), blank()])
    for r, (got, info) in enumerate(results):
        assert (info["source"], info["restore_class"]) == ("memory", "exact"), (r, info)
        assert info["unverified_tensors"] == 0  # the quantized table too: checked against its digest
        for name in saved[r]:
            assert torch.equal(got[name], saved[r][name]), (r, name)
    assert epoch(p, job_name).restore_class == "exact"
    save_all(p, job_name, 6, "run/1", [state(r, 6) for r in range(2)])
    after = rank_manifest(p, job_name, 6, 0)
    assert (after.restores, after.storage_restores) == (1, 0)
    for c in clients:
        c.close()


def test_a_lost_member_with_a_buddys_copy_keeps_the_gang_exact(pods, job_name):
    p = pods(3, "buddy")
    saved = [state(r, 5) for r in range(3)]
    for c in save_all(p, job_name, 5, states=saved):
        c.close()
    assert settled(lambda: p.pushed(job_name, "replica"), [1.0] * 3) == [1.0] * 3
    p.stop(1, wipe=True)
    p.start(1)  # the replacement pod: its memory and emptyDir are empty
    results = restore_all(p, job_name, "run/1", [blank() for _ in range(3)])
    for r, (got, info) in enumerate(results):
        assert info["restore_class"] == "exact", (r, info)
        assert info["source"] == ("peer" if r == 1 else "memory"), (r, info)
        for name in saved[r]:
            assert torch.equal(got[name], saved[r][name]), (r, name)
    assert data_gets(p, 1, job_name) == []  # nothing of its snapshot read from storage
    assert epoch(p, job_name).restore_class == "exact"


def test_a_member_lost_without_a_copy_makes_every_rank_restore_what_storage_holds(pods, job_name):
    p = pods(2, "off")
    saved = [state(r, 5) for r in range(2)]
    for c in save_all(p, job_name, 5, states=saved):
        c.close()
    p.stop(1, wipe=True)
    p.start(1)
    results = restore_all(p, job_name, "run/1", [blank(), blank()])
    for r, (got, info) in enumerate(results):
        assert info["restore_class"] == "stored", (r, info)
        assert info["source"] == ("storage" if r == 1 else "memory"), (r, info)
        assert torch.equal(got["dense"], saved[r]["dense"])  # lossless tensors stay exact
        assert not torch.equal(got["table"], saved[r]["table"])  # rank 0 too: not its exact copy
        assert torch.allclose(got["table"], saved[r]["table"], atol=0.5)
    assert epoch(p, job_name).restore_class == ""
    save_all(p, job_name, 6, "run/1", [state(r, 6) for r in range(2)])
    after = rank_manifest(p, job_name, 6, 0)
    assert (after.restores, after.storage_restores) == (1, 1)


def test_the_stored_class_restores_storage_form_from_memory_and_sizes_bits_for_every_restore(pods, job_name):
    p = pods(2, "off", restore_class="stored")
    saved = [state(r, 5) for r in range(2)]
    for c in save_all(p, job_name, 5, states=saved):
        c.close()
    table = next(t for t in rank_manifest(p, job_name, 5, 0).tensors if t.name == "table")
    assert table.bits == 8  # 20 restores expected, all lossy -> 8 bits
    results = restore_all(p, job_name, "run/1", [blank(), blank()])
    for r, (got, info) in enumerate(results):
        assert (info["source"], info["restore_class"]) == ("memory", "stored"), (r, info)
        assert not torch.equal(got["table"], saved[r]["table"])
    assert epoch(p, job_name).restore_class == ""


def restore_step(p: Pods, job: str, generation: str, step: int) -> list[dict[str, Any]]:
    """Every rank restores ``step`` explicitly, each once its sidecar's read-ahead of the attempt's
    restore step (which every client starts) is done."""
    infos: list[Any] = [None] * p.n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            client = p.client(i, job, generation)
            server = p.servers[i]
            assert server is not None
            slot = ("default", job, i)
            prefetched = server.engine.restorer.prefetched
            assert settled(lambda: slot in prefetched and prefetched[slot][1].is_set(), True)
            client.restore(blank(), step=step)
            infos[i] = dict(client.last_restore or {})
        except BaseException as exc:
            errors.append(exc)

    on_every_rank(p.n, one)
    assert not errors, errors
    return infos


@pytest.mark.slow
def test_an_explicit_restore_of_the_attempts_step_takes_the_attempts_class_on_every_rank(pods, job_name):
    # The member that lost its pod reads its buddy's exact copy ahead; the explicit restore that
    # follows must not hand it out while the other ranks restore another class.
    p = pods(3, "buddy")
    for c in save_all(p, job_name, 5, states=[state(r, 5) for r in range(3)]):
        c.close()
    assert settled(lambda: p.pushed(job_name, "replica"), [1.0] * 3) == [1.0] * 3
    p.stop(1, wipe=True)
    p.start(1)
    infos = restore_step(p, job_name, "run/1", 5)
    assert epoch(p, job_name).restore_class == "exact"
    assert [i["restore_class"] for i in infos] == ["exact"] * 3, infos


def restore_errors(p: Pods, job: str, generation: str) -> list[str]:
    """A gang restart that may fail: each rank's error (or "")."""
    errors = [""] * p.n

    def one(i: int) -> None:
        try:
            p.client(i, job, generation).restore(blank())
        except Exception as exc:
            errors[i] = str(exc)

    on_every_rank(p.n, one)
    return errors


@pytest.mark.slow
def test_an_exact_copy_that_cannot_be_served_sends_the_next_attempt_to_storage(pods, job_name):
    # The buddy still reports its copy of the lost member, but the copy is damaged: the attempt
    # that trusted it fails, and the next one must not trust it again (a restart loop until the
    # restart limit is spent, where storage would have served).
    p = pods(3, "buddy")
    saved = [state(r, 5) for r in range(3)]
    for c in save_all(p, job_name, 5, states=saved):
        c.close()
    assert settled(lambda: p.pushed(job_name, "replica"), [1.0] * 3) == [1.0] * 3
    p.stop(1, wipe=True)
    p.start(1)
    buddy = p.servers[2]
    assert buddy is not None and buddy.engine.redundancy.holdings is not None
    (entry,) = buddy.engine.redundancy.holdings.complete_of("default", job_name)
    with open(entry.data, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    errors = restore_errors(p, job_name, "run/1")
    assert epoch(p, job_name).restore_class == "exact"
    assert errors[1] and "exact copy is gone" in errors[1], errors
    for c in p.clients:
        c.close(wait=False)
    results = restore_all(p, job_name, "run/2", [blank() for _ in range(3)])
    assert epoch(p, job_name).restore_class == ""
    for r, (got, info) in enumerate(results):
        assert info["restore_class"] == "stored", (r, info)
        assert torch.equal(got["dense"], saved[r]["dense"])


def restore_replicated(p: Pods, job: str, generation: str) -> list[tuple[dict[str, Any] | None, str]]:
    """A gang restart of state whose table every rank replicates: (state, error) per rank."""
    out: list[Any] = [(None, "")] * p.n

    def one(i: int) -> None:
        target = blank()
        try:
            client = p.client(i, job, generation)
            client.replicate(target["table"], group=list(range(p.n)))
            client.restore(target)
            out[i] = (target, (client.last_restore or {}).get("restore_class", ""))
        except Exception as exc:
            out[i] = (None, f"error: {exc}")

    on_every_rank(p.n, one)
    return out


@pytest.mark.slow
def test_replicated_lossy_tensors_never_mix_classes_when_their_owner_is_rebuilt_from_parity(pods, job_name):
    # The owner's member is lost and rebuilt exactly from parity; the other ranks read the owner's
    # replicated table (open_rank), which no member holds exactly: they must not fall back to
    # storage's form silently while the owner restores the table as saved.
    p = pods(3, "parity", quantize_match="*")  # a rank that owns no table saves lossy dense state
    table = state(0, 5)["table"]
    states = [{"table": table.clone(), "dense": state(r, 5)["dense"]} for r in range(3)]
    clients = []
    for r in range(3):
        c = p.client(r, job_name, "run/0")
        c.replicate(states[r]["table"], group=[0, 1, 2])
        clients.append(c)
    save_all(p, job_name, 5, states=states, clients=clients)
    owner = next(x.owner for x in rank_manifest(p, job_name, 5, 1).replicas if x.name.endswith("table"))
    assert settled(lambda: p.protected(job_name, 5), True)
    for c in clients:
        c.close()
    p.stop(owner, wipe=True)
    p.start(owner)
    first = restore_replicated(p, job_name, "run/1")
    if all(not e.startswith("error") for _, e in first):
        tables = [s["table"] for s, _ in first if s is not None]
        assert all(torch.equal(t, tables[owner]) for t in tables), [e for _, e in first]
        return
    for c in p.clients:
        c.close(wait=False)
    second = restore_replicated(p, job_name, "run/2")
    assert epoch(p, job_name).restore_class == ""
    assert [e for _, e in second] == ["stored"] * 3, second  # the ranks without a lossy tensor too
    tables = [s["table"] for s, _ in second if s is not None]
    assert all(torch.equal(t, tables[0]) for t in tables)
    assert not torch.equal(tables[0], table)  # storage's form, on every rank


def test_a_lone_rank_restarts_without_holdings_reports(make_sidecar, make_client, job_name):
    # A lone rank's class is decided by what it finds (exact when held): reports would only cost
    # storage requests at every restart, and rank 0's wait (60 s) where one is not written.
    server = make_sidecar(quantize="4", quantize_match="table", encode_workers=1)
    saved = {"table": torch.randn(256, 8)}
    make_client(server, job_name, capture_rng=False, generation="run/0").save(5, saved).durable.result(30)
    client = make_client(server, job_name, capture_rng=False, generation="run/1")
    got = {"table": torch.zeros(256, 8)}
    assert client.restore(got) == 5 and client.last_restore["restore_class"] == "exact"
    assert torch.equal(got["table"], saved["table"])
    assert server.store.list(mf.job_prefix("default", job_name) + "HOLDS/").objects == []


def test_a_restore_through_the_read_of_its_own_rank_counts_for_auto(
    make_sidecar, make_client, job_name, short_tmp
):
    # DCP's reader (TorchRec, FSDP2 state) restores a rank by reading its own snapshot: a lossy
    # restore that way must count, or auto never escalates for those jobs.
    storage = f"file://{short_tmp}/own"
    first = make_sidecar(storage, quantize="auto", quantize_match="table", encode_workers=1)
    saved = {"table": torch.randn(256, 8)}
    make_client(first, job_name, capture_rng=False, generation="run/0").save(5, saved).durable.result(30)
    first.stop(grace=0)
    server = make_sidecar(storage, quantize="auto", quantize_match="table", encode_workers=1)  # a lost pod
    client = make_client(server, job_name, capture_rng=False, generation="run/1", resume="never")
    header, tensors = client._read_rank(0)
    assert (header.step, header.source, header.restore_class) == (5, "storage", "stored")
    client.save(6, {"table": tensors[0].reshape(256, 8)}).durable.result(30)
    after = mf.load_manifest(server.store, mf.read_commit(server.store, "default", job_name, 6), 0)
    assert (after.restores, after.storage_restores) == (1, 1)


def test_rank_0_knows_its_own_holdings_when_its_report_was_not_written(make_sidecar, make_client, job_name):
    # Two ranks on one sidecar; the bucket refuses rank 0's report for a moment. Rank 0's sidecar
    # knows what it holds: it must not wait out its limit for its own report and decide stored.
    server = make_sidecar(quantize="4", quantize_match="table", encode_workers=1, commit_timeout_s=3.0)
    saved = [{"table": torch.randn(256, 8)} for _ in range(2)]
    first = [
        make_client(server, job_name, rank=r, world_size=2, capture_rng=False, generation="run/0")
        for r in range(2)
    ]
    for h in [c.save(5, s) for c, s in zip(first, saved, strict=True)]:
        h.durable.result(30)
    put = server.store.put
    refused: list[str] = []

    def flaky(key: str, *args: Any, **kwargs: Any) -> Any:
        if "/HOLDS/" in key and key.endswith("000000") and not refused:
            refused.append(key)
            raise OSError("503 slow down")
        return put(key, *args, **kwargs)

    server.store.put = flaky  # type: ignore[method-assign]
    got = [{"table": torch.zeros(256, 8)} for _ in range(2)]
    clients = [
        make_client(
            server, job_name, rank=r, world_size=2, capture_rng=False, generation="run/1", resume="never"
        )
        for r in range(2)
    ]
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            clients[r].restore(got[r])
        except BaseException as exc:
            errors.append(exc)

    on_every_rank(2, one, timeout=60)
    assert not errors and refused
    assert [c.last_restore["restore_class"] for c in clients] == ["exact", "exact"]
    for r in range(2):
        assert torch.equal(got[r]["table"], saved[r]["table"])


@pytest.mark.slow
def test_a_lost_member_rebuilt_from_parity_keeps_the_gang_exact(pods, job_name):
    # The rule over real reports: every other member of the group holds its parity part.
    p = pods(4, "parity")
    saved = [state(r, 5) for r in range(4)]
    for c in save_all(p, job_name, 5, states=saved):
        c.close()
    assert settled(lambda: p.protected(job_name, 5), True)
    p.stop(1, wipe=True)
    p.start(1)
    results = restore_all(p, job_name, "run/1", [blank() for _ in range(4)])
    assert epoch(p, job_name).restore_class == "exact"
    for r, (got, info) in enumerate(results):
        assert (info["source"], info["restore_class"]) == ("peer" if r == 1 else "memory", "exact"), (r, info)
        assert torch.equal(got["table"], saved[r]["table"])
