"""Split a nested training state into a JSON skeleton plus a flat list of tensors, and back.

A checkpoint is read from a bucket that others may be able to write, so plain values never
travel as pickle: they become tagged JSON, and decoding builds only a fixed set of harmless
types (JSON scalars, list, tuple, dict, OrderedDict, bytes, bytearray, float, numpy scalars and
arrays of a few dtypes, torch.dtype/Size/device/Generator, and the tensors handed in). Type
names recorded for Stateful objects are informational and never used to construct anything.

Skeleton layout::

    {"format": "strata.tree", "version": 1, "num_tensors": N, "root": <node>}

A node is a JSON scalar (None, bool, int, str, finite float), a JSON list (a Python list), a
JSON object whose keys are all strings not starting with "$" (a Python dict), or a tagged
object: exactly one key, a tag from ``TAGS``. Every key starting with "$" is reserved for tags,
so a dict holding such a key (or a non-str key) is written in the "$dict" pairs form.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT = "strata.tree"
VERSION = 1

# Canonical torch dtype names ("torch.float32" -> "float32"); quantized tensors are refused
# before their dtype is looked at, so only plain dtypes reach the skeleton.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
# numpy dtypes that torch.from_numpy / Tensor.numpy() map one to one.
_NUMPY_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_UNSUPPORTED_HINT = "give it state_dict()/load_state_dict() or use plain values"

Path = tuple[Any, ...]


class StateError(TypeError, ValueError):
    """The live state cannot be checkpointed or does not match the checkpoint.

    Derives from both TypeError (unsupported object) and ValueError (mismatch) so callers
    catching either see it. Messages start with the path, e.g. ``state['optim']['foo']``.
    """


@dataclass
class Flat:
    """A state split for transport.

    ``skeleton`` is JSON-serializable (``json.dumps(..., allow_nan=False)`` succeeds);
    ``tensors`` lists (unique readable name, tensor) in the order the skeleton refers to them.
    The tensors are detached views of the live ones, not copies: stage them before mutating.
    """

    skeleton: dict[str, Any]
    tensors: list[tuple[str, torch.Tensor]]


def where(path: Path) -> str:
    """Render a path the way a user would index their state: ``state['optim']['state'][0]``."""
    return "state" + "".join(f"[{k!r}]" for k in path)


def is_stateful(obj: object) -> bool:
    """Duck-typed like torch.distributed.checkpoint's Stateful: both methods callable."""
    return (
        not isinstance(obj, type)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


# --------------------------------------------------------------------------- flatten


def flatten(state: Mapping[str, Any]) -> Flat:
    """Split ``state`` into a JSON skeleton and its tensors; raise StateError naming the path
    of anything that cannot be checkpointed."""
    if not isinstance(state, Mapping):
        raise StateError(f"state: expected a mapping, got {type(state).__qualname__}")
    encoder = _Encoder()
    try:
        root = encoder.mapping(state, ())
    except RecursionError:
        raise StateError("state: nested too deeply to checkpoint") from None
    skeleton = {"format": FORMAT, "version": VERSION, "num_tensors": len(encoder.tensors), "root": root}
    return Flat(skeleton, encoder.tensors)


def _encode_float(x: float) -> Any:
    if math.isfinite(x):
        return x  # JSON keeps -0.0 and every finite double exactly (repr round-trips).
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._names: set[str] = set()
        self._active: set[int] = set()  # ids of containers on the current path: refuse cycles

    @contextmanager
    def _enter(self, obj: object, path: Path) -> Iterator[None]:
        if id(obj) in self._active:
            raise StateError(f"{where(path)}: reference cycle; a checkpoint must be a tree")
        self._active.add(id(obj))
        try:
            yield
        finally:
            self._active.discard(id(obj))

    def _leaf(self, t: torch.Tensor, path: Path) -> int:
        name = ".".join(str(k) for k in path)
        if name in self._names:
            n = 2
            while f"{name}#{n}" in self._names:
                n += 1
            name = f"{name}#{n}"
        self._names.add(name)
        self.tensors.append((name, t))
        return len(self.tensors) - 1

    def tensor(self, t: torch.Tensor, path: Path) -> dict[str, Any]:
        # Subclasses (DTensor, UninitializedParameter, ...) carry meaning raw bytes would lose.
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            hint = (
                f" (a {type(t).__name__} is saved through torch.distributed.checkpoint: client.save() "
                "does so for one held as a value, in a module or in an optimizer of the state; "
                "elsewhere use dcp.save with trainer_client.dcp.StrataWriter; client.resume() "
                "loads it back)"
                if type(t).__name__ in ("DTensor", "ShardedTensor")
                else ""
            )
            raise StateError(f"{where(path)}: cannot checkpoint tensor subclass {type(t).__qualname__}{hint}")
        if t.layout != torch.strided:
            raise StateError(f"{where(path)}: cannot checkpoint a {t.layout} tensor; only dense tensors")
        if t.is_quantized:
            raise StateError(f"{where(path)}: cannot checkpoint a quantized tensor")
        if t.is_meta:
            raise StateError(f"{where(path)}: cannot checkpoint a meta tensor (it holds no data)")
        t = t.detach()
        if t.is_conj() or t.is_neg():  # lazy bits raw bytes would not show
            t = t.resolve_conj().resolve_neg()
        index = self._leaf(t, path)
        return {"index": index, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}

    def ndarray(self, a: np.ndarray, path: Path) -> dict[str, Any]:
        name = a.dtype.name
        if name not in _NUMPY_DTYPES:
            raise StateError(f"{where(path)}: cannot checkpoint numpy array of dtype {a.dtype}")
        shape = list(a.shape)
        if not (a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative):
            # from_numpy needs native byte order and warns on read-only memory. np.array, not
            # np.ascontiguousarray, which would turn a 0-d array into 1-d.
            a = np.array(a, dtype=a.dtype.newbyteorder("="), order="C")
        index = self._leaf(torch.from_numpy(a), path)
        return {"index": index, "dtype": name, "shape": shape}

    def value(self, x: Any, path: Path) -> Any:
        if x is None or x is True or x is False:
            return x
        # Before int/float: np.float64 subclasses float and must keep its type.
        if isinstance(x, np.generic) and x.dtype.name in _NUMPY_DTYPES:
            return {"$npscalar": {"dtype": x.dtype.name, "value": _encode_scalar(x.item())}}
        if isinstance(x, int):
            return int(x)  # IntEnum and friends come back as int
        if isinstance(x, float):
            return _encode_float(float(x))
        if isinstance(x, str):
            return x if type(x) is str else str.__str__(x)
        if isinstance(x, torch.Tensor):
            return {"$tensor": self.tensor(x, path)}
        if type(x) is np.ndarray:
            return {"$ndarray": self.ndarray(x, path)}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if isinstance(x, torch.Generator):
            state = {"$tensor": self.tensor(x.get_state(), path)}
            return {"$generator": {"device": str(x.device), "state": state}}
        if isinstance(x, bytes):
            return {"$bytes": base64.b64encode(x).decode("ascii")}
        if isinstance(x, bytearray):
            return {"$bytearray": base64.b64encode(x).decode("ascii")}
        # Stateful before the containers: a module or loader is saved through its state_dict.
        if is_stateful(x):
            with self._enter(x, path):
                inner = self.value(x.state_dict(), path)
            kind = f"{type(x).__module__}.{type(x).__qualname__}"
            return {"$stateful": {"type": kind, "state": inner}}
        if isinstance(x, torch.Size):
            return {"$size": [int(d) for d in x]}
        if isinstance(x, Mapping):
            with self._enter(x, path):
                return self.mapping(x, path)
        if isinstance(x, tuple):
            with self._enter(x, path):
                return {"$tuple": [self.value(v, (*path, i)) for i, v in enumerate(x)]}
        if isinstance(x, list):
            with self._enter(x, path):
                return [self.value(v, (*path, i)) for i, v in enumerate(x)]
        raise StateError(
            f"{where(path)}: cannot checkpoint object of type {type(x).__qualname__}; {_UNSUPPORTED_HINT}"
        )

    def mapping(self, m: Mapping[Any, Any], path: Path) -> Any:
        """Dicts with plain string keys stay JSON objects; others use the pairs form. Other
        Mapping types come back as dict, OrderedDict as OrderedDict."""
        if not isinstance(m, OrderedDict) and all(isinstance(k, str) and not k.startswith("$") for k in m):
            return {str.__str__(k): self.value(v, (*path, k)) for k, v in m.items()}
        pairs = [[self.key(k, path), self.value(v, (*path, k))] for k, v in m.items()]
        return {"$odict" if isinstance(m, OrderedDict) else "$dict": pairs}

    def key(self, k: Any, path: Path) -> Any:
        # Only immutable plain values: decoding must be able to rebuild a hashable key.
        if isinstance(k, tuple) and not isinstance(k, torch.Size):
            return {"$tuple": [self.key(v, path) for v in k]}
        plain = (type(None), bool, int, float, str, bytes, np.generic, torch.dtype, torch.device, torch.Size)
        if isinstance(k, plain):
            return self.value(k, path)
        raise StateError(f"{where(path)}: cannot checkpoint dict key of type {type(k).__qualname__}")


def _encode_scalar(v: Any) -> Any:
    """``np.generic.item()`` gives bool, int, float or complex; the dtype travels beside it."""
    if isinstance(v, complex):
        return [_encode_float(v.real), _encode_float(v.imag)]
    if isinstance(v, float):
        return _encode_float(v)
    return v


# --------------------------------------------------------------------------- JSON


def encode_skeleton(skeleton: dict[str, Any]) -> bytes:
    """Compact JSON, ASCII-only (so lone surrogates in strings survive), UTF-8 bytes."""
    return json.dumps(skeleton, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"skeleton: non-standard JSON constant {name}")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" would silently parse as inf
        raise ValueError(f"skeleton: float literal {text} is out of range")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"skeleton: duplicate JSON key {k!r}")
        out[k] = v
    return out


