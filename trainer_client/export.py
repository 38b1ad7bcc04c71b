"""Write a Strata checkpoint saved through torch.distributed.checkpoint as a plain DCP directory,
which ``dcp.load(..., storage_reader=FileSystemReader(dir))`` reads without Strata installed.

``strata export --format dcp`` (the torch-free CLI) reads every rank's snapshot from storage into a
staging directory, then runs this module with torch (``python -m trainer_client.export STAGING
OUT``)::

    STAGING/rank-<r>.bin    the rank's snapshot buffer, as a restore would give it
    STAGING/rank-<r>.json   {"tensors": [{"name", "dtype", "shape", "offset", "nbytes"}], "tree": ...}

The output is what DCP's FileSystemWriter writes: ``__<rank>_0.distcp`` per saving rank, each item
``torch.save``-d (BYTE_IO items as DCP's own bytes), and ``.metadata``, a pickle of DCP's
``Metadata`` whose storage data are FileSystemReader's ``_StorageInfo`` records. (A plain DCP
directory is read with full pickle: hand it only to those who may run code where it is loaded.)
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from sidecar.api import DCP_METADATA_KEY
from trainer_client import _tree
from trainer_client._dcp_metadata import Location, decode
from trainer_client._staging import torch_dtype

ITEMS_KEY = "dcp"


class ExportError(ValueError):
    pass


def _rank(staging: Path, rank: int) -> tuple[dict[str, Any], bytearray]:
    try:
        info = json.loads((staging / f"rank-{rank}.json").read_text())
        data = bytearray((staging / f"rank-{rank}.bin").read_bytes())
    except (OSError, ValueError) as exc:
        raise ExportError(f"rank {rank}: the staged snapshot is unreadable ({exc})") from None
    return info, data


def _items(info: dict[str, Any], data: bytearray, rank: int) -> dict[str, torch.Tensor]:
    tensors = []
    for t in info["tensors"]:
        dtype, shape = torch_dtype(t["dtype"]), tuple(t["shape"])
        if t["offset"] + t["nbytes"] > len(data):
            raise ExportError(f"rank {rank}: {t['name']} lies outside its snapshot")
        raw = (
            torch.frombuffer(data, dtype=torch.uint8, count=t["nbytes"], offset=t["offset"])
            if t["nbytes"]
            else None
        )
        tensors.append(torch.empty(shape, dtype=dtype) if raw is None else raw.view(dtype).reshape(shape))
    skeleton = _tree.decode_skeleton(json.dumps(info["tree"]).encode())
    value = _tree.rebuild(skeleton, tensors)
    items = value.get(ITEMS_KEY) if isinstance(value, dict) else None
    if not isinstance(items, dict):
        raise ExportError(f"rank {rank} was not saved through torch.distributed.checkpoint")
    return items


def to_dcp(staging: Path, out: Path) -> int:
    """Convert the staged snapshots into a DCP directory ``out``; returns the number of items."""
    info0, data0 = _rank(staging, 0)
    root = info0.get("tree", {}).get("root")
    text = root.get(DCP_METADATA_KEY) if isinstance(root, dict) else None
    if not isinstance(text, str):
        raise ExportError(
            "this checkpoint was not saved through torch.distributed.checkpoint (trainer_client.dcp's "
            "StrataWriter): --format dcp has no metadata to write"
        )
    metadata, locations = decode(text)
    by_rank: dict[int, list[tuple[MetadataIndex, Location]]] = {}
    for index, loc in locations.items():
        by_rank.setdefault(loc.rank, []).append((index, loc))
    out.mkdir(parents=True, exist_ok=True)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rank in sorted(by_rank):
        info, data = (info0, data0) if rank == 0 else _rank(staging, rank)
        items = _items(info, data, rank)
        name = f"__{rank}_0.distcp"
        with open(out / name, "wb") as f:
            for index, loc in by_rank[rank]:
                t = items.get(loc.key)
                if t is None or t.numel() * t.element_size() != loc.nbytes:
                    raise ExportError(f"rank {rank}: {index.fqn} is not in its snapshot as recorded")
                offset = f.tell()
                if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                    f.write(t.numpy().tobytes())
                else:
                    torch.save(t.clone(), f)  # a clone: torch.save writes a view's whole storage
                storage[index] = _StorageInfo(name, offset, f.tell() - offset)
            f.flush()
            os.fsync(f.fileno())
        del items, data
    metadata.storage_data = storage
    tmp = out / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out / ".metadata")  # last: the directory is a checkpoint once it exists
    return len(storage)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m trainer_client.export STAGING OUT", file=sys.stderr)
        return 2
    try:
        n = to_dcp(Path(args[0]), Path(args[1]))
    except (ExportError, ValueError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} items to {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
