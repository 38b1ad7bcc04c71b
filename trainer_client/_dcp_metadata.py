"""DCP's checkpoint ``Metadata`` as JSON, and back, without pickle.

A plain DCP directory keeps its ``Metadata`` as a pickle (``.metadata``), which ``dcp.load`` reads
with full pickle: whoever can write the directory can run code in the trainer. A Strata checkpoint
is read from a bucket others may be able to write, so the Metadata travels as tagged-free JSON in
the coordinator's snapshot tree instead, and decoding builds only DCP's own data classes from
validated JSON values (strings, integers, booleans, lists).

Layout (``version`` 1)::

    {"format": "strata.dcp-metadata", "version": 1, "dcp_version": "1.0.0" | null,
     "state_dict_metadata": {fqn: {"tensor": {"dtype": "float32", "requires_grad": false,
                                              "memory_format": "contiguous_format",
                                              "pin_memory": false, "size": [6, 8],
                                              "chunks": [[[0, 0], [3, 8]], ...]}}
                                | {"bytes": {}}},
     "planner_data": {fqn: [path element (str or int), ...]} | null,
     "storage": [[fqn, offset ([int] | null), index (int | null), rank, key, nbytes], ...],
     "storage_meta": {"checkpoint_id": str | null, "save_id": str | null, "load_id": str | null,
                      "modules": [str]} | null}

``storage`` says where each written item lies: the snapshot of ``rank`` at the commit, tensor
``key`` of its ``dcp`` dict (a uint8 tensor for a BYTE_IO item), ``nbytes`` long.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

from trainer_client._staging import dtype_name, torch_dtype

FORMAT = "strata.dcp-metadata"
VERSION = 1

_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_FORMAT_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}


@dataclass(frozen=True)
class Location:
    """Where a written item lies: tensor ``key`` of the ``dcp`` dict of ``rank``'s snapshot."""

    rank: int
    key: str
    nbytes: int


