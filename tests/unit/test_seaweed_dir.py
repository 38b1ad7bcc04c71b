"""A data directory a SeaweedFS still serves (a run kept with --keep-storage, or strata
dev-storage) is not served twice: the second start is one line naming the pid to stop."""

from __future__ import annotations

import subprocess
import time

import pytest

from sidecar.local.seaweed import SeaweedError, SeaweedServer


def test_a_directory_still_served_is_refused_naming_the_pid(tmp_path, monkeypatch):
    monkeypatch.setattr("sidecar.local.seaweed.find_weed", lambda: "weed")
    # a process whose argv[0] is "weed", as a kept SeaweedFS would be
    other = subprocess.Popen(["bash", "-c", "exec -a weed sleep 30"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{other.pid}/cmdline", "rb") as f:
                if f.read().startswith(b"weed\0"):
                    break
            time.sleep(0.01)
        (tmp_path / "weed.pid").write_text(f"{other.pid}\n")
        server = SeaweedServer(tmp_path)
        assert server.serving() == other.pid
        with pytest.raises(
            SeaweedError, match=rf"still served by SeaweedFS pid {other.pid}.*kill {other.pid}"
        ):
            server.start()
    finally:
        other.kill()
        other.wait()
    assert SeaweedServer(tmp_path).serving() == 0  # gone: the directory may be served again