def decode_skeleton(data: bytes) -> dict[str, Any]:
    """Parse and fully validate a skeleton (tags, payloads, tensor indices); raise ValueError
    saying what is wrong. Nothing beyond JSON values is constructed here."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"skeleton: not UTF-8 ({e})") from None
    try:
        skeleton = json.loads(
            text, parse_constant=_reject_constant, parse_float=_parse_float, object_pairs_hook=_no_duplicates
        )
    except RecursionError:
        raise ValueError("skeleton: nested too deeply") from None
    except ValueError as e:  # invalid JSON, or an integer past Python's digit limit
        raise ValueError(f"skeleton: invalid JSON ({e})") from None
    _decode(skeleton, None)
    return skeleton


# --------------------------------------------------------------------------- rebuild


def rebuild(skeleton: dict[str, Any], tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The plain structure with ``tensors`` substituted; Stateful objects come back as their
    state_dict. Tensors are used as given, not copied: pass tensors nothing else will reuse
    (an optimizer's load_state_dict may keep them as its state)."""
    return _decode(skeleton, tensors)


def _decode(skeleton: Any, tensors: Sequence[torch.Tensor] | None) -> Any:
    """Validate, and unless ``tensors`` is None (validation only) build the value."""
    if not isinstance(skeleton, dict):
        raise ValueError(f"skeleton: expected a JSON object, got {type(skeleton).__name__}")
    expected = {"format", "version", "num_tensors", "root"}
    if set(skeleton) != expected:
        raise ValueError(f"skeleton: expected keys {sorted(expected)}, got {sorted(skeleton)}")
    if skeleton["format"] != FORMAT:
        raise ValueError(f"skeleton: format {skeleton['format']!r} is not {FORMAT!r}")
    if skeleton["version"] != VERSION or type(skeleton["version"]) is not int:
        raise ValueError(f"skeleton: version {skeleton['version']!r} is not supported (expected {VERSION})")
    count = skeleton["num_tensors"]
    if type(count) is not int or count < 0:
        raise ValueError(f"skeleton: num_tensors {count!r} is not a non-negative integer")
    if tensors is not None and len(tensors) != count:
        raise ValueError(f"skeleton refers to {count} tensors but {len(tensors)} were given")
    decoder = _Decoder(count, tensors)
    root = skeleton["root"]
    if not isinstance(root, dict) or decoder.tag(root, ()) not in (None, "$dict", "$odict"):
        raise ValueError("skeleton: root must be a dict")
    try:
        value = decoder.value(root, ())
    except RecursionError:
        raise ValueError("skeleton: nested too deeply") from None
    if len(decoder.seen) != count:
        raise ValueError(f"skeleton: num_tensors is {count} but {len(decoder.seen)} tensors are referenced")
    return value


