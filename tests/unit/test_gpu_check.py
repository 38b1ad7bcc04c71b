"""``make gpu-check`` (tests/bench/gpu_check.py): a clean skip without CUDA, its sizing, and its
plumbing run on the CPU with CUDA's calls stubbed (the measurement itself needs a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.bench import gpu_check
from tests.bench.common import GiB, MiB

KEYS = (
    "gpu_save_stall_s",
    "gpu_memcpy_same_bytes_s",
    "gpu_save_stall_ratio",
    "gpu_overlapped_step_cost_s",
    "gpu_device",
)


def test_without_cuda_it_skips_and_writes_no_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "bench-results.json"
    results.write_text('{"memcpy_s": 0.08}\n')
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--results", str(results)]) == 0
    assert capsys.readouterr().out == gpu_check.SKIP_NO_CUDA + "\n"
    assert results.read_text() == '{"memcpy_s": 0.08}\n'
    missing = tmp_path / "none.json"
    assert gpu_check.main(["--results", str(missing)]) == 0
    assert not missing.exists()


def test_without_torch_it_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert gpu_check.main(["--results", str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out.startswith("gpu-check: skipped: no CUDA device (no torch in ")
    assert not (tmp_path / "r.json").exists()


def test_the_state_is_sized_down_to_fit_gpu_and_host_memory() -> None:
    asked = 10 * GiB
    assert gpu_check.plan_bytes(asked, 80 * GiB, 128 * GiB) == asked
    assert gpu_check.plan_bytes(asked, 8 * GiB, 128 * GiB) == 8 * GiB - gpu_check.GPU_HEADROOM
    assert gpu_check.plan_bytes(asked, 80 * GiB, 12 * GiB) == 6 * GiB
    assert gpu_check.plan_bytes(asked, GiB, 128 * GiB) == 0
    assert gpu_check.plan_bytes(asked, 80 * GiB + 12345, 128 * GiB) % MiB == 0
    state = gpu_check.build_state(asked, "meta")
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    assert asked - 4096 < nbytes <= asked
    assert len(state) == gpu_check.BIG_TENSORS + gpu_check.SMALL_TENSORS


def test_its_figures_are_written_with_cuda_stubbed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plumbing on the CPU: every key written, the ratio the two medians', the staged bytes
    the state's at the save call although the loop updates it in place."""
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "MATMUL_N", 32)
    monkeypatch.setattr(gpu_check, "BIG_TENSORS", 4)
    monkeypatch.setattr(gpu_check, "SMALL_TENSORS", 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "stub GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (80 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: SimpleNamespace(synchronize=lambda: None))
    results = tmp_path / "bench-results.json"
    argv = ["--size-gib", str(1 / 1024), "--repeats", "1", "--steps", "4", "--step-ms", "1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds its wake-ups
    try:
        assert gpu_check.main([*argv, "--results", str(results)]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads(results.read_text())
    assert set(KEYS) <= set(figures)
    assert figures["gpu_device"] == "stub GPU"
    assert figures["gpu_state_gib"] == pytest.approx(1 / 1024)
    ratio = figures["gpu_save_stall_s"] / figures["gpu_memcpy_same_bytes_s"]
    assert figures["gpu_save_stall_ratio"] == pytest.approx(ratio)
    assert figures["gpu_staged_exact"] == 1
    out = capsys.readouterr().out
    assert "gpu_save_stall_ratio" in out and "stub GPU" in out
