"""Changed-row tracking and embedding roles on TorchRec tables: an EmbeddingBagCollection under
torchrec's CombinedOptimizer / KeyedOptimizerWrapper or an in-backward optimizer, and a
FusedEmbeddingBagCollection (fbgemm's TBE and its own SGD or row-wise Adagrad). The bitmaps
must cover every row training changed, tables and optimizer-state rows alike."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from trainer_client import _tree
from trainer_client._state import roles
from trainer_client._tracking import RowTracker

pytestmark = [
    pytest.mark.torchrec,
    # fbgemm-gpu-cpu warns, on import, of GPU-only lookups it lacks; in-backward is deprecated
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

with warnings.catch_warnings():  # collection imports it before the marks apply
    warnings.simplefilter("ignore", DeprecationWarning)
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from tests.fixtures import dlrm

SHAPE = dlrm.Shape(rows=500, dim=8, batch=16)
TABLES = [f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}" for i in range(SHAPE.tables)]


def rows_changed(before: torch.Tensor, after: torch.Tensor) -> np.ndarray:
    return (before != after).reshape(before.shape[0], -1).any(1).numpy()


#: setup -> (the fixture's kind, its options)
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("plain", {}),  # EBC; CombinedOptimizer over KeyedOptimizerWrappers, Adagrad on tables
    "plain_sgd": ("plain", {"table_optimizer": torch.optim.SGD}),
    "fused": ("fused", {}),  # FusedEBC: fbgemm's exact SGD
    "fused_adagrad": ("fused", {"fused_optimizer": torch.optim.Adagrad}),
    "fused_rowwise": ("fused", {"fused_optimizer": RowWiseAdagrad}),
    "in_backward": ("in_backward", {}),  # EBC; SGD applied in backward
}


def build(setup: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    kind, options = SETUPS[setup]
    return dlrm.build(kind, SHAPE, **options)


@pytest.mark.parametrize("setup", SETUPS)
def test_every_torchrec_setup_tracks_exactly_the_rows_training_changed(setup):
    model, opt = build(setup)
    tracker = RowTracker()
    assert tracker.track([model], opt) == TABLES
    tracker.committed()  # as after a committed save: the bitmaps count from here
    state = dlrm.state_of(model, opt)
    before = dlrm.snapshot(model, opt)
    for i in range(3):
        dlrm.train_step(model, opt, dlrm.batch(SHAPE, 0, i))
    flat = _tree.flatten(state)
    bitmaps = tracker.cut(flat.tensors)
    checked = []
    for i, (name, t) in enumerate(flat.tensors):
        if t.dim() == 0 or t.shape[0] != SHAPE.rows:
            continue
        changed = rows_changed(before[name], t)
        assert i in bitmaps, f"{name} is not tracked"
        marked = np.unpackbits(np.frombuffer(bitmaps[i], np.uint8), count=SHAPE.rows, bitorder="little")
        assert changed.any() and np.array_equal(marked.astype(bool), changed), name
        checked.append(name)
    tables = [n for n in checked if n.startswith("model.")]
    states = [n for n in checked if n.startswith("optimizer.")]
    assert len(tables) == SHAPE.tables
    # Adagrad's sums and row-wise Adagrad's momentum travel with their rows; SGD keeps none
    stateful = setup in ("plain", "fused_rowwise", "fused_adagrad")
    assert len(states) == (SHAPE.tables if stateful else 0), checked
    tracker.close()


def test_an_embedding_bag_collection_called_by_keyword_is_tracked_under_a_torch_optimizer():
    """EmbeddingBagCollection calls its nn.EmbeddingBag tables by keyword (input=, offsets=)."""
    model, _ = dlrm.build("plain", SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = RowTracker()
    assert tracker.track([model], opt) == TABLES
    dense, kjt, labels = dlrm.batch(SHAPE, 0, 0)
    dlrm.train_step(model, opt, (dense, kjt, labels))  # the first forward used to fail here
    tracker.committed()
    weight = model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight
    bitmap = tracker.cut([("t0", weight)])[0]
    marked = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=SHAPE.rows, bitorder="little")
    assert np.flatnonzero(marked).tolist() == sorted(set(kjt["f0"].values().tolist()))


def test_tracking_nothing_warns_naming_the_module(caplog):
    with caplog.at_level(logging.WARNING, "strata.client"):
        assert RowTracker().track([nn.Linear(4, 4)], torch.optim.SGD(nn.Linear(4, 4).parameters())) == []
    assert "track(Linear): no table to track" in caplog.text


def test_tables_the_optimizer_does_not_own_are_not_tracked_and_warned(caplog):
    model, _ = dlrm.build("plain", SHAPE)
    dense_only = torch.optim.SGD([p for n, p in model.named_parameters() if "sparse" not in n], lr=0.1)
    with caplog.at_level(logging.WARNING, "strata.client"):
        assert RowTracker().track([model], dense_only) == []
    assert "the optimizer given does not own this table" in caplog.text and "track(DLRM)" in caplog.text


def test_fused_tables_count_ids_per_feature_and_batch():
    """Two features share a table; the TBE sees (indices, offsets) per feature then sample."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=20, feature_names=["f2"]),
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}
    )
    tracker = RowTracker()
    assert tracker.track([ebc]) == ["embedding_bags.a", "embedding_bags.b"]
    tracker.committed()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.tensor([1, 2, 9, 3, 4, 19, 0]),
        lengths=torch.tensor([2, 1, 0, 2, 1, 1], dtype=torch.int32),  # 2 samples per feature
    )
    ebc(kjt)
    weights = ebc.state_dict()
    bitmaps = tracker.cut([(n, weights[n]) for n in ("embedding_bags.a.weight", "embedding_bags.b.weight")])
    a = np.unpackbits(np.frombuffer(bitmaps[0], np.uint8), count=10, bitorder="little")
    b = np.unpackbits(np.frombuffer(bitmaps[1], np.uint8), count=20, bitorder="little")
    assert np.flatnonzero(a).tolist() == [1, 2, 3, 4, 9] and np.flatnonzero(b).tolist() == [0, 19]


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_torchrec_tables_are_marked_as_embeddings_for_quantization(kind):
    model, opt = dlrm.build(kind, SHAPE)
    state = dlrm.state_of(model, opt)
    flat = _tree.flatten(state)
    marked = {name for (name, _), role in zip(flat.tensors, roles(state, flat.tensors), strict=True) if role}
    assert marked == {f"model.{t}.weight" for t in TABLES}


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")  # DMP's own DDP
def test_sharded_tables_are_tracked_from_their_kernels_lookups(tmp_path):
    """DistributedModelParallel on one gloo rank: a table-wise and a row-wise sharded table
    (in-backward Adagrad fused into fbgemm's kernel), found through the sharded collection's
    lookups (its named_modules yields itself alone); the bitmaps cover the local shards."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        ebc = EmbeddingBagCollection(tables=dlrm.configs(SHAPE), device=cpu)
        model = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dlrm.DENSE_IN,
            dense_arch_layer_sizes=[16, SHAPE.dim],
            over_arch_layer_sizes=[16, 1],
        )
        apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})
        per_table = {"t0": table_wise(rank=0), "t1": row_wise()}
        plan = construct_module_sharding_plan(
            ebc, per_param_sharding=per_table, local_size=1, world_size=1, device_type="cpu"
        )
        dmp = DistributedModelParallel(
            model,
            device=cpu,
            plan=ShardingPlan({"sparse_arch.embedding_bag_collection": plan}),
            sharders=[EmbeddingBagCollectionSharder()],  # type: ignore[list-item]
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda ps: torch.optim.Adam(ps, lr=0.01),
        )
        opt = CombinedOptimizer([dmp.fused_optimizer, dense])
        tracker = RowTracker()
        assert tracker.track([dmp], opt) == TABLES
        tracker.committed()
        state = dmp.state_dict()
        shards = [(t, state[f"{t}.weight"].local_shards()[0].tensor) for t in TABLES]
        before = [w.clone() for _, w in shards]
        for i in range(2):
            dlrm.train_step(dmp, opt, dlrm.batch(SHAPE, 0, i))
        bitmaps = tracker.cut(shards)
        for i, (name, weight) in enumerate(shards):
            marked = np.unpackbits(np.frombuffer(bitmaps[i], np.uint8), count=SHAPE.rows, bitorder="little")
            changed = rows_changed(before[i], weight)
            assert changed.any() and np.array_equal(marked.astype(bool), changed), name
    finally:
        dist.destroy_process_group()


def tbe(optimizer: str, rows: tuple[int, ...], features: list[int]) -> nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(n, 4, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows]
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=EmbOptimType[optimizer], learning_rate=0.1, feature_table_map=features
    )


def test_a_variable_batch_per_feature_marks_each_features_ids_in_its_table():
    module = tbe("EXACT_SGD", (10, 20), [0, 1])
    tracker = RowTracker()
    assert len(tracker.track([module])) == 2
    tracker.committed()
    # feature 0: 1 sample (ids 1, 2); feature 1: 3 samples (5 | 6 | 19)
    module(
        torch.tensor([1, 2, 5, 6, 19]),
        torch.tensor([0, 2, 3, 4, 5]),
        batch_size_per_feature_per_rank=[[1], [3]],
    )
    weights = module.split_embedding_weights()
    bitmaps = tracker.cut([("a", weights[0]), ("b", weights[1])])
    found = [
        np.flatnonzero(
            np.unpackbits(np.frombuffer(bitmaps[i], np.uint8), count=n, bitorder="little")
        ).tolist()
        for i, n in ((0, 10), (1, 20))
    ]
    assert found == [[1, 2], [5, 6, 19]]


def test_fbgemm_optimizers_not_known_to_be_sparse_are_left_to_the_comparison(caplog):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    module = tbe("EXACT_SGD", (10,), [0])
    module.optimizer = EmbOptimType.ADAM  # fbgemm runs Adam on GPUs only: its choice is what is read
    with caplog.at_level(logging.WARNING, "strata.client"):
        assert RowTracker().track([module]) == []
    assert "fbgemm's adam optimizer is not known to leave rows without a lookup alone" in caplog.text


@pytest.mark.parametrize("per_feature", [True, False])  # the CPU's way, and an accelerator's
def test_both_ways_of_marking_find_the_ids_of_each_feature(per_feature):
    from trainer_client import _torchrec

    module = tbe("EXACT_SGD", (10, 20), [0, 1, 1])
    seen = torch.zeros(30, dtype=torch.bool)
    hook = _torchrec.marker(module, seen, [0, 10], per_feature=per_feature)
    # 2 samples per feature: f0 {1, 2} {9}; f1 {} {3}; f2 {4, 25 (out of range: row 0)} {7}
    hook(module, (torch.tensor([1, 2, 9, 3, 4, 25, 7]), torch.tensor([0, 2, 3, 3, 4, 6, 7])), {})
    assert torch.nonzero(seen).flatten().tolist() == [1, 2, 9, 10, 13, 14, 17]
    seen.zero_()
    # a variable batch: f0 1 sample, f1 2 samples (over 2 ranks), f2 1 sample
    per_rank = [[1, 0], [1, 1], [0, 1]]
    hook(
        module,
        (torch.tensor([5, 6, 8, 19]), torch.tensor([0, 1, 2, 3, 4])),
        {"batch_size_per_feature_per_rank": per_rank},
    )
    assert torch.nonzero(seen).flatten().tolist() == [5, 16, 18, 29]


def test_tables_tracked_without_an_optimizer_say_which_argument_is_missing(caplog):
    model, _ = dlrm.build("plain", SHAPE)
    with caplog.at_level(logging.WARNING, "strata.client"):
        assert RowTracker().track([model]) == []
    assert "no optimizer steps it: pass the one that does, track(..., optimizer=opt)" in caplog.text
