"""trainer_client._tree: skeleton + tensors round trips, refusals, safe decoding, in-place load."""

from __future__ import annotations

import json
import math
import warnings
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from trainer_client._tree import (
    Flat,
    StateError,
    decode_skeleton,
    encode_skeleton,
    flatten,
    load_into,
    rebuild,
)

# torchdata's StatefulDataLoader constructor calls a deprecated torch API; not ours to fix.
_SET_VITAL = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def roundtrip(state: dict[str, Any]) -> tuple[Flat, dict[str, Any]]:
    """Flatten, go through JSON bytes, and rebuild from cloned tensors (as staging would)."""
    flat = flatten(state)
    data = encode_skeleton(flat.skeleton)
    json.dumps(flat.skeleton, allow_nan=False)
    skeleton = decode_skeleton(data)
    assert skeleton == flat.skeleton
    return flat, rebuild(skeleton, [t.clone() for _, t in flat.tensors])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that holds for NaN payloads and float8/bfloat16."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def skeleton_with(root: Any, num_tensors: int = 0) -> bytes:
    envelope = {"format": "strata.tree", "version": 1, "num_tensors": num_tensors}
    return json.dumps({**envelope, "root": root}).encode()


def leaf(index: Any, dtype: str = "float32", shape: Any = (), tag: str = "$tensor") -> dict[str, Any]:
    """A tensor (or ndarray) reference as a skeleton spells it."""
    return {
        tag: {"index": index, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}
    }


# --------------------------------------------------------------------------- round trips


def test_plain_values_roundtrip_exactly() -> None:
    state: dict[str, Any] = {
        "none": None,
        "flags": [True, False],
        "int": -(2**70),
        "str": "héllo \ud800",  # a lone surrogate still survives
        "floats": [0.1, -0.0, 1e-310, math.inf, -math.inf],
        "tuple": (1, (2.5, "x"), []),
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"ab"),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 0, 3]),
        "device": torch.device("cuda", 1),
        "odict": OrderedDict([("b", 1), ("a", 2)]),
        "nested": {"deeper": {"x": [1, {"y": None}]}},
    }
    flat, back = roundtrip(state)
    assert flat.tensors == []
    assert back == state
    assert math.copysign(1.0, back["floats"][1]) == -1.0
    assert type(back["tuple"]) is tuple and type(back["tuple"][1]) is tuple
    assert type(back["bytearray"]) is bytearray and type(back["bytes"]) is bytes
    assert type(back["size"]) is torch.Size
    assert type(back["odict"]) is OrderedDict and list(back["odict"]) == ["b", "a"]


def test_nan_roundtrips_and_skeleton_is_strict_json() -> None:
    flat, back = roundtrip({"x": math.nan, "y": [np.float32("nan")]})
    assert "NaN" not in encode_skeleton(flat.skeleton).decode()
    assert math.isnan(back["x"])
    assert type(back["y"][0]) is np.float32 and np.isnan(back["y"][0])


def test_dict_keys_that_are_not_plain_strings() -> None:
    state = {
        "optim_like": {0: {"step": 1}, 1: {"step": 2}},
        "collide": {"$tensor": 1, "$float": "nan", "ok": 2},
        "mixed": {None: 1, True: 2, 2.5: 3, (1, "a"): 4, b"k": 5, torch.float16: 6, "s": 7},
        "int_odict": OrderedDict([(3, "c"), (1, "a")]),
    }
    flat, back = roundtrip(state)
    assert back == state
    assert list(back["int_odict"]) == [3, 1] and type(back["int_odict"]) is OrderedDict
    assert flat.tensors == []  # a "$tensor" key is data, not a tensor reference


def test_numpy_scalars_keep_their_dtype() -> None:
    values = [
        np.bool_(True),
        np.int8(-5),
        np.uint64(2**64 - 1),
        np.int64(-(2**63)),
        np.float16(0.1),
        np.float32(-0.0),
        np.float64(1 / 3),
        np.float32("-inf"),
        np.complex64(1 - 2j),
        np.complex128(complex(math.inf, -0.5)),
    ]
    _, back = roundtrip({"v": values})
    for got, want in zip(back["v"], values, strict=True):
        assert type(got) is type(want)
        assert got.tobytes() == want.tobytes()


