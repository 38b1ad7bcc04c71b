"""Write a committed Strata step in a format that loads without Strata: a plain DCP directory
(``--format dcp``), a ``torch.save`` file (``--format torch``) or safetensors (``--format
safetensors``), whatever API saved it (``client.save()`` or ``trainer_client.dcp``'s writer).

``strata export`` (the torch-free CLI) reads every rank's snapshot from storage into a staging
directory, then runs this module with torch (``python -m trainer_client.export STAGING OUT
--format F``)::

    STAGING/rank-<r>.bin    the rank's snapshot buffer, as a restore from storage gives it
    STAGING/rank-<r>.json   {"tensors": [{"name", "dtype", "shape", "offset", "nbytes", "bits",
                             "cast", "rel_l2_error"}], "replicas": [{"name", "index", "owner"}],
                             "world_size": N, "tree": ...}

A step saved through DCP keeps DCP's layout: ``--format dcp`` writes what DCP's FileSystemWriter
writes (``__<rank>_0.distcp`` per saving rank, ``.metadata``), and the other formats hold the whole
tensors DCP's planner assembles from it. A step saved with ``client.save()`` is one state per rank:
merged into one when the ranks saved the same state (every tensor replicated across them, every
plain value equal; the RNG states are rank 0's), else one output per rank (``rank-<r>``). Lossy
tensors (quantized or downcast at save) are written as a restore from storage gives them, and named.

A plain DCP directory and a ``torch.save`` file holding more than tensors are read with pickle:
hand them only to those who may run code where they are loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from sidecar.api import DCP_METADATA_KEY, RNG_STATE_KEY
from trainer_client import _tree
from trainer_client._dcp_metadata import Location, decode
from trainer_client._staging import torch_dtype

ITEMS_KEY = "dcp"
FORMATS = ("dcp", "torch", "safetensors")


class ExportError(ValueError):
    pass


def _info(staging: Path, rank: int) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads((staging / f"rank-{rank}.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"rank {rank}: the staged snapshot is unreadable ({exc})") from None
    return info


def _read(staging: Path, rank: int, entry: dict[str, Any]) -> torch.Tensor:
    """One tensor of a rank's snapshot, in a storage of its own (``torch.save`` writes a view's
    whole storage, and safetensors refuses tensors that share one)."""
    t = torch.empty(tuple(entry["shape"]), dtype=torch_dtype(entry["dtype"]))
    if t.numel() * t.element_size() != entry["nbytes"]:
        raise ExportError(f"rank {rank}: {entry['name']} is {entry['nbytes']} bytes, not its shape's")
    if entry["nbytes"]:
        with open(staging / f"rank-{rank}.bin", "rb") as f:
            f.seek(entry["offset"])
            into: Any = t.reshape(-1).view(torch.uint8).numpy()  # the tensor's bytes, written in place
            if f.readinto(into) != entry["nbytes"]:
                raise ExportError(f"rank {rank}: {entry['name']} lies outside its snapshot")
    return t


def _flat(staging: Path, rank: int, infos: dict[int, dict[str, Any]]) -> list[torch.Tensor]:
    """The rank's flat tensor list as its tree refers to it: its own tensors, and the replicated
    ones another rank saved at their positions (read from that rank's snapshot)."""
    info = infos[rank]
    foreign = {r["index"]: r for r in info.get("replicas", []) if r["owner"] != rank}
    mine: Iterator[dict[str, Any]] = iter(info["tensors"])
    out = []
    for i in range(len(info["tensors"]) + len(foreign)):
        if i in foreign:
            owner = foreign[i]["owner"]
            if owner not in infos:
                infos[owner] = _info(staging, owner)
            held = [t for t in infos[owner]["tensors"] if t["name"] == foreign[i]["name"]]
            if not held:
                raise ExportError(
                    f"rank {rank}: {foreign[i]['name']} is not in the snapshot of its owner {owner}"
                )
            out.append(_read(staging, owner, held[0]))
        else:
            out.append(_read(staging, rank, next(mine)))
    return out


def _state(staging: Path, rank: int, infos: dict[int, dict[str, Any]]) -> dict[str, Any]:
    skeleton = _tree.decode_skeleton(json.dumps(infos[rank]["tree"]).encode())
    return _tree.rebuild(skeleton, _flat(staging, rank, infos))


def _mergeable(infos: dict[int, dict[str, Any]]) -> bool:
    """The ranks saved the same state: every tensor of every rank is replicated across all of them
    (one owner each, as every rank declared) and the trees, RNG states aside, are equal."""
    world = len(infos)
    if world == 1:
        return True
    owners = [{r["name"]: r["owner"] for r in info.get("replicas", [])} for info in infos.values()]
    if any(o != owners[0] for o in owners):
        return False
    for rank, info in infos.items():
        mine = {t["name"] for t in info["tensors"] if not t["name"].startswith(RNG_STATE_KEY + ".")}
        foreign = [r for r in info.get("replicas", []) if r["owner"] != rank]
        if not mine <= set(owners[0]) or len(mine | {r["name"] for r in foreign}) != len(owners[0]):
            return False
    # tensors are referred to by position: equal skeletons are the same layout and plain values
    trees = [
        json.dumps({k: v for k, v in i["tree"]["root"].items() if k != RNG_STATE_KEY}) for i in infos.values()
    ]
    return all(t == trees[0] for t in trees)


def _lossy(infos: dict[int, dict[str, Any]]) -> list[str]:
    """The tensors stored lossy, each once: "name (4 bits, rel. L2 error 1.2e-02)"."""
    seen: dict[str, str] = {}
    for info in infos.values():
        for t in info["tensors"]:
            if t.get("bits") or t.get("cast"):
                how = f"{t['bits']} bits" if t.get("bits") else f"cast to {t['cast']}"
                if t.get("rel_l2_error") is not None:
                    how += f", rel. L2 error {t['rel_l2_error']:.1e}"
                seen.setdefault(t["name"], f"{t['name']} ({how})")
    return sorted(seen.values())


# --------------------------------------------------------------------------- a DCP step


def _items(staging: Path, rank: int, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    value = _state(staging, rank, {rank: info})
    items = value.get(ITEMS_KEY) if isinstance(value, dict) else None
    if not isinstance(items, dict):
        raise ExportError(f"rank {rank} was not saved through torch.distributed.checkpoint")
    return items


def _dcp_metadata(info: dict[str, Any]) -> str | None:
    root = info.get("tree", {}).get("root")
    text = root.get(DCP_METADATA_KEY) if isinstance(root, dict) else None
    return text if isinstance(text, str) else None


def to_dcp(staging: Path, out: Path) -> int:
    """Convert the staged snapshots of a step saved through DCP into a DCP directory ``out``;
    returns the number of items."""
    info0 = _info(staging, 0)
    text = _dcp_metadata(info0)
    if text is None:
        raise ExportError(
            "this step was not saved through torch.distributed.checkpoint: it has no DCP metadata"
        )
    metadata, locations = decode(text)
    by_rank: dict[int, list[tuple[MetadataIndex, Location]]] = {}
    for index, loc in locations.items():
        by_rank.setdefault(loc.rank, []).append((index, loc))
    out.mkdir(parents=True, exist_ok=True)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rank in sorted(by_rank):
        items = _items(staging, rank, info0 if rank == 0 else _info(staging, rank))
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
                    torch.save(t, f)
                storage[index] = _StorageInfo(name, offset, f.tell() - offset)
            f.flush()
            os.fsync(f.fileno())
        del items
    metadata.storage_data = storage
    tmp = out / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out / ".metadata")  # last: the directory is a checkpoint once it exists
    return len(storage)


def _dcp_state(directory: Path) -> dict[str, Any]:
    """The whole state a DCP directory holds, its tensors assembled from their chunks (what
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` writes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


# --------------------------------------------------------------------------- writers


def _write_dcp(state: dict[str, Any], out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(out), no_dist=True)


def _write_torch(state: dict[str, Any], path: Path) -> str:
    """``torch.save`` the state; returns how to load it."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    if not unsafe:
        return "torch.load(path, weights_only=True)"
    return f"torch.load(path, weights_only=False) (it holds {', '.join(sorted(unsafe))})"


def flatten(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts, lists and tuples under dotted names, as DCP names them
    ("optim.state.0.exp_avg"); an empty container is a leaf."""
    items = (
        list(state.items())
        if isinstance(state, dict)
        else list(enumerate(state))
        if isinstance(state, (list, tuple))
        else None
    )
    if not items:
        yield prefix, state
        return
    for k, v in items:
        yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))


def _has_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def _split(value: Any, name: str, tensors: dict[str, torch.Tensor], others: list[str]) -> None:
    """The tensors under their dotted names; in ``others``, the names of the outermost values that
    hold no tensor (``optim.param_groups``, not each of its fields)."""
    if not _has_tensor(value):
        others.append(name or "(the whole state)")
    elif isinstance(value, torch.Tensor):
        if name in tensors:
            raise ExportError(
                f"--format safetensors: two tensors are both named {name!r}. Use --format torch"
            )
        tensors[name] = value
    else:
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            _split(v, f"{name}.{k}" if name else str(k), tensors, others)


def _write_safetensors(state: dict[str, Any], path: Path) -> list[str]:
    """Save the state's tensors under their dotted names; returns what was left out. Refuses a
    state holding anything but tensors, naming those keys."""
    from safetensors.torch import save_file

    dropped = []
    if RNG_STATE_KEY in state:  # the streams the client captured: not the trainer's state
        state = {k: v for k, v in state.items() if k != RNG_STATE_KEY}
        dropped.append(f"the RNG states ({RNG_STATE_KEY})")
    tensors: dict[str, torch.Tensor] = {}
    others: list[str] = []
    _split(state, "", tensors, others)
    if others:
        shown = ", ".join(sorted(others)[:8]) + (f" and {len(others) - 8} more" if len(others) > 8 else "")
        raise ExportError(
            f"--format safetensors holds tensors only; not tensors: {shown}. Use --format torch"
        )
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    return dropped


def _write(fmt: str, state: dict[str, Any], target: Path) -> str:
    """Write one state to ``target`` in ``fmt``; returns a line saying what was written."""
    if fmt == "dcp":
        _write_dcp(state, target)
        return f"{target}: torch.distributed.checkpoint.load(state, storage_reader=FileSystemReader(path))"
    if fmt == "torch":
        return f"{target}: {_write_torch(state, target)}"
    dropped = _write_safetensors(state, target)
    return f"{target}: safetensors.torch.load_file(path)" + (
        f" (left out: {', '.join(dropped)})" if dropped else ""
    )


_SUFFIX = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}


def export(staging: Path, out: Path, fmt: str) -> list[str]:
    """Write the staged step into ``out`` in ``fmt``; returns the lines to print."""
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out.mkdir(parents=True, exist_ok=True)
    info0 = _info(staging, 0)
    world = int(info0.get("world_size", 1))
    if _dcp_metadata(info0) is not None:
        if fmt == "dcp":
            n = to_dcp(staging, out)
            return [
                f"saved through torch.distributed.checkpoint on {world} ranks: {n} items in DCP's own layout"
            ]
        with tempfile.TemporaryDirectory(dir=staging) as tmp:
            to_dcp(staging, Path(tmp))
            state = _dcp_state(Path(tmp))
        return [
            f"saved through torch.distributed.checkpoint on {world} ranks: merged into whole tensors",
            _write(fmt, state, out / f"state{_SUFFIX[fmt]}"),
        ]
    infos = {0: info0, **{r: _info(staging, r) for r in range(1, world)}}
    lossy = _lossy(infos)
    lines = []
    if _mergeable(infos):
        lines.append(
            "one state"
            if world == 1
            else f"{world} ranks saved the same state (replicated): merged into one, with rank 0's RNG states"
        )
        lines.append(
            _write(fmt, _state(staging, 0, infos), out if fmt == "dcp" else out / f"state{_SUFFIX[fmt]}")
        )
    else:
        lines.append(f"{world} ranks saved different states: one output per rank (rank-<r>)")
        for rank in range(world):
            lines.append(_write(fmt, _state(staging, rank, infos), out / f"rank-{rank}{_SUFFIX[fmt]}"))
    if lossy:
        lines.append(
            f"{len(lossy)} tensors were stored lossy and are exported as restored from storage, not as "
            f"trained: {', '.join(lossy)}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_client.export")
    parser.add_argument("staging", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=FORMATS, default="dcp")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        lines = export(args.staging, args.out, args.format)
    except ValueError as exc:  # ExportError, and a damaged tree's ValueError
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
