"""TorchRec tables through a real sidecar: client.track() on an EmbeddingBagCollection (under
torchrec's CombinedOptimizer) and on a FusedEmbeddingBagCollection (fbgemm's row-wise Adagrad)
makes the diffs hold exactly the rows training changed, and restores stay bitwise; --quantize
without a glob quantizes the tables of both (and nothing else)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from sidecar import manifest as mf

pytestmark = [
    pytest.mark.torchrec,
    # fbgemm-gpu-cpu warns, on import, of GPU-only lookups it lacks
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

with warnings.catch_warnings():  # collection imports it before the marks apply
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from tests.fixtures import dlrm

SHAPE = dlrm.Shape(rows=2048, dim=16, batch=16)  # 128 KiB tables: above the size diffs start at
TABLES = [f"model.sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight" for i in range(2)]
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("plain", {}),  # Adagrad (KeyedOptimizerWrapper in a CombinedOptimizer): sums per element
    "fused_rowwise": ("fused", {"fused_optimizer": RowWiseAdagrad}),
}


def manifest(server: Any, job: str, step: int) -> mf.Manifest:
    return mf.load_manifest(server.store, mf.read_commit(server.store, "default", job, step), 0)


def rows_changed(before: torch.Tensor, after: torch.Tensor) -> int:
    return int((before != after).reshape(before.shape[0], -1).any(1).sum())


@pytest.mark.parametrize("setup", SETUPS)
def test_tracked_torchrec_tables_diff_exactly_the_rows_training_changed(
    make_sidecar, make_client, job_name, short_tmp, setup
):
    kind, options = SETUPS[setup]
    storage = f"file://{short_tmp}/trec"
    server = make_sidecar(storage, policy="consecutive")
    model, opt = dlrm.build(kind, SHAPE, **options)
    client = make_client(server, job_name, capture_rng=False)
    assert len(client.track(model, optimizer=opt)) == SHAPE.tables
    state = dlrm.state_of(model, opt)
    for step in range(3):
        before = dlrm.snapshot(model, opt)
        dlrm.train_step(model, opt, dlrm.batch(SHAPE, 0, step))
        client.save(step, state).durable.result(30)  # steps 1 and 2 send the bitmaps
    after = dlrm.snapshot(model, opt)
    entries = {t.name: t for t in manifest(server, job_name, 2).tensors}
    assert manifest(server, job_name, 2).checkpoint == "diff"
    tracked = {n: t for n, t in entries.items() if t.tracking.startswith("lookups")}
    assert set(TABLES) <= tracked.keys(), {n: t.tracking for n, t in entries.items()}
    for name, t in tracked.items():
        assert t.changed_rows == rows_changed(before[name], after[name]) > 0, name
    if setup == "plain":  # the Adagrad sums' rows travel with their tables'
        assert len([n for n in tracked if n.startswith("optimizer.")]) == SHAPE.tables
    fresh = make_sidecar(storage)
    model2, opt2 = dlrm.build(kind, SHAPE, seed=1, **options)
    assert make_client(fresh, job_name, capture_rng=False).restore(dlrm.state_of(model2, opt2)) == 2
    got = dlrm.snapshot(model2, opt2)
    assert [k for k in after if not torch.equal(got[k], after[k])] == []


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_quantize_without_a_glob_quantizes_the_torchrec_tables_only(
    make_sidecar, make_client, job_name, kind
):
    server = make_sidecar(quantize="4", policy="full", restore_class="stored")  # restores give storage's form
    model, opt = dlrm.build(kind, SHAPE)
    dlrm.train_step(model, opt, dlrm.batch(SHAPE, 0, 0))
    client = make_client(server, job_name, capture_rng=False)
    client.save(0, dlrm.state_of(model, opt)).durable.result(30)
    expected = dlrm.snapshot(model, opt)
    lossy = {t.name: t for t in manifest(server, job_name, 0).tensors if t.bits}
    assert sorted(lossy) == TABLES and all(t.rel_l2_error < 0.1 for t in lossy.values())
    model2, opt2 = dlrm.build(kind, SHAPE, seed=1)
    assert client.restore(dlrm.state_of(model2, opt2)) == 0
    got = dlrm.snapshot(model2, opt2)
    for name, value in got.items():
        if name in lossy:
            assert 0 < float((value - expected[name]).norm() / expected[name].norm()) < 0.1
        else:
            assert torch.equal(value, expected[name]), name  # dense layers, optimizer state: exact
    assert np.isfinite(server.metrics.quantization_error.labels(job_name)._value.get())
