"""Check-N-Run through a real sidecar: every policy restores every committed step bitwise
from storage (chains of 10+ diffs, a skipped save in the middle), diffs hold exactly the
changed rows, retention keeps chains whole, a missing base falls back loudly, and
quantization stays within its bound on embedding tables while the rest stays exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import hold_stream, settled
from torch import nn

from sidecar import manifest as mf
from sidecar.pipeline import encode as enc
from trainer_client import SaveFailed

ROWS, DIM = 4096, 16  # 256 KiB: above the size where diffs start


def new_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "table": torch.randn(ROWS, DIM, generator=g),
        "ids": torch.arange(ROWS * 8, dtype=torch.int64).reshape(ROWS, 8),  # 256 KiB of int64
        "bias": torch.randn(10, generator=g),  # small: always stored whole
    }


def touch(state: dict[str, Any], step: int, rows: int) -> list[int]:
    """Change ``rows`` rows of the table (and one of ids, and the bias); returns them."""
    g = torch.Generator().manual_seed(1000 + step)
    picked = torch.randperm(ROWS, generator=g)[:rows]
    state["table"][picked] += 0.5
    state["ids"][step % ROWS, 0] += 1
    state["bias"] += 1
    return sorted(picked.tolist())


def copy(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in state.items()}


def manifest(server: Any, job: str, step: int) -> mf.Manifest:
    return mf.load_manifest(server.store, mf.read_commit(server.store, "default", job, step), 0)


def grouped(rows: set[int] | list[int]) -> list[int]:
    """The table's rows a diff found from digests writes for ``rows``: their digest groups'."""
    g = enc.digest_group(DIM * 4)
    return sorted({r // g * g + i for r in rows for i in range(g)})


def restore_from_storage(make_sidecar: Any, make_client: Any, storage: str, job: str, step: int) -> Any:
    """A sidecar that holds nothing in memory: the restore replays the stored chain."""
    fresh = make_sidecar(storage)
    out = new_state(seed=99)
    client = make_client(fresh, job, capture_rng=False, resume="never")
    assert client.restore(out, step=step) == step
    assert client.last_restore["source"] == "storage"
    return out, client


@pytest.mark.parametrize("policy", ["full", "one-shot", "consecutive", "intermittent"])
def test_every_policy_restores_every_step_bitwise_from_storage(
    make_sidecar, make_client, job_name, short_tmp, monkeypatch, policy
):
    storage = f"file://{short_tmp}/{policy}"
    server = make_sidecar(storage, policy=policy)
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    saved: dict[int, dict[str, Any]] = {}
    changed: dict[int, list[int]] = {}
    for step in range(14):
        changed[step] = touch(state, step, rows=40 * (step + 1))  # diffs grow, as with real lookups
        if step == 6:  # a save skipped in the middle: its rows must reach the next diff
            gate = hold_stream(client, monkeypatch)
            held = client.save(step, state)
            assert client.save(100, state).skipped
            gate.set()
            held.durable.result(30)
            monkeypatch.undo()
            saved[step] = copy(state)
            changed[step] += touch(state, 100, rows=25)  # trained on while the save was skipped
            continue
        client.save(step, state).durable.result(30)
        saved[step] = copy(state)
    kinds = {s: manifest(server, job_name, s).checkpoint for s in saved}
    for step, expected in saved.items():
        out, _ = restore_from_storage(make_sidecar, make_client, storage, job_name, step)
        for name in expected:
            assert torch.equal(out[name], expected[name]), (policy, step, name)
        m = manifest(server, job_name, step)
        table = next(t for t in m.tensors if t.name == "table")
        if m.checkpoint == "diff":
            base = saved[m.base_step]
            truth = np.flatnonzero((expected["table"] != base["table"]).any(dim=1).numpy())
            # The diff holds exactly the rows that changed since its base, not one more, in the
            # digests' groups of rows (the base left memory when the one segment was staged into).
            g = enc.digest_group(DIM * 4)
            rows = len(np.unique(truth // g)) * g
            assert table.encoding == "rows-diff" and table.changed_rows == rows, (policy, step)
    if policy == "full":
        assert set(kinds.values()) == {"full"}
    elif policy == "consecutive":
        assert [kinds[s] for s in sorted(kinds)] == ["full"] + ["diff"] * 13  # a chain of 13 diffs
        assert all(manifest(server, job_name, s).base_step == s - 1 for s in range(1, 14) if s != 7)
        assert manifest(server, job_name, 13).requires == list(range(13))
    elif policy == "one-shot":
        assert [kinds[s] for s in sorted(kinds)] == ["full"] + ["diff"] * 13
        assert {manifest(server, job_name, s).base_step for s in range(1, 14)} == {0}
    else:  # intermittent: diffs until one would cost more than it saves, then a new baseline
        fulls = [s for s in sorted(kinds) if kinds[s] == "full"]
        assert fulls[0] == 0 and len(fulls) >= 2 and kinds[1] == "diff", kinds
        for s in range(1, 14):
            m = manifest(server, job_name, s)
            assert m.checkpoint == "full" or m.base_step == max(f for f in fulls if f < s)


def test_retention_keeps_chains_whole(make_sidecar, make_client, job_name, short_tmp):
    storage = f"file://{short_tmp}/gc"
    server = make_sidecar(storage, policy="consecutive", keep=2, max_diffs=5)
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    saved = {}
    for step in range(9):
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
        saved[step] = copy(state)
    # Steps 0-5: a full and 5 diffs; 6: a new full (max_diffs); 7, 8: diffs on 6. Keeping the
    # two newest (7, 8) keeps what they need (6, 7) and nothing older.
    steps = settled(lambda: mf.committed_steps(server.store, "default", job_name), [6, 7, 8])
    assert steps == [6, 7, 8]
    assert mf.read_commit(server.store, "default", job_name, 8).requires == [6, 7]
    out, _ = restore_from_storage(make_sidecar, make_client, storage, job_name, 8)
    assert all(torch.equal(out[k], saved[8][k]) for k in out)


def test_one_shot_retention_one_keeps_the_full_and_the_newest_diff(make_sidecar, make_client, job_name):
    server = make_sidecar(policy="one-shot", keep=1)
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    for step in range(5):
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
    assert settled(lambda: mf.committed_steps(server.store, "default", job_name), [0, 4]) == [0, 4]


def test_a_missing_base_falls_back_to_the_newest_restorable_chain(
    make_sidecar, make_client, job_name, short_tmp, caplog
):
    storage = f"file://{short_tmp}/broken"
    server = make_sidecar(storage, policy="one-shot", max_diffs=3)
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    saved = {}
    for step in range(6):  # 0 full, 1-3 diffs on 0, 4 full, 5 diff on 4
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
        saved[step] = copy(state)
    assert manifest(server, job_name, 4).checkpoint == "full" and manifest(server, job_name, 5).base_step == 4
    victim = manifest(server, job_name, 4).objects[0].key
    server.store.put(victim, b"not the object")
    fresh = make_sidecar(storage)
    out = new_state(seed=99)
    reader = make_client(fresh, job_name, capture_rng=False)
    assert reader.restore(out) == 3
    assert all(torch.equal(out[k], saved[3][k]) for k in out)
    reason = reader.last_restore["fallback_reason"]
    assert "step 5 needs step 4" in reason and victim in reason, reason


def test_the_first_save_after_a_sidecar_restart_is_full(make_sidecar, make_client, job_name, short_tmp):
    storage = f"file://{short_tmp}/restart"
    first = make_sidecar(storage, policy="one-shot")
    client = make_client(first, job_name, capture_rng=False)
    state = new_state()
    for step in range(3):
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
    first.stop(grace=1)
    second = make_sidecar(storage, policy="one-shot", socket=first.socket_path)
    for step in range(3, 5):
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
    kinds = [manifest(second, job_name, s).checkpoint for s in range(5)]
    assert kinds == ["full", "diff", "diff", "full", "diff"]


class Recsys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.Embedding(2048, 32) for _ in range(2))
        self.bag = nn.EmbeddingBag(1024, 32, mode="sum")
        self.fc = nn.Linear(96, 1)


@pytest.mark.parametrize(("bits", "bound"), [("8", 0.01), ("4", 0.1), ("2", 0.45), ("bfloat16", 0.01)])
def test_quantized_embedding_tables_stay_within_the_bound_and_the_rest_is_exact(
    make_sidecar, make_client, job_name, short_tmp, bits, bound
):
    storage = f"file://{short_tmp}/q"
    server = make_sidecar(storage, quantize=bits, policy="one-shot")
    model = Recsys()
    opt = torch.optim.Adagrad(model.parameters())
    state = {"model": model, "opt": opt}
    client = make_client(server, job_name, capture_rng=False)
    for step in range(3):
        model.tables[0].weight.data[step * 100 : step * 100 + 50] += 1.0
        model.fc.weight.data += 0.5
        opt.zero_grad()
        model.fc(torch.ones(1, 96)).sum().backward()
        opt.step()
        client.save(step, state).durable.result(30)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {k: v.clone() for k, v in opt.state[model.fc.weight].items()}
    m = manifest(server, job_name, 2)
    lossy = {t.name: t for t in m.tensors if t.bits or t.cast}
    assert set(lossy) == {"model.tables.0.weight", "model.tables.1.weight", "model.bag.weight"}
    assert all(t.rel_l2_error is not None and t.rel_l2_error < bound for t in lossy.values())
    assert lossy["model.tables.0.weight"].rel_l2_error > 0  # its changed rows were quantized
    assert server.metrics.quantization_error.labels(job_name)._value.get() == max(
        t.rel_l2_error for t in lossy.values()
    )
    fresh = make_sidecar(storage)
    model2 = Recsys()
    opt2 = torch.optim.Adagrad(model2.parameters())
    out = {"model": model2, "opt": opt2}
    assert make_client(fresh, job_name, capture_rng=False).restore(out) == 2
    for name, value in model2.state_dict().items():
        if "model." + name in lossy:
            err = (value - expected[name]).norm() / expected[name].norm()
            assert 0 < err < bound and value.dtype == expected[name].dtype
        else:
            assert torch.equal(value, expected[name]), name  # dense layers stay exact
    for k, v in opt2.state[model2.fc.weight].items():
        assert torch.equal(v, expected_opt[k])  # optimizer state stays exact


def test_a_quantize_rule_that_matches_nothing_fails_the_save_naming_it(make_sidecar, make_client, job_name):
    server = make_sidecar(quantize="4", quantize_match="model.tablez.*")
    client = make_client(server, job_name, capture_rng=False)
    with pytest.raises(SaveFailed, match=r"--quantize-match 'model.tablez.\*' matches no tensor"):
        client.save(1, {"model": Recsys()}).durable.result(30)


def test_bad_encoding_settings_fail_at_start_naming_the_setting(make_sidecar):
    with pytest.raises(ValueError, match="--policy"):
        make_sidecar(policy="sometimes")
    with pytest.raises(ValueError, match="--quantize '5'"):
        make_sidecar(quantize="5")
    with pytest.raises(ValueError, match="--restore-bits"):
        make_sidecar(quantize="auto", restore_bits="3")


# --- changed-row tracking --------------------------------------------------------------------------


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(8192, 16, sparse=True)  # 512 KiB: diffed
        self.bag = nn.EmbeddingBag(4096, 16, mode="sum", sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum() + self.bag(ids.remainder(4096).reshape(-1, 1)).sum()


def lookups(model: Tables, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    opt.zero_grad()
    model(torch.tensor(ids)).backward()
    opt.step()


def tracking_of(server: Any, job: str, step: int) -> dict[str, tuple[str, int]]:
    """How each tracked tensor's rows were found, without the spot check's detail."""
    return {
        t.name: (t.tracking.split(" (")[0], t.changed_rows)
        for t in manifest(server, job, step).tensors
        if t.tracking
    }


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's sparse Adagrad says so
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_tracked_tables_diff_exactly_the_looked_up_rows(
    make_sidecar, make_client, job_name, short_tmp, optimizer
):
    storage = f"file://{short_tmp}/track"
    server = make_sidecar(storage, policy="consecutive")
    model = Tables()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.Adagrad(model.parameters(), lr=0.1)
    )
    client = make_client(server, job_name, capture_rng=False)
    assert client.track(model, optimizer=opt) == ["emb", "bag"]
    state = {"model": model, "opt": opt}
    lookups(model, opt, [1, 2])  # Adagrad creates its state (sums) here
    client.save(0, state).durable.result(30)
    lookups(model, opt, [5, 6, 7, 8])
    client.save(1, state).durable.result(30)  # step 0 committed: from now on lookups count
    assert tracking_of(server, job_name, 1)["model.emb.weight"] == ("lookups", 4)
    detail = {t.name: t.tracking for t in manifest(server, job_name, 1).tensors}
    assert detail["model.emb.weight"] == "lookups (checked 6905 of 8188 untracked rows)"
    # Every untracked row but the 4 that share a digest group (64-byte rows: groups of 4) with
    # rows 5-8: those cannot be checked against their digest.
    assert detail["model.bag.weight"] == "lookups (checked 4088 of 4092 untracked rows)"
    lookups(model, opt, [100, 200])
    lookups(model, opt, [200, 300])
    client.save(2, state).durable.result(30)
    expected = copy(model.state_dict())
    found = tracking_of(server, job_name, 2)
    assert found["model.emb.weight"] == ("lookups", 3)  # rows 100, 200, 300
    assert found["model.bag.weight"] == ("lookups", 3)
    if optimizer == "adagrad":  # the optimizer-state rows travel with their table's rows
        sums = [name for name in found if name.startswith("opt.")]
        assert sums and all(found[n] == ("lookups", 3) for n in sums), found
    out, _ = restore_from_storage_into(make_sidecar, make_client, storage, job_name, 2)
    assert all(torch.equal(out[k], expected[k]) for k in expected)


def restore_from_storage_into(make_sidecar: Any, make_client: Any, storage: str, job: str, step: int) -> Any:
    fresh = make_sidecar(storage)
    model = Tables()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = make_client(fresh, job, capture_rng=False, resume="never")
    assert client.restore({"model": model, "opt": opt}, step=step) == step
    return model.state_dict(), client


def tracked(make_sidecar: Any, make_client: Any, job: str) -> tuple[Any, Tables, Any, Any]:
    """A consecutive-policy sidecar and a tracking client that committed steps 0 and 1."""
    server = make_sidecar(policy="consecutive")
    model = Tables()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    client = make_client(server, job, capture_rng=False)
    client.track(model, optimizer=opt)
    for step in range(2):
        lookups(model, opt, [step, step + 10])
        client.save(step, {"model": model}).durable.result(30)
    return server, model, opt, client


def test_rows_changed_outside_lookups_are_caught_and_diffed_by_value(make_sidecar, make_client, job_name):
    server, model, opt, client = tracked(make_sidecar, make_client, job_name)
    state = {"model": model}
    with torch.no_grad():
        model.emb.weight.mul_(0.999)  # weight decay behind the tracker's back: every row moves
    lookups(model, opt, [42, 43])
    client.save(2, state).durable.result(30)
    found = tracking_of(server, job_name, 2)
    assert found["model.emb.weight"] == ("values: tracking missed a row", 8192)
    assert found["model.bag.weight"][0] == "lookups"
    assert server.metrics.value_diff_fallbacks.labels(job_name)._value.get() == 1
    out = {"model": Tables()}
    make_client(make_sidecar(server.settings.storage), job_name, capture_rng=False).restore(out)
    assert torch.equal(out["model"].emb.weight, model.emb.weight)


def test_a_skipped_save_keeps_its_rows_for_the_next_diff(make_sidecar, make_client, job_name, monkeypatch):
    server, model, opt, client = tracked(make_sidecar, make_client, job_name)
    state = {"model": model}
    lookups(model, opt, [500])
    gate = hold_stream(client, monkeypatch)
    held = client.save(2, state)  # rows {500}
    lookups(model, opt, [600])
    assert client.save(3, state).skipped  # rows {600} wait for the next save
    gate.set()
    held.durable.result(30)
    monkeypatch.undo()
    lookups(model, opt, [700])
    client.save(4, state).durable.result(30)
    assert tracking_of(server, job_name, 2)["model.emb.weight"] == ("lookups", 1)
    assert tracking_of(server, job_name, 4)["model.emb.weight"] == ("lookups", 2)  # 600 and 700
    out = {"model": Tables()}
    make_client(make_sidecar(server.settings.storage), job_name, capture_rng=False).restore(out)
    assert torch.equal(out["model"].emb.weight, model.emb.weight)


def test_optimizers_that_move_untouched_rows_are_not_tracked(make_sidecar, make_client, job_name, caplog):
    server = make_sidecar()
    model = Tables()
    for opt in (
        torch.optim.Adam(model.emb.parameters()),
        torch.optim.SGD(model.emb.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(model.emb.parameters(), lr=0.1, weight_decay=1e-4),
    ):
        assert make_client(server, job_name).track(model.emb, optimizer=opt) == []
    assert "momentum moves rows" in caplog.text and "weight decay changes every row" in caplog.text
    assert "Adam may change rows" in caplog.text


def test_a_restore_from_storage_starts_a_new_chain(make_sidecar, make_client, job_name):
    server = make_sidecar(policy="one-shot")
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    for step in range(3):
        touch(state, step, rows=30)
        client.save(step, state).durable.result(30)
    out = new_state(seed=5)
    assert client.restore(out, step=1) == 1 and client.last_restore["source"] == "storage"
    touch(out, 3, rows=30)
    client.save(3, out).durable.result(30)
    assert [manifest(server, job_name, s).checkpoint for s in range(4)] == ["full", "diff", "diff", "full"]


@pytest.mark.parametrize("shm", ["on", "off"])
def test_large_tables_are_quantized_by_worker_processes_as_the_sidecar_would(
    make_sidecar, make_client, job_name, short_tmp, monkeypatch, shm
):
    """A table above the pool's threshold, saved through the trainer's segment (``on``) or
    streamed into the sidecar's memfd (``off``): the workers quantize it, full and diff, and
    the restore is bit for bit what one process quantizing it gives."""
    from sidecar.pipeline import quantize as qz
    from sidecar.pipeline.workers import MIN_POOL_BYTES, EncodePool

    used: list[int] = []
    original = EncodePool.quantize

    def counted(self: EncodePool, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(EncodePool, "quantize", counted)
    rows = MIN_POOL_BYTES // (64 * 4) * 3 + 5
    storage = f"file://{short_tmp}/w"
    server = make_sidecar(storage, quantize="4", quantize_match="table", policy="one-shot", encode_workers=2)
    client = make_client(server, job_name, capture_rng=False, shm=shm)
    table = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7))
    client.save(0, {"table": table}).durable.result(60)
    first = table.numpy().copy()
    changed = torch.randperm(rows, generator=torch.Generator().manual_seed(8))[: rows // 2]
    table[changed] += 0.25
    client.save(1, {"table": table}).durable.result(60)
    assert used == [True, True], "the worker processes did not quantize both checkpoints"
    assert [t.encoding for t in manifest(server, job_name, 1).tensors] == ["rows-diff-quantized"]

    want = qz.dequantize_rows(qz.quantize_rows(first, 4))
    mask = np.zeros(rows, bool)
    mask[changed.numpy()] = True
    want[mask] = qz.dequantize_rows(qz.quantize_rows(table.numpy()[mask], 4))
    out = {"table": torch.zeros(rows, 64)}
    restore_stored(make_sidecar, make_client, storage, job_name, out)
    assert np.array_equal(out["table"].numpy(), want)


def restore_stored(make_sidecar: Any, make_client: Any, storage: str, job: str, out: Any) -> None:
    client = make_client(make_sidecar(storage), job, capture_rng=False, resume="never")
    assert client.restore(out) is not None
    assert client.last_restore["source"] == "storage"


@pytest.mark.parametrize(("bits", "policy"), [("4", "one-shot"), ("bfloat16", "consecutive")])
def test_the_first_diff_after_a_restore_of_a_lossy_step_holds_only_the_rows_changed(
    make_sidecar, make_client, job_name, short_tmp, bits, policy
):
    """Under --restore-class stored a restore from memory hands back the table as storage holds
    it (dequantized), so the trainer no longer holds the exact snapshot the sidecar kept: the next
    diff must compare against what was restored, or every row of the table differs."""
    storage = f"file://{short_tmp}/lossy"
    server = make_sidecar(
        storage, quantize=bits, quantize_match="table", policy=policy, restore_class="stored"
    )
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    written = set(touch(state, 0, rows=0))
    client.save(0, state).durable.result(30)
    written |= set(touch(state, 1, rows=40))
    client.save(1, state).durable.result(30)
    assert client.restore(state) == 1 and client.last_restore["source"] == "memory"
    assert client.last_restore["restore_class"] == "stored"
    now = touch(state, 2, rows=25)
    written |= set(now)
    client.save(2, state).durable.result(30)
    entry = {t.name: t for t in manifest(server, job_name, 2).tensors}["table"]
    assert manifest(server, job_name, 2).checkpoint == "diff"
    # since the full one / the previous, in digest groups (the base left memory at staging)
    want = len(grouped(written)) if policy == "one-shot" else len(grouped(now))
    assert entry.changed_rows == want, (entry.changed_rows, want)  # not all 4096
    out, _ = restore_from_storage(make_sidecar, make_client, storage, job_name, 2)
    kept = torch.ones(ROWS, dtype=torch.bool)
    kept[grouped(now)] = False
    assert torch.equal(out["table"][kept], state["table"][kept])  # restored rows re-encode exactly
    assert torch.allclose(out["table"][~kept], state["table"][~kept], atol=0.5)
    mem = new_state(seed=7)
    assert client.restore(mem) == 2 and client.last_restore["source"] == "memory"
    assert torch.equal(mem["table"], out["table"])  # memory and storage agree bit for bit


@pytest.mark.parametrize(("bits", "policy"), [("4", "one-shot"), ("bfloat16", "consecutive")])
def test_an_exact_restore_after_lossy_checkpoints_diffs_against_what_storage_holds(
    make_sidecar, make_client, job_name, short_tmp, bits, policy
):
    """Under --restore-class auto a lone rank restores the exact snapshot held in memory, lossy
    table included; the next diff holds only the rows changed since (not every row), and what
    storage then holds of each row is the stored form of its value at its last write: rows not
    written since restore from storage as step 1's stored form did, the rest within the error."""
    storage = f"file://{short_tmp}/exact"
    server = make_sidecar(storage, quantize=bits, quantize_match="table", policy=policy)
    client = make_client(server, job_name, capture_rng=False)
    state = new_state()
    written = set(touch(state, 0, rows=0))
    client.save(0, state).durable.result(30)
    written |= set(touch(state, 1, rows=40))
    client.save(1, state).durable.result(30)
    saved = {k: v.clone() for k, v in state.items()}
    scratch = new_state(seed=5)
    assert client.restore(scratch) == 1 and client.last_restore["source"] == "memory"
    assert client.last_restore["restore_class"] == "exact"
    assert client.last_restore["unverified_tensors"] == 0  # the lossy table's exact digest checked
    for name in saved:
        assert torch.equal(scratch[name], saved[name]), name  # bitwise as saved, the table too
    for name in state:
        state[name].copy_(scratch[name])
    now = touch(state, 2, rows=25)
    written |= set(now)
    client.save(2, state).durable.result(30)
    entry = {t.name: t for t in manifest(server, job_name, 2).tensors}["table"]
    assert manifest(server, job_name, 2).checkpoint == "diff"
    want = len(grouped(written)) if policy == "one-shot" else len(grouped(now))
    assert entry.changed_rows == want, (entry.changed_rows, want)  # not all 4096
    out, fresh = restore_from_storage(make_sidecar, make_client, storage, job_name, 2)
    assert fresh.last_restore["restore_class"] == "stored"
    step1, _ = restore_from_storage(make_sidecar, make_client, storage, job_name, 1)
    assert not torch.equal(step1["table"], saved["table"])  # storage's form is lossy
    kept = torch.ones(ROWS, dtype=torch.bool)
    kept[grouped(written) if policy == "one-shot" else sorted(written)] = False
    assert torch.equal(out["table"][kept], step1["table"][kept])  # storage's form of their last write
    assert torch.allclose(out["table"][~kept], state["table"][~kept], atol=0.5)
    mem = new_state(seed=7)
    assert client.restore(mem) == 2 and client.last_restore["restore_class"] == "exact"
    assert torch.equal(mem["table"], state["table"])  # memory gives the exact step 2
