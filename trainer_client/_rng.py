"""Capture and restore the process-wide random number generators.

A resumed run must draw the same random numbers (dropout masks, augmentations, sampling) as
the run it continues, so the global Python, numpy and torch streams travel with the
checkpoint. The captured dict holds only types ``_tree`` can encode without pickle: Python's
state is a tuple of ints (plus None or a float), numpy's a tuple holding a uint32 array, and
torch's are uint8 tensors.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

try:
    import numpy as np
except ModuleNotFoundError:  # torch runs without numpy; then there is no numpy stream to keep
    np = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_KEYS = ("python", "numpy", "torch", "cuda")


@contextmanager
def kept_global_rng() -> Iterator[None]:
    """Run the body without moving the global Python, numpy and torch CPU generators."""
    py = random.getstate()
    cpu = torch.get_rng_state()
    npy = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if np is not None:
            np.random.set_state(npy)


def capture() -> dict[str, Any]:
    """The current state of every global generator in this process.

    CUDA generators are captured only once CUDA is initialized: querying them earlier would
    initialize CUDA (a context per device) as a side effect of checkpointing.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Mapping[str, Any]) -> None:
    """Set the global generators back to ``state`` (from :func:`capture`, possibly after a
    flatten/rebuild round trip). Streams the checkpoint lacks, or that this process cannot
    hold (no numpy, no CUDA, fewer GPUs), are logged and left alone."""
    unknown = set(state) - set(_KEYS)
    if unknown:
        raise ValueError(f"RNG state has unknown keys {sorted(unknown)}; expected some of {list(_KEYS)}")
    if "python" in state:
        random.setstate(state["python"])
    else:
        log.warning("checkpoint holds no Python RNG state; the random module is not restored")
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    else:
        log.warning("checkpoint holds no torch RNG state; the torch CPU generator is not restored")
    if "numpy" in state:
        if np is None:
            log.warning("checkpoint holds numpy RNG state but numpy is not installed; skipped")
        else:
            np.random.set_state(state["numpy"])
    elif np is not None:
        log.warning("checkpoint holds no numpy RNG state; numpy's global generator is not restored")
    if "cuda" in state:
        _restore_cuda(list(state["cuda"]))


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        log.warning("checkpoint holds CUDA RNG state for %d devices but CUDA is unavailable", len(states))
        return
    count = torch.cuda.device_count()
    if count != len(states):
        log.warning(
            "checkpoint holds CUDA RNG state for %d devices, this process sees %d; restoring the first %d",
            len(states),
            count,
            min(count, len(states)),
        )
    for index, s in enumerate(states[:count]):
        torch.cuda.set_rng_state(s.cpu(), index)


class RNGState:
    """Stateful adapter, so the global generators can sit in a state dict like a model:
    ``state["rng"] = RNGState()``."""

    def state_dict(self) -> dict[str, Any]:
        return capture()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        restore(state)


def to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (from :func:`capture`) as plain JSON values: what a checkpoint that stores no
    tensors of it (torch.distributed.checkpoint's route: every rank's streams in one replicated
    string) can hold. :func:`from_json` inverts it exactly."""
    out: dict[str, Any] = {}
    if "python" in state:
        version, internal, gauss = state["python"]
        out["python"] = [version, list(internal), gauss]
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"][:5]
        out["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    if "torch" in state:
        out["torch"] = _b64(state["torch"])
    if "cuda" in state:
        out["cuda"] = [_b64(t) for t in state["cuda"]]
    return out


def from_json(value: Mapping[str, Any]) -> dict[str, Any]:
    """The :func:`capture` dict that :func:`to_json` made ``value`` from."""
    unknown = set(value) - set(_KEYS)
    if unknown:
        raise ValueError(f"RNG state has unknown keys {sorted(unknown)}; expected some of {list(_KEYS)}")
    state: dict[str, Any] = {}
    if "python" in value:
        version, internal, gauss = value["python"]
        state["python"] = (version, tuple(internal), gauss)
    if "numpy" in value:
        name, keys, pos, has_gauss, cached = value["numpy"]
        if np is None:
            state["numpy"] = None  # restore() says it is skipped
        else:
            state["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    if "torch" in value:
        state["torch"] = _unb64(value["torch"])
    if "cuda" in value:
        state["cuda"] = [_unb64(t) for t in value["cuda"]]
    return state


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