def _fail(path: Path, msg: str) -> ValueError:
    return ValueError(f"skeleton at {where(path)}: {msg}")


def _fields(payload: Any, names: set[str], tag: str, path: Path) -> dict[str, Any]:
    if not isinstance(payload, dict) or set(payload) != names:
        raise _fail(path, f"{tag} payload must be an object with keys {sorted(names)}")
    return payload


def _int(x: Any, what: str, path: Path) -> int:
    if type(x) is not int:  # bool is an int subclass; refuse it
        raise _fail(path, f"{what} must be an integer, got {x!r}")
    return x


def _shape(x: Any, path: Path) -> tuple[int, ...]:
    if not isinstance(x, list) or any(type(d) is not int or d < 0 for d in x):
        raise _fail(path, f"shape must be a list of non-negative integers, got {x!r}")
    return tuple(x)


def _str(x: Any, what: str, path: Path) -> str:
    if not isinstance(x, str):
        raise _fail(path, f"{what} must be a string, got {x!r}")
    return x


def _float(node: Any, path: Path) -> float:
    if type(node) in (int, float) and math.isfinite(node):
        return float(node)
    if isinstance(node, dict) and set(node) == {"$float"}:
        name = node["$float"]
        if isinstance(name, str) and name in _NONFINITE:
            return _NONFINITE[name]
    raise _fail(path, f"expected a float, got {node!r}")


