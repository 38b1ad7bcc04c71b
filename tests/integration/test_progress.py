"""Long operations show progress on stderr when it is a terminal, and nothing when it is not."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import torch

STRATA = str(Path(sys.executable).parent / "strata")


def _run(argv: list[str], tty: bool) -> tuple[int, str, str]:
    """Run with stdout a pipe and stderr a terminal (``tty``) or a pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    if not tty:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, env=env)
        os.close(follower)
        err = bytearray()
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(leader)
    return proc.returncode, out.decode(), err.decode(errors="replace")


def test_verify_shows_a_bar_on_a_terminal_only(make_sidecar, make_client, job_name):
    server = make_sidecar(None, object_bytes=1024)
    client = make_client(server, job_name, capture_rng=False)
    assert client.save(1, {"w": torch.arange(2000.0)}).durable.result(30).step == 1
    argv = [STRATA, "verify", "--storage", server.settings.storage, "--job", job_name]
    code, out, err = _run(argv, tty=True)
    assert code == 0, out + err
    assert out.splitlines() == ["step 1: OK (8 objects, 7.8 KiB)"]  # stdout stays parseable
    assert "verify step 1:   0%|" in err, repr(err)  # tqdm on stderr
    code, out, err = _run(argv, tty=False)
    assert code == 0 and out.splitlines() == ["step 1: OK (8 objects, 7.8 KiB)"]
    assert err == ""
