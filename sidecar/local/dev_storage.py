"""`strata dev-storage`: the embedded SeaweedFS as a standalone S3 server for trying Strata out.

    strata dev-storage [--dir DIR] [--bucket NAME] [--port N]

Starts SeaweedFS on 127.0.0.1, creates the bucket, prints the settings the sidecar, the trainer and
`strata ls` need (lines to paste into a shell), and stays in the foreground: Ctrl-C or SIGTERM stops
SeaweedFS by its PID. The data stays in DIR, so a second start serves the same checkpoints.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import threading
from pathlib import Path
from typing import Any

from sidecar.errors import CommandFailed
from sidecar.local.seaweed import SeaweedError, SeaweedServer

#: SeaweedFS's usual S3 port: the printed settings stay valid across restarts.
DEFAULT_PORT = 8333
DEFAULT_DIR = ".strata/dev-storage"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

EPILOG = """\
examples:
  strata dev-storage                                  # S3 on 127.0.0.1:8333, bucket strata
  strata dev-storage --dir /tmp/s3 --bucket ckpt --port 0   # any free port
  strata dev-storage --dir .strata/launch/train_ddp/seaweed  # what `strata launch` stored, again
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir", default=DEFAULT_DIR, help=f"data directory, kept after exit (default {DEFAULT_DIR})"
    )
    p.add_argument("--bucket", default="strata", help="bucket to create, if missing (default strata)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"S3 port on 127.0.0.1 (default {DEFAULT_PORT}; 0: any free)",
    )
    p.add_argument("--prefix", default="checkpoints", help="key prefix in the bucket (default checkpoints)")


def settings_lines(storage: str, endpoint: str, job: str = "my-job") -> list[str]:
    """What to paste into the shells of the sidecar, the trainer and `strata ls`."""
    exports = [
        f"export STRATA_STORAGE={shlex.quote(storage)}",
        f"export STRATA_S3_ENDPOINT={shlex.quote(endpoint)}",
    ]
    return [
        *exports,
        "strata sidecar &                           # serves trainers on its default socket",
        f"STRATA_JOB={job} python train.py           # the client finds that socket",
        f"strata ls --job {job}",
    ]


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be a TCP port, 0 to 65535 (0: any free), got {args.port}")
    if not _BUCKET.fullmatch(args.bucket):
        raise ValueError(f"--bucket {args.bucket!r}: expected 3 to 63 lowercase letters, digits, '.' or '-'")
    prefix = args.prefix.strip("/")
    stop = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    data = Path(args.dir)
    server = SeaweedServer(data, log_path=data / "weed.log", s3_port=args.port)
    try:
        try:
            server.start()
            server.create_bucket(args.bucket)
        except SeaweedError as exc:
            hint = " (pass --port N, or --port 0 for any free port)" if "cannot serve" in str(exc) else ""
            raise CommandFailed(str(exc).splitlines()[0] + hint) from None
        storage = f"s3://{args.bucket}/{prefix}" if prefix else f"s3://{args.bucket}"
        print(
            f"SeaweedFS S3 at {server.endpoint} (pid {server.pid}), bucket {args.bucket}, data in "
            f"{server.data_dir}\n\nUse it (paste into each shell):\n"
            + "\n".join(f"  {line}" for line in settings_lines(storage, server.endpoint))
            + f"\n\nCtrl-C stops it (pid {server.pid}); the data stays in {server.data_dir}.",
            flush=True,
        )
        pid = server.pid
        while not stop.wait(0.2):
            code = server.poll()
            if code is not None:
                raise CommandFailed(f"SeaweedFS (pid {pid}) exited with status {code}; see {server.log_path}")
        print(f"stopping SeaweedFS (pid {pid})", flush=True)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