def _base64(payload: Any, tag: str, path: Path) -> bytes:
    try:
        return base64.b64decode(_str(payload, tag, path), validate=True)
    except binascii.Error as e:
        raise _fail(path, f"{tag} payload is not base64 ({e})") from None


class _Decoder:
    def __init__(self, count: int, tensors: Sequence[torch.Tensor] | None) -> None:
        self.count = count
        self.tensors = tensors
        self.seen: set[int] = set()
        self.tags: dict[str, Callable[[Any, Path], Any]] = {
            "$tuple": lambda p, path: tuple(
                self.value(v, (*path, i)) for i, v in enumerate(self._list(p, path))
            ),
            "$dict": lambda p, path: self.pairs(p, path, {}),
            "$odict": lambda p, path: self.pairs(p, path, OrderedDict()),
            "$float": lambda p, path: _float({"$float": p}, path),
            "$bytes": lambda p, path: _base64(p, "$bytes", path),
            "$bytearray": lambda p, path: bytearray(_base64(p, "$bytearray", path)),
            "$tensor": self.tensor,
            "$ndarray": self.ndarray,
            "$npscalar": self.npscalar,
            "$dtype": self.dtype,
            "$size": lambda p, path: torch.Size(_shape(p, path)),
            "$device": self.device,
            "$generator": self.generator,
            "$stateful": self.stateful,
        }

    def _list(self, p: Any, path: Path) -> list[Any]:
        if not isinstance(p, list):
            raise _fail(path, f"expected a list, got {type(p).__name__}")
        return p

    def tag(self, node: dict[str, Any], path: Path) -> str | None:
        if not any(isinstance(k, str) and k.startswith("$") for k in node):
            return None
        if len(node) != 1:
            raise _fail(path, f"a tagged object must have exactly one key, got {sorted(node)}")
        (tag,) = node
        if tag not in self.tags:
            raise _fail(path, f"unknown tag {tag!r}")
        return tag

    def value(self, node: Any, path: Path) -> Any:
        if node is None or isinstance(node, (bool, str)):
            return node
        if type(node) is int:
            return node
        if type(node) is float:
            if not math.isfinite(node):
                raise _fail(path, "non-finite float outside a $float tag")
            return node
        if isinstance(node, list):
            return [self.value(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, dict):
            tag = self.tag(node, path)
            if tag is None:
                return {k: self.value(v, (*path, k)) for k, v in node.items()}
            return self.tags[tag](node[tag], path)
        raise _fail(path, f"unexpected value of type {type(node).__name__}")

    def key(self, node: Any, path: Path) -> Any:
        """A dict key: only tags that build immutable, hashable values."""
        if isinstance(node, dict):
            tag = self.tag(node, path)
            if tag == "$tuple":
                return tuple(self.key(v, path) for v in self._list(node[tag], path))
            if tag in ("$float", "$bytes", "$npscalar", "$dtype", "$device", "$size"):
                return self.value(node, path)
        elif node is None or type(node) in (bool, int, float, str):
            return self.value(node, path)
        raise _fail(path, f"dict key must be a plain hashable value, got {node!r}")

    def pairs(self, payload: Any, path: Path, out: dict[Any, Any]) -> dict[Any, Any]:
        for item in self._list(payload, path):
            if not isinstance(item, list) or len(item) != 2:
                raise _fail(path, "dict pairs must be [key, value] lists")
            k = self.key(item[0], path)
            if k in out:
                raise _fail(path, f"duplicate dict key {k!r}")
            out[k] = self.value(item[1], (*path, k))
        return out

    def _index(self, payload: dict[str, Any], path: Path) -> int:
        index = _int(payload["index"], "tensor index", path)
        if not 0 <= index < self.count:
            raise _fail(path, f"tensor index {index} out of range (num_tensors={self.count})")
        if index in self.seen:
            raise _fail(path, f"tensor index {index} is referenced twice")
        self.seen.add(index)
        return index

    def _given(self, index: int, dtype: torch.dtype, shape: tuple[int, ...], path: Path) -> torch.Tensor:
        assert self.tensors is not None
        t = self.tensors[index]
        if not isinstance(t, torch.Tensor):
            raise _fail(path, f"tensor {index} given as {type(t).__qualname__}, not a tensor")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise _fail(
                path,
                f"tensor {index} is {t.dtype} {list(t.shape)}; the skeleton expects {dtype} {list(shape)}",
            )
        return t

    def tensor(self, payload: Any, path: Path) -> torch.Tensor | None:
        p = _fields(payload, {"index", "dtype", "shape"}, "$tensor", path)
        index = self._index(p, path)
        dtype = _TORCH_DTYPES.get(_str(p["dtype"], "dtype", path))
        if dtype is None:
            raise _fail(path, f"unknown torch dtype {p['dtype']!r}")
        shape = _shape(p["shape"], path)
        return None if self.tensors is None else self._given(index, dtype, shape, path)

    def ndarray(self, payload: Any, path: Path) -> np.ndarray | None:
        p = _fields(payload, {"index", "dtype", "shape"}, "$ndarray", path)
        index = self._index(p, path)
        dtype = _NUMPY_DTYPES.get(_str(p["dtype"], "dtype", path))
        if dtype is None:
            raise _fail(path, f"unsupported numpy dtype {p['dtype']!r}")
        shape = _shape(p["shape"], path)
        if self.tensors is None:
            return None
        return self._given(index, dtype, shape, path).detach().cpu().numpy()

    def npscalar(self, payload: Any, path: Path) -> np.generic:
        p = _fields(payload, {"dtype", "value"}, "$npscalar", path)
        name = _str(p["dtype"], "dtype", path)
        if name not in _NUMPY_DTYPES:
            raise _fail(path, f"unsupported numpy dtype {name!r}")
        dtype = np.dtype(name)
        v = p["value"]
        if dtype.kind == "b":
            if not isinstance(v, bool):
                raise _fail(path, f"numpy bool scalar needs a bool, got {v!r}")
            return dtype.type(v)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            if not info.min <= _int(v, "value", path) <= info.max:
                raise _fail(path, f"{v} does not fit {name}")
            return dtype.type(v)
        if dtype.kind == "c":
            if not isinstance(v, list) or len(v) != 2:
                raise _fail(path, f"complex scalar needs [real, imag], got {v!r}")
            return dtype.type(complex(_float(v[0], path), _float(v[1], path)))
        return dtype.type(_float(v, path))

    def dtype(self, payload: Any, path: Path) -> torch.dtype:
        dtype = _TORCH_DTYPES.get(_str(payload, "$dtype", path))
        if dtype is None:
            raise _fail(path, f"unknown torch dtype {payload!r}")
        return dtype

    def device(self, payload: Any, path: Path) -> torch.device:
        try:
            return torch.device(_str(payload, "$device", path))
        except RuntimeError as e:
            raise _fail(path, f"bad device {payload!r} ({e})") from None

    def generator(self, payload: Any, path: Path) -> torch.Generator | None:
        p = _fields(payload, {"device", "state"}, "$generator", path)
        device = self.device(p["device"], path)
        node = p["state"]
        if not isinstance(node, dict) or set(node) != {"$tensor"}:
            raise _fail(path, "$generator state must be a $tensor")
        state = self.tensor(node["$tensor"], path)
        if state is None:
            return None
        try:
            generator = torch.Generator(device=device)
            generator.set_state(state.cpu())
        except (RuntimeError, TypeError) as e:
            raise _fail(path, f"cannot restore generator on {device} ({e})") from None
        return generator

    def stateful(self, payload: Any, path: Path) -> Any:
        p = _fields(payload, {"type", "state"}, "$stateful", path)
        _str(p["type"], "$stateful type", path)  # informational only; never resolved
        return self.value(p["state"], path)


# --------------------------------------------------------------------------- inspection


class _Paths(_Decoder):
    """Validation-only decoding that records where each tensor index sits."""

    def __init__(self, count: int) -> None:
        super().__init__(count, None)
        self.paths: dict[int, Path] = {}

    def _index(self, payload: dict[str, Any], path: Path) -> int:
        index = super()._index(payload, path)
        self.paths[index] = path
        return index


def tensor_paths(skeleton: dict[str, Any]) -> dict[int, Path]:
    """The path of each tensor index of a (decoded, valid) skeleton, as :func:`where` renders it."""
    decoder = _Paths(_int(skeleton["num_tensors"], "num_tensors", ()))
    decoder.value(skeleton["root"], ())
    return decoder.paths


def plain_values(skeleton: dict[str, Any]) -> dict[str, Any]:
    """The structure with every tensor (and array, generator) as None: what two ranks' skeletons
    are compared by when only their plain values matter."""
    return _decode(skeleton, None)


def differences(a: Any, b: Any, path: Path = (), out: list[Path] | None = None) -> list[Path]:
    """Paths where two :func:`plain_values` structures differ (types, keys, lengths or values;
    NaN equals NaN)."""
    out = [] if out is None else out
    if type(a) is not type(b):
        out.append(path)
    elif isinstance(a, dict):
        if list(a) != list(b):
            out.extend((*path, k) for k in [*[k for k in a if k not in b], *[k for k in b if k not in a]])
            if set(a) == set(b):
                out.append(path)  # the same keys in another order
        for k in a:
            if k in b:
                differences(a[k], b[k], (*path, k), out)
    elif isinstance(a, list | tuple):
        if len(a) != len(b):
            out.append(path)
        else:
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                differences(x, y, (*path, i), out)
    elif isinstance(a, float) and math.isnan(a) and math.isnan(b):
        pass
    elif a != b:
        out.append(path)
    return out


# --------------------------------------------------------------------------- load_into

_ABSENT: Any = object()


def load_into(
    state: MutableMapping[str, Any], skeleton: dict[str, Any], tensors: Sequence[torch.Tensor]
) -> None:
    """Restore a checkpoint into the live ``state`` in place.

    Stateful objects get ``load_state_dict``, generators ``set_state``; live tensors (and numpy
    arrays) of the same shape and dtype are overwritten in place, on their own device, so
    references the trainer holds stay valid; dicts, and lists/tuples of the same length, are
    walked; anything else is replaced. Keys only the checkpoint has are added. A key the live
    state has but the checkpoint lacks raises StateError before anything is touched.
    """
    restored = check_fits(state, skeleton, tensors)
    with torch.no_grad():
        _load(state, restored, ())


def check_fits(
    state: Mapping[str, Any], skeleton: dict[str, Any], tensors: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """What load_into checks before touching anything (the skeleton is valid and names every key
    of the live state); returns the rebuilt value. ValueError or StateError if it does not fit."""
    restored = rebuild(skeleton, tensors)
    missing: list[Path] = []
    lazy: list[str] = []
    _find_missing(state, restored, (), missing, lazy)
    if missing:
        names = ", ".join(where(p) for p in missing)
        raise StateError(f"{names}: not in the checkpoint; refusing a restore that would leave it stale")
    if lazy:  # here, not when load_state_dict refuses: by then earlier keys were already loaded
        raise StateError(lazy[0])
    return restored


def _walks(live: Any, value: Any) -> str | None:
    """How _load descends into ``live``; shared with _find_missing so the two agree."""
    if is_stateful(live) or isinstance(live, (torch.Tensor, torch.Generator, np.ndarray, torch.Size)):
        return None
    if isinstance(live, MutableMapping) and isinstance(value, Mapping):
        return "mapping"
    if isinstance(live, list) and isinstance(value, list) and len(live) == len(value):
        return "sequence"
    if isinstance(live, tuple) and type(value) is tuple and len(live) == len(value):
        return "sequence"
    return None


def _lazy_state(live: Any, saved: Any) -> str:
    """Why ``live`` (an optimizer) cannot load ``saved``, its state dict, when its lazily made
    state does not exist yet ("" when that is not the reason): TorchRec's KeyedOptimizer loads
    only into state it has ("Different parameter count: 3 vs 11")."""
    if not isinstance(live, torch.optim.Optimizer) or not isinstance(saved, Mapping):
        return ""
    state = saved.get("state")
    if not isinstance(state, Mapping) or len(live.state) >= len(state):
        return ""
    return (
        f"the optimizer ({type(live).__qualname__}) has state for {len(live.state)} parameters, "
        f"the checkpoint for {len(state)}: create its state before resuming (TorchRec: "
        "optimizer.init_state(); other optimizers: one step), as its first step would"
    )


def _loads_only_into_its_state(opt: Any) -> bool:
    """TorchRec's KeyedOptimizer (and its subclasses) loads only into state it already has; torch's
    optimizers create what they lack from the checkpoint. By type name: TorchRec is optional."""
    return any(
        c.__name__ == "KeyedOptimizer" and c.__module__.startswith("torchrec.") for c in type(opt).__mro__
    )


def _find_missing(live: Any, value: Any, path: Path, out: list[Path], lazy: list[str]) -> None:
    """The live keys the checkpoint lacks into ``out``; into ``lazy``, why an optimizer that loads
    only into its existing state would refuse the checkpoint's (its lazy state is not made yet)."""
    if _loads_only_into_its_state(live):
        why = _lazy_state(live, value)
        if why:
            lazy.append(f"{where(path)}: {why}")
    kind = _walks(live, value)
    if kind == "mapping":
        for k in live:
            if k in value:
                _find_missing(live[k], value[k], (*path, k), out, lazy)
            else:
                out.append((*path, k))
    elif kind == "sequence":
        for i, (a, b) in enumerate(zip(live, value, strict=True)):
            _find_missing(a, b, (*path, i), out, lazy)


def _load(live: Any, value: Any, path: Path) -> Any:
    """Load ``value`` into ``live``; return what the parent should hold (``live`` if in place)."""
    if live is _ABSENT:
        return value
    if is_stateful(live):
        try:
            live.load_state_dict(value)
        except (ValueError, KeyError) as exc:
            lazy = _lazy_state(live, value)
            if lazy:
                raise StateError(f"{where(path)}: {lazy} ({exc})") from exc
            raise
        return live
    if isinstance(live, torch.Generator) and isinstance(value, torch.Generator):
        live.set_state(value.get_state())
        return live
    if isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor):
        if live.shape == value.shape and live.dtype == value.dtype:
            live.copy_(value)  # free when the restore already wrote into ``live`` (same memory)
            return live
        return value.to(live.device)
    if (
        type(live) is np.ndarray
        and type(value) is np.ndarray
        and live.shape == value.shape
        and live.dtype == value.dtype
        and live.flags.writeable
    ):
        np.copyto(live, value)
        return live
    kind = _walks(live, value)
    if kind == "mapping":
        for k, v in value.items():
            current = live.get(k, _ABSENT)
            new = _load(current, v, (*path, k))
            if new is not current:
                live[k] = new
        return live
    if kind == "sequence":
        items = [_load(a, b, (*path, i)) for i, (a, b) in enumerate(zip(live, value, strict=True))]
        if isinstance(live, list):
            for i, new in enumerate(items):
                if new is not live[i]:
                    live[i] = new
            return live
        return live if all(a is b for a, b in zip(items, live, strict=True)) else tuple(items)
    return value
