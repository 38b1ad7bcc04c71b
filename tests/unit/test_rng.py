"""trainer_client._rng: the global generators survive capture -> flatten/JSON/rebuild -> restore."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from trainer_client import _rng
from trainer_client._tree import decode_skeleton, encode_skeleton, flatten, load_into, rebuild


def draw() -> tuple[list[float], list[float], list[float], list[float]]:
    return (
        [random.random() for _ in range(3)],
        [random.gauss(0, 1)],  # leaves a cached gauss_next (a float) in Python's state
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
    )


def through_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    flat = flatten({"rng": state})
    skeleton = decode_skeleton(encode_skeleton(flat.skeleton))
    return rebuild(skeleton, [t.clone() for _, t in flat.tensors])["rng"]


def test_capture_restore_replays_every_stream() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw()
    saved = _rng.capture()
    expected = draw()
    draw()  # move every stream on
    _rng.restore(saved)
    assert draw() == expected


def test_state_survives_the_checkpoint_encoding() -> None:
    random.seed(4)
    np.random.seed(5)
    torch.manual_seed(6)
    random.gauss(0, 1)
    np.random.standard_normal()  # numpy caches a gaussian too
    restored = through_checkpoint(_rng.capture())
    assert type(restored["python"]) is tuple and type(restored["python"][1]) is tuple
    assert restored["numpy"][1].dtype == np.uint32
    expected = draw()
    _rng.restore(restored)
    assert draw() == expected


def test_state_survives_json() -> None:
    """The form torch.distributed.checkpoint's route stores every rank's streams in (one JSON
    string): every stream, cached gaussians included, replays exactly."""
    random.seed(7)
    np.random.seed(8)
    torch.manual_seed(9)
    random.gauss(0, 1)
    np.random.standard_normal()
    text = json.dumps(_rng.to_json(_rng.capture()), allow_nan=False)
    expected = draw()
    draw()
    _rng.restore(_rng.from_json(json.loads(text)))
    assert draw() == expected
    with pytest.raises(ValueError, match="unknown keys"):
        _rng.from_json({"pyhton": []})


def test_rng_state_as_a_stateful_entry() -> None:
    torch.manual_seed(7)
    flat = flatten({"rng": _rng.RNGState()})
    expected = draw()
    load_into({"rng": _rng.RNGState()}, flat.skeleton, [t.clone() for _, t in flat.tensors])
    assert draw() == expected


def test_cuda_state_only_once_cuda_is_initialized() -> None:
    state = _rng.capture()
    initialized = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert ("cuda" in state) == initialized


def test_cuda_state_without_cuda_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    state = _rng.capture()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with caplog.at_level(logging.WARNING, logger=_rng.__name__):
        _rng.restore(state)
    assert "CUDA is unavailable" in caplog.text


def test_missing_streams_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    state = _rng.capture()
    del state["numpy"]
    with caplog.at_level(logging.WARNING, logger=_rng.__name__):
        _rng.restore(state)
    assert "no numpy RNG state" in caplog.text


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        _rng.restore({"python": random.getstate(), "jax": 1})