def item_key(index: MetadataIndex) -> str:
    """The name of a written item in its rank's snapshot: the FQN, and the chunk's offsets."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


class MetadataError(ValueError):
    """The stored DCP metadata is not what this version writes; the message says what is wrong."""


# --------------------------------------------------------------------------- encode


def encode(metadata: Metadata, locations: Mapping[MetadataIndex, Location]) -> str:
    """JSON for ``metadata`` with ``locations`` as its storage data; raises ValueError naming
    what JSON cannot carry."""
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"bytes": {}}
        elif isinstance(md, TensorStorageMetadata):
            p = md.properties
            if p.layout != torch.strided:
                raise ValueError(f"{fqn}: only strided tensors can be checkpointed, not {p.layout}")
            if p.memory_format not in _FORMAT_NAMES:
                raise ValueError(f"{fqn}: memory format {p.memory_format} is not supported")
            items[fqn] = {
                "tensor": {
                    "dtype": dtype_name(p.dtype),
                    "requires_grad": bool(p.requires_grad),
                    "memory_format": _FORMAT_NAMES[p.memory_format],
                    "pin_memory": bool(p.pin_memory),
                    "size": [int(d) for d in md.size],
                    "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks],
                }
            }
        else:
            raise ValueError(f"{fqn}: DCP storage metadata of type {type(md).__name__} is not supported")
    planner = metadata.planner_data
    if planner is not None:
        if not isinstance(planner, Mapping):
            raise ValueError(
                f"the planner's data ({type(planner).__name__}) cannot be stored as JSON: Strata "
                "stores the default planner's {fqn: path} mapping"
            )
        out: dict[str, list[str | int]] = {}
        for fqn, path in planner.items():
            if not isinstance(fqn, str) or not isinstance(path, list | tuple):
                raise ValueError(f"planner data for {fqn!r}: expected a path (a tuple), got {path!r}")
            for part in path:
                if type(part) not in (str, int):
                    raise ValueError(f"planner data for {fqn!r}: path element {part!r} is not str or int")
            out[fqn] = list(path)
        planner = out
    storage = [
        [
            index.fqn,
            None if index.offset is None else [int(o) for o in index.offset],
            index.index,
            loc.rank,
            loc.key,
            loc.nbytes,
        ]
        for index, loc in locations.items()
    ]
    meta = metadata.storage_meta
    storage_meta = None
    if meta is not None:
        storage_meta = {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": [str(m) for m in meta.modules],
        }
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": items,
        "planner_data": planner,
        "storage": storage,
        "storage_meta": storage_meta,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


# --------------------------------------------------------------------------- decode


def decode(text: str) -> tuple[Metadata, dict[MetadataIndex, Location]]:
    """The Metadata (its ``storage_data`` the locations) and the locations; raises
    MetadataError saying what is wrong."""
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise MetadataError(f"DCP metadata: not JSON ({exc})") from None
    names = {"format", "version", "dcp_version", "state_dict_metadata", "planner_data", "storage"}
    _keys(doc, names | {"storage_meta"}, "DCP metadata")
    if doc["format"] != FORMAT:
        raise MetadataError(f"DCP metadata: format {doc['format']!r} is not {FORMAT!r}")
    if doc["version"] != VERSION or type(doc["version"]) is not int:
        raise MetadataError(f"DCP metadata: version {doc['version']!r} is not supported (expected {VERSION})")
    items = doc["state_dict_metadata"]
    if not isinstance(items, dict):
        raise MetadataError("DCP metadata: state_dict_metadata must be an object")
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, node in items.items():
        state_dict_metadata[fqn] = _item(fqn, node)
    planner = doc["planner_data"]
    planner_data: dict[str, tuple[str | int, ...]] | None = None
    if planner is not None:
        if not isinstance(planner, dict):
            raise MetadataError("DCP metadata: planner_data must be an object or null")
        planner_data = {}
        for fqn, path in planner.items():
            if not isinstance(path, list) or any(type(p) not in (str, int) for p in path):
                raise MetadataError(f"DCP metadata: planner_data[{fqn!r}] must be a list of str and int")
            planner_data[fqn] = tuple(path)
    locations = _locations(doc["storage"], state_dict_metadata)
    storage_meta = _storage_meta(doc["storage_meta"])
    version = doc["dcp_version"]
    if version is not None and not isinstance(version, str):
        raise MetadataError("DCP metadata: dcp_version must be a string or null")
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_data=dict(locations),
        storage_meta=storage_meta,
        version=version,
    )
    return metadata, locations


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _keys(node: Any, names: set[str], where: str) -> None:
    if not isinstance(node, dict) or set(node) != names:
        got = sorted(node) if isinstance(node, dict) else type(node).__name__
        raise MetadataError(f"{where}: expected an object with keys {sorted(names)}, got {got}")


def _ints(x: Any, where: str, minimum: int = 0) -> list[int]:
    if not isinstance(x, list) or any(type(v) is not int or v < minimum for v in x):
        raise MetadataError(f"{where}: expected a list of integers >= {minimum}, got {x!r}")
    return x


def _item(fqn: str, node: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    where = f"DCP metadata of {fqn!r}"
    if isinstance(node, dict) and set(node) == {"bytes"} and node["bytes"] == {}:
        return BytesStorageMetadata()
    if not isinstance(node, dict) or set(node) != {"tensor"}:
        raise MetadataError(f"{where}: expected {{'tensor': ...}} or {{'bytes': {{}}}}")
    t = node["tensor"]
    _keys(t, {"dtype", "requires_grad", "memory_format", "pin_memory", "size", "chunks"}, where)
    try:
        dtype = torch_dtype(t["dtype"]) if isinstance(t["dtype"], str) else None
    except (KeyError, ValueError, TypeError):
        dtype = None
    if dtype is None:
        raise MetadataError(f"{where}: unknown dtype {t['dtype']!r}")
    if not isinstance(t["memory_format"], str) or t["memory_format"] not in _MEMORY_FORMATS:
        raise MetadataError(f"{where}: unknown memory format {t['memory_format']!r}")
    if type(t["requires_grad"]) is not bool or type(t["pin_memory"]) is not bool:
        raise MetadataError(f"{where}: requires_grad and pin_memory must be booleans")
    size = _ints(t["size"], f"{where}: size")
    chunks = []
    if not isinstance(t["chunks"], list):
        raise MetadataError(f"{where}: chunks must be a list")
    for c in t["chunks"]:
        if not isinstance(c, list) or len(c) != 2:
            raise MetadataError(f"{where}: a chunk is [offsets, sizes], got {c!r}")
        offsets, sizes = _ints(c[0], f"{where}: chunk offsets"), _ints(c[1], f"{where}: chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise MetadataError(f"{where}: chunk {c!r} does not have the tensor's {len(size)} dimensions")
        if any(o + n > d for o, n, d in zip(offsets, sizes, size, strict=True)):
            raise MetadataError(f"{where}: chunk {c!r} lies outside the tensor's size {size}")
        chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    properties = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=t["requires_grad"],
        memory_format=_MEMORY_FORMATS[t["memory_format"]],
        pin_memory=t["pin_memory"],
    )
    return TensorStorageMetadata(properties, torch.Size(size), chunks)


def _locations(
    storage: Any, items: dict[str, TensorStorageMetadata | BytesStorageMetadata]
) -> dict[MetadataIndex, Location]:
    if not isinstance(storage, list):
        raise MetadataError("DCP metadata: storage must be a list")
    out: dict[MetadataIndex, Location] = {}
    for entry in storage:
        if not isinstance(entry, list) or len(entry) != 6:
            raise MetadataError(
                f"DCP metadata: a storage entry is [fqn, offset, index, rank, key, nbytes], got {entry!r}"
            )
        fqn, offset, index, rank, key, nbytes = entry
        where = f"DCP metadata: storage of {fqn!r}"
        if not isinstance(fqn, str) or fqn not in items:
            raise MetadataError(f"{where}: names no item of the checkpoint")
        if offset is not None:
            offset = _ints(offset, f"{where}: offset")
        if index is not None and (type(index) is not int or index < 0):
            raise MetadataError(f"{where}: index must be a non-negative integer or null")
        if type(rank) is not int or rank < 0 or not isinstance(key, str) or type(nbytes) is not int:
            raise MetadataError(f"{where}: rank, key and nbytes must be int, str and int")
        if not 0 <= nbytes < 1 << 62:
            raise MetadataError(f"{where}: nbytes {nbytes} is out of range")
        mi = MetadataIndex(fqn, offset, index)
        if mi in out:
            raise MetadataError(f"{where}: listed twice (offset {offset})")
        out[mi] = Location(rank, key, nbytes)
    return out


def _storage_meta(node: Any) -> StorageMeta | None:
    if node is None:
        return None
    _keys(node, {"checkpoint_id", "save_id", "load_id", "modules"}, "DCP metadata: storage_meta")
    for name in ("checkpoint_id", "save_id", "load_id"):
        if node[name] is not None and not isinstance(node[name], str):
            raise MetadataError(f"DCP metadata: storage_meta.{name} must be a string or null")
    modules = node["modules"]
    if not isinstance(modules, list) or any(not isinstance(m, str) for m in modules):
        raise MetadataError("DCP metadata: storage_meta.modules must be a list of strings")
    return StorageMeta(node["checkpoint_id"], node["save_id"], node["load_id"], list(modules))
