"""A fresh venv with exactly what deploy/Dockerfile installs (no torch) runs `strata sidecar` and
`strata operator`.

The venv gets the project built from the files the Dockerfile's builder stage copies, installed with
the same requirement (``.[operator]``), non-editable, so source changes are always what runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import kmock
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.k8s.conftest import write_kubeconfig
from tests.k8s.emulator import Emulator
from tests.unit.test_dockerfile import stages

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def builder_copies() -> tuple[list[str], str]:
    """What the builder stage (the one the final stage copies its venv from) COPYs from the build
    context, and the requirement it installs (``.[operator]``)."""
    all_stages = dict(stages(DOCKERFILE.read_text()))
    final = stages(DOCKERFILE.read_text())[-1][1]
    [source] = {a.split()[0].removeprefix("--from=") for w, a in final if w == "COPY" and "--from=" in a}
    sources: list[str] = []
    requirement = ""
    for word, args in all_stages[source]:
        if word == "COPY" and not args.startswith("--"):
            sources += args.split()[:-1]
        if word == "RUN" and "pip install" in args:
            requirement = args.split("pip install", 1)[1].split("&&")[0].split()[-1].strip("\"'")
    assert sources and requirement.startswith(".["), (sources, requirement)
    return sources, requirement


def build_context(dest: Path) -> Path:
    """The files the builder stage copies, as the build context holds them (no caches)."""
    sources, _ = builder_copies()
    dest.mkdir(parents=True)
    for name in sources:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


UV = Path(sys.executable).with_name("uv")
#: The image's USER: a uid with no passwd entry (nothing may ask for a user name). As root, the
#: processes below run as it, on the system's Python 3.11 (this venv's interpreter lives under
#: /root, which that user cannot enter); otherwise as whoever runs the tests.
IMAGE_UID = 65532
SYSTEM_PYTHON = "/usr/bin/python3.11"
AS_ROOT = os.geteuid() == 0 and os.access(SYSTEM_PYTHON, os.X_OK)
AS_IMAGE_USER: dict[str, int] = {"user": IMAGE_UID, "group": IMAGE_UID} if AS_ROOT else {}
INTERPRETER = SYSTEM_PYTHON if AS_ROOT else sys.executable


def uv(*args: str, timeout: float = 300) -> None:
    result = subprocess.run([str(UV), *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"uv {' '.join(args)} failed:\n{result.stderr[-3000:]}")


@pytest.fixture(scope="session")
def image_venv() -> Iterator[Path]:
    """A fresh venv with the Dockerfile's requirement (``.[operator]``), installed non-editable from
    the files its builder stage copies. uv resolves and installs it (a few seconds; pip takes
    40-80 s on this machine to resolve ~45 packages), from the same index pip would use."""
    if not UV.is_file():
        pytest.fail(f"{UV} not found: `make setup` installs uv (the dev extra)")
    t0 = time.monotonic()
    # Readable by the image's user (pytest's own temp dirs are 0700, root's)
    base = Path(tempfile.mkdtemp(prefix="strata-image-", dir="/tmp"))
    base.chmod(0o755)
    _, requirement = builder_copies()
    context = build_context(base / "src")
    venv = base / "venv"
    uv("venv", "-q", "--python", INTERPRETER, str(venv))
    uv("pip", "install", "-q", "--python", str(venv / "bin" / "python"), f"{context}{requirement[1:]}")
    print(f"image venv ready in {time.monotonic() - t0:.1f} s")
    yield venv
    shutil.rmtree(base, ignore_errors=True)


def owned_dir(prefix: str) -> Path:
    """A private directory of the image's user, as its emptyDir volumes are."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # a unix socket path fits in 107 bytes
    if AS_IMAGE_USER:
        os.chown(path, IMAGE_UID, IMAGE_UID)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(venv: Path, home: Path) -> dict[str, str]:
    """Only the venv on PATH, no PYTHONPATH: nothing from the checkout or the dev venv leaks in."""
    return {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def run_in(venv: Path, *code: str) -> subprocess.CompletedProcess[str]:
    # cwd: not the checkout, which `python -c` would put first on sys.path.
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", "\n".join(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=venv,
        env=clean_env(venv, venv),
    )