def _dtypes() -> list[torch.dtype]:
    out = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8]
    out += [torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
    out += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
    return out


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_tensors_roundtrip_bitwise(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = (torch.randn(4, 6) * 10).to(dtype) if dtype != torch.bool else torch.rand(4, 6) > 0.5
    state = {
        "dense": base,
        "scalar": base[1, 2].clone(),  # 0-dim
        "empty": base[:0],
        "strided": base.t()[::2],  # non-contiguous
    }
    flat, back = roundtrip(state)
    assert [n for n, _ in flat.tensors] == ["dense", "scalar", "empty", "strided"]
    for key, want in state.items():
        assert bits_equal(back[key], want), key


def test_tensor_details() -> None:
    weight = torch.nn.Parameter(torch.randn(3))
    nan = torch.tensor([math.nan, -0.0, math.inf])
    flat, back = roundtrip({"w": weight, "nan": nan})
    assert not flat.tensors[0][1].requires_grad  # staging must not record autograd
    assert type(back["w"]) is torch.Tensor and torch.equal(back["w"], weight.detach())
    assert bits_equal(back["nan"], nan)
    skeleton_tensor = flat.skeleton["root"]["w"]["$tensor"]
    assert skeleton_tensor == {"index": 0, "dtype": "float32", "shape": [3]}


def test_numpy_arrays_come_back_as_arrays() -> None:
    arrays: dict[str, Any] = {
        "u32": np.arange(624, dtype=np.uint32),
        "zero_d": np.array(7, dtype=np.int16),
        "strided": np.arange(12.0).reshape(3, 4)[:, ::-2],
        "big_endian": np.arange(3, dtype=">i4"),
        "readonly": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
        "bool": np.array([True, False]),
    }
    _, back = roundtrip(arrays)
    for key, want in arrays.items():
        got = back[key]
        assert type(got) is np.ndarray and got.shape == want.shape, key
        assert got.dtype.name == want.dtype.name and np.array_equal(got, want), key


def test_generator_roundtrips_as_generator() -> None:
    g = torch.Generator().manual_seed(123)
    torch.rand(5, generator=g)
    flat, back = roundtrip({"sampler": {"gen": g}})
    assert [n for n, _ in flat.tensors] == ["sampler.gen"]
    assert isinstance(back["sampler"]["gen"], torch.Generator)
    assert torch.equal(torch.rand(5, generator=back["sampler"]["gen"]), torch.rand(5, generator=g))


def test_stateful_objects_are_saved_through_state_dict() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    flat, back = roundtrip({"model": model, "epoch": 3})
    names = [n for n, _ in flat.tensors]
    assert names[:2] == ["model.0.weight", "model.0.bias"]
    assert "model.1.num_batches_tracked" in names
    assert back["model"].keys() == model.state_dict().keys()
    assert flat.skeleton["root"]["model"]["$stateful"]["type"] == "torch.nn.modules.container.Sequential"


def test_optimizer_names_and_int_keys() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    flat, back = roundtrip({"optim": opt})
    names = [n for n, _ in flat.tensors]
    assert "optim.state.0.exp_avg" in names and "optim.state.1.step" in names
    assert list(back["optim"]["state"]) == [0, 1]
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_duplicate_names_get_suffixes() -> None:
    t = torch.zeros(1)
    flat = flatten({"a.b": t, "a": {"b": t, "b#2": t}, "c": [t]})
    assert [n for n, _ in flat.tensors] == ["a.b", "a.b#2", "a.b#2#2", "c.0"]
    assert len({n for n, _ in flat.tensors}) == 4


# --------------------------------------------------------------------------- refusals


class Foo:
    pass


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        ({"optim": {"param_groups": [{"foo": Foo()}]}}, "state['optim']['param_groups'][0]['foo']", "Foo"),
        ({"a": {1, 2}}, "state['a']", "set"),
        ({"a": (1, lambda: 0)}, "state['a'][1]", "function"),
        ({"a": np.array([object()])}, "state['a']", "numpy array of dtype object"),
        ({"a": torch.zeros(2, 2).to_sparse()}, "state['a']", "sparse"),
        ({"a": torch.zeros(2, device="meta")}, "state['a']", "meta tensor"),
        ({"a": {Foo(): 1}}, "state['a']", "dict key of type Foo"),
        ({"a": {(1, frozenset()): 1}}, "state['a']", "dict key of type frozenset"),
        ({"a": np.longdouble(1)}, "state['a']", "longdouble"),
    ],
)
def test_unsupported_values_are_refused_with_their_path(state: dict[str, Any], where: str, what: str) -> None:
    with pytest.raises(StateError) as info:
        flatten(state)
    assert str(info.value).startswith(where + ":")
    assert what in str(info.value)


