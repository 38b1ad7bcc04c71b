"""Wrong flags and variables, as an operator types them: the `strata` command exits 2 with one
line naming the flag or variable, never a traceback, and never disturbs a sidecar already serving."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from sidecar.api import PROTOCOL_VERSION, pb, pb_grpc

STRATA = str(Path(sys.executable).parent / "strata")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING) ")


def strata(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, stdout: Any = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_", "KUBE"))}
    clean.update(env or {})
    return subprocess.run(
        [STRATA, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=clean, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def assert_one_line_error(out: subprocess.CompletedProcess[str], command: str, *names: str) -> None:
    """Exit 2 and, besides the progress the command logs, exactly one line: the error, naming ``names``."""
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = [line for line in out.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"strata {command}: "), out.stderr
    for name in names:
        assert name in lines[0], out.stderr


def sidecar_flags(tmp: Path, **overrides: str) -> list[str]:
    flags = {
        "--storage": f"file://{tmp}/store",
        "--socket": str(tmp / "s.sock"),
        "--shm-dir": str(tmp),
        "--metrics-port": "0",
    }
    flags.update(overrides)
    return [item for pair in flags.items() for item in pair]


def redundancy(tmp: Path) -> dict[str, str]:
    members = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    port = members.split(",")[0].split(":")[1]
    return {"--redundancy": "buddy", "--peer-port": port, "--members": members, "--member-index": "0"}


# Each: extra flags (with "{tmp}" for the test's directory), the flag the error must name.
BAD_SIDECAR_FLAGS = [
    ({"--tcp-port": "70000", "--token": "t"}, "--tcp-port"),
    ({"--peer-port": "70000"}, "--peer-port"),
    ({"--peer-port": "-1"}, "--peer-port"),
    ({"--metrics-port": "70000"}, "--metrics-port"),
    ({"--commit-timeout-s": "-5"}, "--commit-timeout-s"),
    ({"--commit-timeout-s": "nan"}, "--commit-timeout-s"),
    ({"--keep": "-1"}, "--keep"),
    ({"--keep": "-3"}, "--keep"),
    ({"--socket": "{tmp}/a-file"}, "--socket"),  # exists and is not a socket
    ({"--socket": "{tmp}/a-file/s.sock"}, "--socket"),  # its directory cannot be created
    ({"--redundancy-dir": "{tmp}/a-file/red"}, "--redundancy-dir"),
    ({"--generation-file": "{tmp}/no-such-file"}, "--generation-file"),
]


@pytest.mark.parametrize(
    ("flags", "name"),
    BAD_SIDECAR_FLAGS,
    ids=[" ".join(f"{k} {v}" for k, v in f.items()) for f, _ in BAD_SIDECAR_FLAGS],
)
def test_a_bad_sidecar_flag_is_one_line_naming_it(short_tmp, flags, name):
    (short_tmp / "a-file").write_text("not a socket")
    extra = {k: v.replace("{tmp}", str(short_tmp)) for k, v in flags.items()}
    if name == "--redundancy-dir":
        extra = {**redundancy(short_tmp), **extra}
    out = strata("sidecar", *sidecar_flags(short_tmp, **extra), timeout=30)
    assert_one_line_error(out, "sidecar", name)
    assert "ready" not in out.stdout
    assert (short_tmp / "a-file").read_text() == "not a socket"


@pytest.mark.parametrize(
    ("flags", "env", "name"),
    [
        (["--keep", "-3"], {}, "--keep"),
        (["--tcp-port", "70000", "--token", "t"], {}, "--tcp-port"),
        ([], {"STRATA_COMMIT_TIMEOUT_S": "nan"}, "STRATA_COMMIT_TIMEOUT_S"),
        ([], {"STRATA_KEEP": "-1"}, "STRATA_KEEP"),
    ],
)
def test_print_config_refuses_what_the_sidecar_would_refuse(short_tmp, flags, env, name):
    out = strata("sidecar", "--print-config", "--storage", f"file://{short_tmp}/s", *flags, env=env)
    assert_one_line_error(out, "sidecar", name)
    assert out.stdout == ""


def test_a_misspelt_variable_is_named_with_the_one_meant(short_tmp):
    env = {"STRATA_UPLOAD_CONCURENCY": "8", "STRATA_STORAGE": f"file://{short_tmp}/s"}
    out = strata("sidecar", "--print-config", env=env)
    assert out.returncode == 0, out.stderr
    assert "STRATA_UPLOAD_CONCURENCY" in out.stderr and "STRATA_UPLOAD_CONCURRENCY" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_operator_without_a_kubeconfig_names_it(short_tmp):
    missing = strata("operator", "--kubeconfig", str(short_tmp / "no-kubeconfig"), timeout=60)
    assert_one_line_error(missing, "operator", "--kubeconfig", str(short_tmp / "no-kubeconfig"))
    # Not in a pod, no $KUBECONFIG, no ~/.kube/config.
    nothing = strata("operator", env={"HOME": str(short_tmp)}, timeout=60)
    assert_one_line_error(nothing, "operator", "--kubeconfig")


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--storage", "ftp://x"], "--storage"),
        (["--keep", "-1"], "--keep"),
        (["--backoff-s", "nan"], "--backoff-s"),
    ],
)
def test_launch_with_a_bad_flag_names_it_before_starting_anything(short_tmp, flags, name):
    out = strata("launch", "--nproc", "1", "--workdir", str(short_tmp / "w"), *flags, "--", "true")
    assert_one_line_error(out, "launch", name, flags[1])
    assert not (short_tmp / "w").exists()  # refused before anything started


@pytest.mark.parametrize("command", ["show", "ls"])
def test_output_cut_short_by_a_closed_pipe_is_no_traceback(make_sidecar, make_client, job_name, command):
    """`strata show | head -1`: the reader goes away before the output is written."""
    server = make_sidecar()
    client = make_client(server, job_name, capture_rng=False)
    assert client.save(1, {"w": torch.arange(10.0)}).durable.result(30).step == 1
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    proc = subprocess.Popen(
        [STRATA, command, "--storage", server.settings.storage, "--job", job_name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # every write of the command now finds no reader
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert err == ""


def test_a_second_sidecar_on_a_live_socket_refuses_and_leaves_the_first_serving(make_sidecar, short_tmp):
    first = make_sidecar()
    with socket.create_server(("127.0.0.1", 0)) as busy:  # and the metrics port taken as well
        out = strata(
            "sidecar",
            *sidecar_flags(
                short_tmp,
                **{"--socket": first.socket_path, "--metrics-port": str(busy.getsockname()[1])},
            ),
            timeout=30,
        )
    assert_one_line_error(out, "sidecar", "--socket", first.socket_path)
    with grpc.insecure_channel(f"unix:{first.socket_path}") as channel:
        stub = pb_grpc.CheckpointerStub(channel)
        stub.Handshake(pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