def test_the_venv_has_no_torch_and_the_operator_extra(image_venv: Path) -> None:
    no_torch = run_in(image_venv, "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    imports = run_in(
        image_venv,
        "import kopf, kubernetes, sidecar.operator.run, sidecar.server, sidecar.store.s3, sidecar.cli",
        "import sidecar, os; print(sidecar.__file__)",
    )
    assert imports.returncode == 0, imports.stderr
    # Not editable: the code runs from the venv, not from the checkout.
    assert Path(imports.stdout.strip()).is_relative_to(image_venv), imports.stdout


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = owned_dir("si-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_strata_sidecar_serves(image_venv: Path, short_dir: Path) -> None:
    socket_path = short_dir / "sidecar.sock"
    metrics_port = free_port()
    env = clean_env(image_venv, short_dir)
    (short_dir / "shm").mkdir()
    if AS_IMAGE_USER:
        os.chown(short_dir / "shm", IMAGE_UID, IMAGE_UID)
    process = subprocess.Popen(
        [
            str(image_venv / "bin" / "strata"),
            "sidecar",
            *("--storage", f"file://{short_dir}/store", "--socket", str(socket_path)),
            *("--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"),
            *("--shm-dir", str(short_dir / "shm")),
        ],
        env=env,
        cwd=short_dir,
        **AS_IMAGE_USER,  # type: ignore[arg-type]
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        metrics = ""
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[0]
            try:
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                metrics = urllib.request.urlopen(url, timeout=2).read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert "strata_" in metrics, "the sidecar's /metrics did not answer"
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
        assert process.returncode == 0, out
        assert "ready on unix:" in out, out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@contextlib.asynccontextmanager
async def operator_process(
    venv: Path, home: Path
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int, list[str]]]:
    """`strata operator` from ``venv`` against an emulated API (served on this loop): (process, report
    port, metrics port, its log lines so far). Killed at exit if still running."""
    report_port, metrics_port = free_port(), free_port()
    async with Emulator() as api, kmock.Server(api) as server:
        kubeconfig = write_kubeconfig(home / "kubeconfig", str(server.url).rstrip("/"))
        process = await asyncio.create_subprocess_exec(
            str(venv / "bin" / "strata"),
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--report-host",
            "127.0.0.1",
            "--report-port",
            str(report_port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
            env=clean_env(venv, home),
            cwd=home,
            **AS_IMAGE_USER,  # type: ignore[arg-type]
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        log: list[str] = []

        async def read() -> None:
            assert process.stdout is not None
            async for line in process.stdout:
                log.append(line.decode(errors="replace"))

        reader = asyncio.create_task(read())
        try:
            yield process, report_port, metrics_port, log
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def until_ready(process: asyncio.subprocess.Process, report_port: int, log: list[str]) -> str:
    """/healthz on the report port answers and the operator logged that it is ready: the body."""
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            assert process.returncode is None, "".join(log)
            try:
                async with session.get(f"http://127.0.0.1:{report_port}/healthz") as response:
                    if response.status == 200 and any("operator ready" in line for line in log):
                        return await response.text()
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    pytest.fail(f"no /healthz answer and ready line:\n{''.join(log)}")


@pytest.mark.asyncio
async def test_strata_operator_serves_against_the_emulated_api(image_venv: Path, short_dir: Path) -> None:
    async with operator_process(image_venv, short_dir) as (process, report_port, metrics_port, log):
        assert await until_ready(process, report_port, log)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response,
        ):
            assert response.status == 200
            assert "strata_operator_watched_jobs" in await response.text()


@pytest.mark.asyncio
async def test_strata_operator_exits_on_sigterm(image_venv: Path, short_dir: Path) -> None:
    async with operator_process(image_venv, short_dir) as (process, report_port, _, log):
        await until_ready(process, report_port, log)
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            pytest.fail(f"strata operator did not exit within 10 s of SIGTERM:\n{''.join(log)}")
        assert process.returncode == 0, "".join(log)
        await asyncio.sleep(0.2)  # the reader drains the last lines
        assert any("stopped" in line for line in log), "".join(log)
