"""trainer_client.import_dcp reads a plain DCP directory without running code from it: .metadata
through an unpickler that resolves only DCP's metadata classes (a pickle calling os.system is
refused, naming the global, and never runs), items through torch.load(weights_only=True), storage
paths inside the directory, and every item checked against the metadata."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo

from trainer_client._dcp_metadata import decode
from trainer_client.import_dcp import DCPImportError, read_items, read_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, one process


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    state = {"w": torch.arange(12.0).reshape(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "lr": 0.1}
    dcp.save(state, storage_writer=FileSystemWriter(directory), no_dist=True)
    return directory


def test_reads_what_dcp_wrote(saved: Path) -> None:
    metadata = read_metadata(saved)
    items = read_items(saved, metadata)
    assert torch.equal(items["w@0,0"], torch.arange(12.0).reshape(3, 4))
    assert items["h@0"].dtype == torch.bfloat16
    assert torch.load(io.BytesIO(items["lr"].numpy().tobytes()), weights_only=True) == 0.1


class Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_metadata_pickle_that_runs_code_is_refused(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (saved / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    with pytest.raises(
        DCPImportError, match=r"refers to (posix|os)\.system, which is not part of DCP's metadata"
    ):
        read_metadata(saved)
    assert not marker.exists()
    # hidden inside real metadata, too
    metadata = read_metadata_plain(saved.parent / "again")
    metadata.planner_data = {"w": Boom(marker)}
    (saved / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DCPImportError, match=r"system"):
        read_metadata(saved)
    assert not marker.exists()


def read_metadata_plain(directory: Path) -> object:
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(directory), no_dist=True)
    return read_metadata(directory)


def test_storage_paths_outside_the_directory_are_refused(saved: Path) -> None:
    metadata = read_metadata(saved)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    with pytest.raises(DCPImportError, match="does not name a file inside the checkpoint"):
        read_items(saved, metadata)


def test_an_item_unlike_its_metadata_is_refused(saved: Path) -> None:
    metadata = read_metadata(saved)
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    info = metadata.storage_data[index]
    blob = (saved / info.relative_path).read_bytes()
    other = io.BytesIO()
    torch.save(torch.zeros(3, 4, dtype=torch.float64), other)
    (saved / "x.distcp").write_bytes(blob + other.getvalue())
    metadata.storage_data[index] = _StorageInfo("x.distcp", len(blob), len(other.getvalue()))
    with pytest.raises(
        DCPImportError, match=r"w .*torch.float64\[3, 4\] stored, the metadata says torch.float32"
    ):
        read_items(saved, metadata)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DCPImportError, match="is not a DCP checkpoint"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(DCPImportError, match="holds a dict, not DCP's Metadata"):
        read_metadata(tmp_path)


def test_the_imported_metadata_is_strata_json(saved: Path) -> None:
    from trainer_client._dcp_metadata import Location, encode, item_key

    metadata = read_metadata(saved)
    items = read_items(saved, metadata)
    text = encode(
        metadata, {i: Location(0, item_key(i), items[item_key(i)].nbytes) for i in metadata.storage_data}
    )
    back, locations = decode(text)
    assert set(back.state_dict_metadata) == {"w", "h", "lr"}
    assert {loc.rank for loc in locations.values()} == {0}
