"""Take a plain DCP checkpoint (a directory ``dcp.save`` wrote with ``FileSystemWriter``) into a
job's storage as a committed Strata step, which ``StrataReader`` loads on any number of ranks.

``strata import`` (the torch-free CLI) starts a sidecar for the job's storage in its own process and
runs this module with torch::

    python -m trainer_client.import_dcp DIR --step N   # STRATA_SOCKET, STRATA_JOB, ... from env

Nothing in ``DIR`` is trusted: whoever hands over the directory must not be able to run code here.

- ``.metadata`` (DCP's pickle) is read with an unpickler that resolves only DCP's metadata
  classes, ``torch.Size``, dtypes, the layout and memory-format encodings, ``_StorageInfo`` and
  ``pathlib`` paths (a ``StorageMeta.checkpoint_id``); any other global is refused, named. What it
  builds is then checked field by field (and carried on as Strata's JSON metadata, never pickle).
- each tensor item is read with ``torch.load(weights_only=True)`` and must have the dtype and the
  chunk size the metadata gives; each BYTE_IO item (DCP's ``torch.save`` of a plain value) must
  load with ``torch.load(weights_only=True)`` too, and is kept as DCP's bytes (``StrataReader``
  checks it again when loading).
- storage paths must name files inside ``DIR``; compressed items (transform descriptors) are refused.

The step is saved as **one rank** (world size 1): every chunk DCP wrote stays a chunk, under rank
0, and DCP's planner reshards from them when it loads the step on any number of ranks (the first
checkpoint after that load is a full one). Memory: the whole checkpoint is staged once, here and in
the sidecar.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import pathlib
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from sidecar.api import progress
from trainer_client._dcp_metadata import Location, encode, item_key
from trainer_client.dcp import ITEMS_KEY, METADATA_KEY

log = logging.getLogger("strata.import")


class DCPImportError(ValueError):
    """The directory is not a DCP checkpoint this importer takes; the message says why."""


_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n) for n in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # a path's parts, nothing of the filesystem
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and the few torch and pathlib values they hold; refuses
    every other global (what a pickle would call to run code)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise DCPImportError(
            f".metadata refers to {module}.{name}, which is not part of DCP's metadata: refused "
            "(a DCP .metadata is a pickle; only DCP's own classes and torch sizes, dtypes and "
            "layouts are allowed)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise DCPImportError(".metadata holds a persistent reference: not DCP's metadata")


def read_metadata(directory: Path) -> Metadata:
    """DCP's ``.metadata`` of ``directory``, read without running code from it."""
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except DCPImportError:
        raise
    except OSError as exc:
        raise DCPImportError(f"{directory} is not a DCP checkpoint: {exc}") from None
    except Exception as exc:  # a malformed pickle: any of pickle's many errors
        raise DCPImportError(f"{path}: not DCP's metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise DCPImportError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise DCPImportError(f"{path}: its state_dict_metadata and storage_data must be mappings")
    return metadata


def _storage(directory: Path, index: Any, info: Any) -> tuple[Path, int, int]:
    if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
        raise DCPImportError(f"storage entry {index!r}: not a MetadataIndex -> _StorageInfo")
    if getattr(info, "transform_descriptors", None):
        raise DCPImportError(
            f"{index.fqn}: stored with transforms {list(info.transform_descriptors or ())} "
            "(compression): not supported; save without extensions"
        )
    rel = info.relative_path
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise DCPImportError(f"{index.fqn}: storage path {rel!r} does not name a file inside the checkpoint")
    if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
        raise DCPImportError(f"{index.fqn}: offset and length must be non-negative integers")
    return directory / rel, info.offset, info.length


def _chunk_size(md: TensorStorageMetadata, index: MetadataIndex) -> torch.Size:
    offset = tuple(index.offset) if index.offset is not None else (0,) * len(md.size)
    for chunk in md.chunks:
        if tuple(chunk.offsets) == offset:
            return torch.Size(chunk.sizes)
    raise DCPImportError(f"{index.fqn}: no chunk of the metadata starts at {list(offset)}")


def read_items(directory: Path, metadata: Metadata, show: bool = False) -> dict[str, torch.Tensor]:
    """Every stored item as a tensor (BYTE_IO items as uint8 tensors of DCP's bytes), by its
    Strata item key; checked against the metadata. ``show``: a progress bar on stderr."""
    items: dict[str, torch.Tensor] = {}
    handles: dict[Path, Any] = {}
    total = sum(getattr(info, "length", 0) or 0 for info in metadata.storage_data.values())
    with contextlib.ExitStack() as files:
        shown = files.enter_context(progress.bar(total, "import: read", force=show))
        for index, info in metadata.storage_data.items():
            path, offset, length = _storage(directory, index, info)
            shown.update(length)
            md = metadata.state_dict_metadata.get(index.fqn)
            if md is None:
                raise DCPImportError(f"{index.fqn}: stored, but not in the metadata")
            f = handles.get(path)
            if f is None:
                try:
                    f = handles[path] = files.enter_context(open(path, "rb"))
                except OSError as exc:
                    raise DCPImportError(f"{index.fqn}: {exc}") from None
            f.seek(offset)
            raw = f.read(length)
            if len(raw) != length:
                raise DCPImportError(f"{index.fqn}: {path.name} ends before [{offset}, {offset + length})")
            where = f"{index.fqn} ({path.name} at {offset})"
            try:
                value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            except Exception as exc:
                raise DCPImportError(
                    f"{where}: refused: does not load with torch.load(weights_only=True) ({exc})"
                ) from None
            key = item_key(index)
            if key in items:
                raise DCPImportError(f"{index.fqn}: stored twice at offset {index.offset}")
            if isinstance(md, BytesStorageMetadata):
                items[key] = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise DCPImportError(f"{index.fqn}: metadata of type {type(md).__name__} is not supported")
            if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
                raise DCPImportError(f"{where}: a tensor item holds a {type(value).__name__}")
            size = _chunk_size(md, index)
            if value.dtype != md.properties.dtype or value.size() != size:
                raise DCPImportError(
                    f"{where}: {value.dtype}{list(value.size())} stored, the metadata says "
                    f"{md.properties.dtype}{list(size)}"
                )
            items[key] = value.contiguous()
    return items


def import_dir(directory: Path, step: int, client: Any, show: bool = False) -> int:
    """Save the DCP checkpoint in ``directory`` as step ``step`` through ``client`` (rank 0 of
    world size 1); returns the number of items once the step is committed. ``show``: progress
    on stderr."""
    metadata = read_metadata(directory)
    items = read_items(directory, metadata, show)
    locations = {
        index: Location(
            0, item_key(index), items[item_key(index)].numel() * items[item_key(index)].element_size()
        )
        for index in metadata.storage_data
    }
    for fqn in metadata.state_dict_metadata:
        if not any(index.fqn == fqn for index in locations):
            raise DCPImportError(f"{fqn}: in the metadata, but nothing of it is stored")
    try:
        text = encode(metadata, locations)
    except ValueError as exc:
        raise DCPImportError(f"the metadata cannot be carried: {exc}") from None
    if show:
        print(f"import: saving {len(items)} items as step {step} and waiting for its commit", file=sys.stderr)
    handle = client._save_plain(step, {ITEMS_KEY: items, METADATA_KEY: text})
    if handle.skipped:
        raise DCPImportError(f"step {step}: the save was skipped")
    handle.result(client.settings.commit_timeout_s + 30)
    return len(items)


def main(argv: list[str] | None = None) -> int:
    from trainer_client.client import CheckpointClient  # connects to the sidecar

    parser = argparse.ArgumentParser(prog="python -m trainer_client.import_dcp")
    parser.add_argument("directory")
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--progress", action="store_true", help="progress on stderr, even to a pipe")
    args = parser.parse_args(argv)
    try:
        metadata_dir = Path(args.directory)
        read_metadata(metadata_dir)  # refuse before connecting
        client = CheckpointClient(rank=0, world_size=1, capture_rng=False, resume="never")
        try:
            n = import_dir(metadata_dir, args.step, client, args.progress)
        finally:
            client.close()
    except DCPImportError as exc:
        print(f"import: {exc}", file=sys.stderr)
        return 2
    print(f"imported {n} items as step {args.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
