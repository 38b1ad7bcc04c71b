"""`strata dev-storage`: a local S3 server with its bucket, the settings to paste, stopped by PID."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

STRATA = str(Path(sys.executable).parent / "strata")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_dev_storage_serves_a_bucket_prints_its_settings_and_stops_by_pid(tmp_path):
    proc = subprocess.Popen(
        [STRATA, "dev-storage", "--dir", str(tmp_path / "s3"), "--bucket", "ckpt", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C stops it"):
                break
        text = "".join(lines)
        pid = int(re.search(r"\(pid (\d+)\)", text).group(1))  # type: ignore[union-attr]
        exports = dict(re.findall(r"^  export (STRATA_[A-Z0-9_]+)=(\S+)$", text, re.M))
        assert exports["STRATA_STORAGE"] == "s3://ckpt/checkpoints", text
        assert exports["STRATA_S3_ENDPOINT"].startswith("http://127.0.0.1:"), text
        assert "strata ls --job my-job" in text
        # the bucket exists: `strata ls` with exactly those settings answers, no NoSuchBucket
        listed = subprocess.run(
            [STRATA, "ls", "--job", "my-job"],
            env={**_env(), **exports},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert "no committed checkpoints for default/my-job" in listed.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert _gone(pid), f"weed (pid {pid}) still runs"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # closes the pipes


def test_dev_storage_on_a_taken_port_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [STRATA, "dev-storage", "--dir", str(tmp_path / "s3"), "--port", str(port)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"strata dev-storage: cannot serve S3 on 127.0.0.1:{port}: Address already in use "
        "(pass --port N, or --port 0 for any free port)"
    ]


def test_dev_storage_refuses_a_bad_bucket_name(tmp_path):
    out = subprocess.run(
        [STRATA, "dev-storage", "--dir", str(tmp_path / "s3"), "--bucket", "No"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "strata dev-storage: --bucket 'No': expected 3 to 63 lowercase letters, digits, '.' or '-'"
    ]