def test_refusal_message_suggests_a_fix_and_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"give it state_dict\(\)/load_state_dict\(\) or use plain values"):
        flatten({"x": Foo()})


def test_quantized_tensors_are_refused() -> None:
    with warnings.catch_warnings():  # quantized tensors are deprecated; making one warns
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)
    with pytest.raises(StateError, match=r"state\['a'\]: cannot checkpoint a quantized tensor"):
        flatten({"a": q})


def test_cycles_are_refused() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(StateError, match=r"state\['a'\]\[1\]: reference cycle"):
        flatten({"a": loop})


def test_tensor_subclass_inside_module_state_is_refused() -> None:
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(StateError, match=r"state\['m'\]\['weight'\]: cannot checkpoint tensor subclass"):
        flatten({"m": lazy})


# --------------------------------------------------------------------------- decoding is strict and safe


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff", "not UTF-8"),
        (b"{", "invalid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"format":"strata.tree","version":1,"num_tensors":0,"root":{}, "x":1}', "expected keys"),
        (b'{"format":"pickle","version":1,"num_tensors":0,"root":{}}', "format"),
        (b'{"format":"strata.tree","version":2,"num_tensors":0,"root":{}}', "version 2"),
        (b'{"format":"strata.tree","version":true,"num_tensors":0,"root":{}}', "version True"),
        (b'{"format":"strata.tree","version":1,"num_tensors":0,"root":{"a":NaN}}', "NaN"),
        (b'{"format":"strata.tree","version":1,"num_tensors":0,"root":{"a":1e999}}', "out of range"),
        (b'{"format":"strata.tree","version":1,"num_tensors":0,"root":{"a":1,"a":2}}', "duplicate JSON key"),
        (skeleton_with([]), "root must be a dict"),
        (skeleton_with({"$tuple": []}), "root must be a dict"),
        (skeleton_with({"a": {"$pickle": "gASV"}}), "unknown tag '$pickle'"),
        (skeleton_with({"a": {"$tuple": [], "b": 1}}), "exactly one key"),
        (skeleton_with({"a": {"$float": "NaN"}}), "expected a float"),
        (skeleton_with({"a": {"$float": []}}), "expected a float"),
        (skeleton_with({"a": {"$tuple": {}}}), "expected a list"),
        (skeleton_with({"a": {"$bytes": "***"}}), "not base64"),
        (skeleton_with({"a": {"$dtype": "Tensor"}}), "unknown torch dtype 'Tensor'"),
        (skeleton_with({"a": {"$device": "nowhere:9"}}), "bad device"),
        (skeleton_with({"a": {"$size": [-1]}}), "non-negative"),
        (skeleton_with({"a": {"$dict": [[[1], 2]]}}), "plain hashable"),
        (skeleton_with({"a": {"$dict": [[1, 2], [1, 3]]}}), "duplicate dict key 1"),
        (skeleton_with({"a": {"$dict": [[1, 2, 3]]}}), "[key, value]"),
        (skeleton_with({"a": {"$npscalar": {"dtype": "object", "value": 1}}}), "unsupported numpy dtype"),
        (skeleton_with({"a": {"$npscalar": {"dtype": "uint8", "value": 256}}}), "does not fit uint8"),
        (skeleton_with({"a": {"$npscalar": {"dtype": "int8", "value": True}}}), "must be an integer"),
        (skeleton_with({"a": {"$stateful": {"type": "os.system", "state": {}, "args": []}}}), "payload"),
        (skeleton_with({"a": leaf(1)}, 1), "out of range"),
        (skeleton_with({"a": leaf(-1)}, 1), "out of range"),
        (skeleton_with({"a": leaf(True)}, 1), "integer"),
        (skeleton_with({"a": leaf(0, shape=[2.0])}, 1), "shape"),
        (skeleton_with({"a": leaf(0, "qint8x")}, 1), "dtype"),
        (skeleton_with({"a": {"$tensor": {"index": 0}}}, 1), "payload must be an object"),
        (skeleton_with({"a": leaf(0, "object", tag="$ndarray")}, 1), "numpy dtype"),
        (skeleton_with({"a": {"$generator": {"device": "cpu", "state": 1}}}, 1), "must be a $tensor"),
        (skeleton_with({}, 1), "1 but 0 tensors are referenced"),
    ],
)
def test_decode_rejects_malformed_skeletons(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as info:
        decode_skeleton(data)
    assert message in str(info.value)


def test_decode_rejects_a_tensor_referenced_twice() -> None:
    with pytest.raises(ValueError, match="referenced twice"):
        decode_skeleton(skeleton_with({"a": leaf(0), "b": leaf(0)}, 1))


def test_decode_error_names_the_path() -> None:
    with pytest.raises(ValueError, match=r"skeleton at state\['a'\]\[1\]\['b'\]: unknown tag"):
        decode_skeleton(skeleton_with({"a": [0, {"b": {"$eval": "1"}}]}))


def test_deep_nesting_is_a_value_error() -> None:
    data = skeleton_with({"a": 1}).replace(b"1}}", b"[" * 100_000 + b"]" * 100_000 + b"}}")
    with pytest.raises(ValueError, match="nested too deeply"):
        decode_skeleton(data)


def test_rebuild_checks_the_given_tensors() -> None:
    flat = flatten({"a": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="refers to 1 tensors but 0 were given"):
        rebuild(flat.skeleton, [])
    with pytest.raises(ValueError, match=r"tensor 0 is torch.float16 \[2, 3\]; the skeleton expects"):
        rebuild(flat.skeleton, [torch.zeros(2, 3, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"expects torch.float32 \[2, 3\]"):
        rebuild(flat.skeleton, [torch.zeros(3, 2)])


def test_crafted_skeleton_constructs_only_safe_types() -> None:
    """Every tag an attacker can write decodes to a fixed, harmless type; a Stateful's recorded
    type is never resolved, so naming a dangerous callable builds nothing."""
    root = {
        "evil": {"$stateful": {"type": "os.system", "state": {"cmd": "touch /tmp/pwned"}}},
        "cls": {"__class__": "subprocess.Popen", "__reduce__": ["os.system", ["id"]]},
        "tags": [
            {"$tuple": [1]},
            {"$dict": [[1, 2]]},
            {"$odict": [["a", 1]]},
            {"$float": "inf"},
            {"$bytes": "AA=="},
            {"$bytearray": ""},
            {"$dtype": "float32"},
            {"$size": [1]},
            {"$device": "cpu"},
            {"$npscalar": {"dtype": "int32", "value": 1}},
            leaf(0, "uint8", (2,), tag="$ndarray"),
            leaf(1),
            {"$generator": {"device": "cpu", "state": leaf(2, "uint8", (5056,))}},
        ],
    }
    tensors = [torch.zeros(2, dtype=torch.uint8), torch.tensor(1.0), torch.Generator().get_state()]
    back = rebuild(decode_skeleton(skeleton_with(root, 3)), tensors)
    assert back["evil"] == {"cmd": "touch /tmp/pwned"}
    assert back["cls"] == {"__class__": "subprocess.Popen", "__reduce__": ["os.system", ["id"]]}
    safe = (
        type(None), bool, int, float, str, bytes, bytearray, list, tuple, dict, OrderedDict,
        torch.dtype, torch.Size, torch.device, torch.Tensor, torch.Generator, np.ndarray, np.generic,
    )  # fmt: skip

    def walk(x: Any) -> None:
        assert isinstance(x, safe), type(x)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for v in x:
                walk(v)

    walk(back)


# --------------------------------------------------------------------------- load_into


def test_load_into_restores_in_place() -> None:
    torch.manual_seed(0)
    live_buf = torch.zeros(3)
    nested = torch.zeros(2, 2)
    live_arr = np.zeros(4, dtype=np.uint32)
    state: dict[str, Any] = {
        "buf": live_buf,
        "inner": {"t": nested, "n": 0, "keep_list": [torch.zeros(1), 5]},
        "arr": live_arr,
        "reshaped": torch.zeros(2),
        "step": 0,
    }
    saved: dict[str, Any] = {
        "buf": torch.tensor([1.0, 2.0, 3.0]),
        "inner": {"t": torch.ones(2, 2), "n": 7, "keep_list": [torch.full((1,), 4.0), 6]},
        "arr": np.arange(4, dtype=np.uint32),
        "reshaped": torch.arange(3.0),
        "step": 42,
        "extra": "added",
    }
    flat = flatten(saved)
    list_tensor = state["inner"]["keep_list"][0]
    load_into(state, decode_skeleton(encode_skeleton(flat.skeleton)), [t.clone() for _, t in flat.tensors])
    assert state["buf"] is live_buf and torch.equal(live_buf, saved["buf"])
    assert state["inner"]["t"] is nested and torch.equal(nested, torch.ones(2, 2))
    assert state["inner"]["keep_list"][0] is list_tensor and list_tensor.item() == 4.0
    assert state["inner"]["keep_list"][1] == 6 and state["inner"]["n"] == 7
    assert state["arr"] is live_arr and np.array_equal(live_arr, np.arange(4))
    assert torch.equal(state["reshaped"], torch.arange(3.0))  # shape changed: replaced
    assert state["step"] == 42 and state["extra"] == "added"


def test_load_into_copies_into_parameters_without_autograd() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    flat = flatten({"p": torch.ones(2)})
    state = {"p": p}
    load_into(state, flat.skeleton, [t.clone() for _, t in flat.tensors])
    assert state["p"] is p and p.requires_grad and torch.equal(p.detach(), torch.ones(2))
    assert p.grad_fn is None


def test_load_into_refuses_keys_missing_from_checkpoint_before_touching_anything() -> None:
    flat = flatten({"a": torch.ones(1), "inner": {"x": 1}})
    live = torch.zeros(1)
    state: dict[str, Any] = {"a": live, "inner": {"x": 0, "y": 0}, "b": 1}
    with pytest.raises(StateError) as info:
        load_into(state, flat.skeleton, [t for _, t in flat.tensors])
    assert "state['inner']['y'], state['b']: not in the checkpoint" in str(info.value)
    assert live.item() == 0.0 and state["inner"]["x"] == 0


def test_load_into_sets_generators_in_place() -> None:
    g = torch.Generator().manual_seed(7)
    flat = flatten({"g": g})
    expected = torch.rand(3, generator=g)
    live = torch.Generator().manual_seed(99)
    state = {"g": live}
    load_into(state, flat.skeleton, [t.clone() for _, t in flat.tensors])
    assert state["g"] is live and torch.equal(torch.rand(3, generator=live), expected)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()


def test_fresh_adam_loads_lazy_state_and_continues_bitwise() -> None:
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt_a = torch.optim.Adam(model_a.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model_a, opt_a, 3, seed=1)

    flat = flatten({"model": model_a, "optim": opt_a, "step": 3})
    skeleton = decode_skeleton(encode_skeleton(flat.skeleton))
    tensors = [t.clone() for _, t in flat.tensors]  # staging copies; never alias the source

    torch.manual_seed(1)
    model_b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-2, weight_decay=0.1)
    assert not opt_b.state  # Adam creates its state lazily on the first step
    params_b = list(model_b.parameters())
    state: dict[str, Any] = {"model": model_b, "optim": opt_b, "step": 0}
    load_into(state, skeleton, tensors)
    assert state["model"] is model_b and state["optim"] is opt_b and state["step"] == 3
    assert all(a is b for a, b in zip(model_b.parameters(), params_b, strict=True))

    _train(model_a, opt_a, 3, seed=2)
    _train(model_b, opt_b, 3, seed=2)
    for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert bits_equal(pa.detach(), pb.detach())


@_SET_VITAL
def test_stateful_dataloader_resumes_with_the_same_batches() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader:
        g = torch.Generator().manual_seed(0)
        return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=g)

    first = loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    flat = flatten({"loader": first})
    expected = [next(it).tolist() for _ in range(4)]

    second = loader()
    state = {"loader": second}
    load_into(state, decode_skeleton(encode_skeleton(flat.skeleton)), [t.clone() for _, t in flat.tensors])
    it2 = iter(second)
    assert [next(it2).tolist() for _ in range(4)] == expected
