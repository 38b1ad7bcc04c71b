"""Inputs for the fuzzer, generated from the wire contract and the bucket's JSON shapes.

Two kinds of generators: hypothesis strategies (``message()`` walks a protobuf descriptor, field by
field, so every message of ``strata.proto`` gets boundary values, odd names, long strings and huge
counts without a hand-written schema), and :class:`Havoc`, a cheap seeded mutator that derives many
inputs from one (a field or a JSON node replaced by an interesting value, a list grown, a key dropped),
which keeps the cost of one execution near the cost of the target itself."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from hypothesis import strategies as st

# --- interesting scalars ---------------------------------------------------------------------------

INT64 = [
    0,
    1,
    -1,
    2,
    7,
    2**31 - 1,
    -(2**31),
    2**32,
    2**53 + 1,
    2**63 - 1,
    -(2**63),
    10**12 - 1,
    10**12,
    10**15,
]
UINT32 = [0, 1, 2, 3, 7, 255, 65536, 2**31, 2**32 - 1]
UINT64 = [0, 1, 2, 64, 4096, 2**31, 2**32, 2**40, 2**53 + 1, 2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, math.nan, math.inf, -math.inf, 1e308, 5e-324, 1e18]

#: names that stress the name checks: empty, upper case, separators, control characters, the
#: segment prefix and its glob, the longest allowed and one more, a trailing newline.
ODD_NAMES = [
    "",
    "a",
    "fz-0",
    "Job",
    "-x",
    "x-",
    "x\n",
    "fz-0\n",
    "\nfz-0",
    "a/b",
    "../x",
    ".",
    "..",
    "x\x00y",
    "ünï",
    " x",
    "x y",
    "a" * 253,
    "a" * 254,
    "strata-0",
    "strata-*",
    "strata-../../x",
    "*",
    "%s%n",
    "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
]
LONG = ["x" * (1 << 10), "y" * (1 << 16), "z" * (1 << 20)]
DTYPES = ["float32", "bfloat16", "float16", "uint8", "int64", "bool", "float13", "", "FLOAT32", "complex32"]
GENERATIONS = ["fz/0", "fz/1", "", "/", "fz/", "/0", "fz/-1", "fz/x", "a b/0", "fz/99999999999999999999"]

#: state trees: valid ones, deep ones (RecursionError), non-finite floats, wrong types.
TREES: list[bytes] = [
    b"",
    b'{"w": {"__tensor__": 0}}',
    b'{"format": "strata.tree", "version": 1, "num_tensors": 1, "root": {"w": {"$tensor": 0}}}',
    b"{",
    b"null",
    b"[]",
    b'"x"',
    b'{"x": NaN}',
    b'{"x": Infinity, "y": -Infinity}',
    b'{"x": 1e999}',
    b'{"x": ' + b"9" * 5000 + b"}",
    b"\xff\xfe",
    b"[" * 100 + b"]" * 100,
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 5000 + b"0" + b"}" * 5000,
    b"[" * 200_000 + b"]" * 200_000,
]


def _long_text() -> st.SearchStrategy[str]:
    return st.sampled_from(LONG)


def names() -> st.SearchStrategy[str]:
    """Mostly valid job names from a small pool (so calls reach deep), else odd ones."""
    return st.one_of(
        st.sampled_from([f"fz-{i}" for i in range(4)]),
        st.sampled_from(ODD_NAMES),
        st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}[a-z0-9]", fullmatch=True),
        st.text(max_size=12),
    )


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Any JSON value, non-finite floats and huge integers included."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INT64 + UINT64),
        st.integers(),
        st.sampled_from(FLOATS),
        st.floats(),
        st.sampled_from(ODD_NAMES),
        st.text(max_size=16),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def trees() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(TREES),
        json_values().map(lambda v: json.dumps(v, allow_nan=True).encode()),
        st.binary(max_size=32),
    )


# --- protobuf messages from their descriptors ------------------------------------------------------

_T = _d.FieldDescriptor

#: fields whose meaning is known: generated from a better pool than their type alone gives.
_BY_NAME: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
    "namespace": lambda: st.one_of(st.just("default"), names()),
    "job": names,
    "save_id": lambda: st.one_of(
        st.sampled_from(["s1", "s-2", "x" * 64, "x" * 65, "a_b", "", "a\n"]), names()
    ),
    "dtype": lambda: st.sampled_from(DTYPES),
    "generation": lambda: st.sampled_from(GENERATIONS),
    "tree": trees,
    "mac": lambda: st.one_of(st.just(""), st.text("0123456789abcdef", min_size=64, max_size=64), st.text()),
    "stream_mac": lambda: st.one_of(st.just(""), st.text("0123456789abcdef", min_size=64, max_size=64)),
    "kind": lambda: st.sampled_from(["replica", "parity", "", "x"]),
    "sample": lambda: st.sampled_from(["00000000", "deadbeef", "", "xyz"]),
}


def scalar(field: _d.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if field.name in _BY_NAME:
        return _BY_NAME[field.name]()
    if t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))
    if t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32):
        return st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
    if t in (_T.TYPE_UINT32, _T.TYPE_FIXED32):
        return st.one_of(st.sampled_from(UINT32), st.integers(0, 2**32 - 1))
    if t in (_T.TYPE_UINT64, _T.TYPE_FIXED64):
        return st.one_of(st.sampled_from(UINT64), st.integers(0, 2**64 - 1))
    if t in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        return st.one_of(st.sampled_from(FLOATS), st.floats(width=32 if t == _T.TYPE_FLOAT else 64))
    if t == _T.TYPE_BOOL:
        return st.booleans()
    if t == _T.TYPE_STRING:
        return st.one_of(st.sampled_from(ODD_NAMES), st.text(max_size=24), _long_text())
    if t == _T.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from([b"\0" * 4096, b"\xff" * (1 << 16)]))
    if t == _T.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _repeated(field: _d.FieldDescriptor, depth: int) -> st.SearchStrategy[list[Any]]:
    one = _value(field, depth)
    return st.one_of(st.lists(one, max_size=3), st.lists(one, min_size=20, max_size=60))


def _value(field: _d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _T.TYPE_MESSAGE:
        return message(field.message_type, depth + 1)
    return scalar(field)


def message(desc: _d.Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of type ``desc``: each field set or not, with a value from its type's pool
    (nested messages to a depth of 3; repeated fields short or long)."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    optional = {}
    for f in desc.fields:
        is_list = f.is_repeated
        optional[f.name] = _repeated(f, depth) if is_list else _value(f, depth)
    return st.fixed_dictionaries({}, optional=optional).map(lambda kw: build(cls, kw))


def build(cls: type[Message], values: dict[str, Any]) -> Message:
    msg = cls()
    for name, v in values.items():
        set_field(msg, msg.DESCRIPTOR.fields_by_name[name], v)
    return msg


def set_field(msg: Message, field: _d.FieldDescriptor, value: Any) -> None:
    if field.is_repeated:
        target = getattr(msg, field.name)
        del target[:]
        if field.type == _T.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.type == _T.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


# --- havoc: cheap seeded mutations -----------------------------------------------------------------


def _pool(field: _d.FieldDescriptor) -> list[Any]:
    name, t = field.name, field.type
    if name in ("job", "namespace"):
        return [*ODD_NAMES, "fz-1", "default"]
    if name == "dtype":
        return DTYPES
    if name == "generation":
        return GENERATIONS
    if name == "tree":
        return TREES
    if t in (_T.TYPE_INT64, _T.TYPE_SINT64, _T.TYPE_SFIXED64):
        return INT64
    if t in (_T.TYPE_INT32, _T.TYPE_SINT32, _T.TYPE_SFIXED32):
        return [0, 1, -1, 2**31 - 1, -(2**31)]
    if t in (_T.TYPE_UINT32, _T.TYPE_FIXED32):
        return UINT32
    if t in (_T.TYPE_UINT64, _T.TYPE_FIXED64):
        return UINT64
    if t in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        return FLOATS
    if t == _T.TYPE_BOOL:
        return [True, False]
    if t == _T.TYPE_STRING:
        return [*ODD_NAMES, LONG[0], LONG[1]]
    if t == _T.TYPE_BYTES:
        return [b"", b"\0", b"\xff" * 7, *TREES[:12]]
    if t == _T.TYPE_ENUM:
        return [v.number for v in field.enum_type.values] + [99]
    return []


#: JSON values a mutation puts in place of a node of a bucket object.
JSON_HAVOC: list[Any] = [
    None,
    True,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64,
    10**12,
    10**40,
    -(10**12),
    math.nan,
    math.inf,
    1.5,
    "",
    "x",
    "x\n",
    "../../x",
    "fz/0",
    "0" * 12,
    "9" * 13,
    [],
    [[]],
    [None],
    [[0, None, "g"]],
    [["x"]],
    [[1, 2, 3, 4]],
    {},
    {"key": "k"},
    {"rank": 0},
    {"key": "k", "sha256": ""},
]


class Havoc:
    """Seeded mutations of protobuf messages and JSON documents (deterministic per seed)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # protobuf
    def message(self, msg: Message, rounds: int = 2) -> Message:
        out = type(msg)()
        out.CopyFrom(msg)
        for _ in range(self.rng.randint(1, rounds)):
            self._mutate(out, 0)
        return out

    def _mutate(self, msg: Message, depth: int) -> None:
        fields = list(msg.DESCRIPTOR.fields)
        if not fields:
            return
        f = self.rng.choice(fields)
        r = self.rng
        if f.type == _T.TYPE_MESSAGE:
            if f.is_repeated:
                items = getattr(msg, f.name)
                choice = r.random()
                if choice < 0.3 and len(items):
                    self._mutate(r.choice(items), depth + 1)
                elif choice < 0.5 and len(items):
                    for _ in range(r.choice([1, 10, 1000])):
                        items.add().CopyFrom(items[0])
                elif choice < 0.7 and len(items):
                    del items[r.randrange(len(items))]
                else:
                    self._mutate(items.add(), depth + 1)
            elif depth < 4:
                if r.random() < 0.15:
                    msg.ClearField(f.name)
                else:
                    self._mutate(getattr(msg, f.name), depth + 1)
            return
        pool = _pool(f)
        if f.is_repeated:
            items = getattr(msg, f.name)
            if r.random() < 0.5 or not len(items):
                items.extend(r.choice(pool) for _ in range(r.choice([1, 2, 8, 1000])))
            else:
                items[r.randrange(len(items))] = r.choice(pool)
            return
        if r.random() < 0.1:
            msg.ClearField(f.name)
            return
        value = r.choice(pool)
        if f.type in (_T.TYPE_INT64, _T.TYPE_UINT64, _T.TYPE_INT32, _T.TYPE_UINT32) and r.random() < 0.3:
            cur = getattr(msg, f.name)
            lo, hi = _bounds(f)
            value = min(max(cur + r.choice([-1, 1, -2, 2, 1 << 10]), lo), hi)
        setattr(msg, f.name, value)

    # JSON
    def json(self, doc: Any, rounds: int = 2) -> Any:
        doc = json.loads(json.dumps(doc))
        for _ in range(self.rng.randint(1, rounds)):
            doc = self._json_once(doc)
        return doc

    def _json_once(self, doc: Any) -> Any:
        paths = list(_paths(doc))
        r = self.rng
        path = r.choice(paths)
        node = _get(doc, path)
        choice = r.random()
        if choice < 0.45:
            new: Any = r.choice(JSON_HAVOC)
        elif choice < 0.6 and isinstance(node, dict) and node:
            new = dict(node)
            del new[r.choice(list(new))]
        elif choice < 0.7 and isinstance(node, list) and node:
            new = node * r.choice([2, 50])
        elif choice < 0.8 and isinstance(node, int) and not isinstance(node, bool):
            new = node + r.choice([-1, 1, 10**12, -(10**12)])
        elif choice < 0.9 and isinstance(node, str):
            new = r.choice([node + "\n", node[:-1], node.upper(), node + "x" * 4096, node.replace("0", "9")])
        elif choice < 0.95:
            new = {"__deep__": r.choice([10, 2000, 50_000])}
        else:
            new = {"extra": node, "kind": "x"}
        return _put(doc, path, copy.deepcopy(new))  # never a node twice (no cycles)


def _bounds(f: _d.FieldDescriptor) -> tuple[int, int]:
    return {
        _T.TYPE_INT64: (-(2**63), 2**63 - 1),
        _T.TYPE_UINT64: (0, 2**64 - 1),
        _T.TYPE_INT32: (-(2**31), 2**31 - 1),
        _T.TYPE_UINT32: (0, 2**32 - 1),
    }[f.type]


def _paths(doc: Any, path: tuple[Any, ...] = ()) -> Any:
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):
            yield from _paths(v, (*path, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def dump(doc: Any) -> bytes:
    """A document as bytes, ``{"__deep__": n}`` expanded into n nested lists (json.dumps itself
    would recurse); at most four expansions of at most 50,000 levels each."""
    text = json.dumps(doc, allow_nan=True)
    for i in range(64):
        head, sep, rest = text.partition('{"__deep__": ')
        if not sep:
            break
        n, _, tail = rest.partition("}")
        depth = min(int(n), 50_000) if n.isdigit() and len(n) < 7 and i < 4 else 0
        text = head + "[" * depth + "]" * depth + ("" if depth else "[]") + tail
    return text.encode()
