"""Progress bars: on stderr where it is a terminal, never elsewhere; on a long streamed restore in
the trainer and while `strata import` reads a DCP checkpoint."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from sidecar.api import pb, progress
from trainer_client import _receive, import_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save, one process


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_where_stderr_is_not_a_terminal(capsys):
    with progress.bar(100, "work") as shown:
        shown.update(100)
    assert capsys.readouterr().err == ""


def _restore(total: int) -> None:
    meta = pb.TensorMeta(name="t", dtype="uint8", shape=[total], nbytes=total, offset=0)
    header = pb.RestoreHeader(step=9, tensors=[meta], total_bytes=total, source="storage")
    stream = [pb.RestoreResponse(header=header)] + [
        pb.RestoreResponse(chunk=bytes(1000)) for _ in range(total // 1000)
    ]
    _receive.receive(iter(stream))


def test_a_long_restore_shows_a_bar_on_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(_receive, "SHOWN_RESTORE_BYTES", 4000)
    _restore(3000)  # short: no bar
    assert terminal.getvalue() == ""
    _restore(5000)
    assert "restore step 9:" in terminal.getvalue()


def test_import_reads_with_a_bar_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp.save({"w": torch.arange(100.0)}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    metadata = import_dcp.read_metadata(tmp_path)
    items = import_dcp.read_items(tmp_path, metadata)
    assert capsys.readouterr().err == ""
    assert import_dcp.read_items(tmp_path, metadata, show=True).keys() == items.keys()
    assert "import: read" in capsys.readouterr().err
