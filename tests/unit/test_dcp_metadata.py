"""DCP's checkpoint Metadata as JSON (trainer_client._dcp_metadata): what DCP's planner builds comes
back equal, and stored text that is not what the writer writes is refused, saying what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainer_client._dcp_metadata import Location, MetadataError, decode, encode, item_key


def metadata() -> tuple[Metadata, dict[MetadataIndex, Location]]:
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 8])),
        ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 8])),
    ]
    md = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), torch.Size([5, 8]), chunks
            ),
            "optim.state.w.step": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([]),
                [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
            ),
            "optim.param_groups.0.lr": BytesStorageMetadata(),
        },
        planner_data={
            "model.w": ("model", "w"),
            "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"),
        },
        storage_meta=StorageMeta(checkpoint_id="7", save_id="s", modules=["m"]),
        version="1.0.0",
    )
    where = {
        MetadataIndex("model.w", [0, 0], 0): Location(0, "model.w@0,0", 48),
        MetadataIndex("model.w", [3, 0], 1): Location(1, "model.w@3,0", 32),
        MetadataIndex("optim.state.w.step", []): Location(0, "optim.state.w.step@", 4),
        MetadataIndex("optim.param_groups.0.lr"): Location(1, "optim.param_groups.0.lr", 411),
    }
    return md, where


def test_metadata_comes_back_equal():
    md, where = metadata()
    back, locations = decode(encode(md, where))
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data and back.version == md.version
    assert back.storage_meta == md.storage_meta
    assert locations == where and back.storage_data == where
    assert item_key(MetadataIndex("a.b", [3, 0])) == "a.b@3,0" and item_key(MetadataIndex("x")) == "x"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format="pickle"), "format 'pickle'"),
        (lambda d: d.update(version=2), "version 2 is not supported"),
        (lambda d: d["state_dict_metadata"]["model.w"]["tensor"].update(dtype="os.system"), "unknown dtype"),
        (
            lambda d: d["state_dict_metadata"]["model.w"]["tensor"]["chunks"].append([[4, 0], [3, 8]]),
            "outside",
        ),
        (lambda d: d["storage"].append(["nope", None, None, 0, "k", 1]), "names no item"),
        (lambda d: d["storage"].append(d["storage"][0]), "listed twice"),
        (lambda d: d["planner_data"].update({"model.w": [{"$obj": 1}]}), "list of str and int"),
        (lambda d: d["storage"][0].__setitem__(3, -1), "rank, key and nbytes"),
    ],
)
def test_what_the_writer_does_not_write_is_refused(change, message):
    md, where = metadata()
    doc = json.loads(encode(md, where))
    change(doc)
    with pytest.raises(MetadataError, match=message):
        decode(json.dumps(doc))


def test_what_json_cannot_carry_is_named_at_save():
    md, where = metadata()
    md.planner_data = object()
    with pytest.raises(ValueError, match="planner's data"):
        encode(md, where)
