"""The `strata` command as users run it: a subprocess, its exit status and its output."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar import manifest as mf

STRATA = str(Path(sys.executable).parent / "strata")
WHEN = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def strata(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the CLI with the caller's environment minus any STRATA_*/AWS_* settings, plus `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "AWS_"))}
    clean.update(env or {})
    return subprocess.run(
        [STRATA, *args], capture_output=True, text=True, env=clean, timeout=timeout, check=False
    )


def state(scale: float) -> dict[str, Any]:
    return {"w": torch.arange(1000.0) * scale, "b": torch.full((7,), scale, dtype=torch.float64)}


# Shared-memory saves keep the staging layout: each tensor at a 64-byte aligned offset.
SNAPSHOT_BYTES = 4032 + 7 * 8  # "4.0 KiB" in the CLI's units


def populate(make_sidecar: Any, make_client: Any, job: str, storage: str | None = None, **opts: Any) -> Any:
    """Commit steps 1 and 2 of `job`, each cut into several objects; returns the sidecar."""
    server = make_sidecar(storage, object_bytes=1024, **opts)
    client = make_client(server, job, capture_rng=False)
    for step in (1, 2):
        assert client.save(step, state(step)).durable.result(30).step == step
    return server


def object_path(server: Any, job: str, step: int, index: int) -> tuple[str, Path]:
    commit = mf.read_commit(server.store, "default", job, step)
    key = mf.load_manifest(server.store, commit, 0).objects[index].key
    root = Path(server.settings.storage.removeprefix("file://"))
    return key, root / key


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- help and configuration --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "example"),
    [
        ("sidecar", "strata sidecar --storage s3://ckpt/prod --s3-endpoint http://127.0.0.1:8333"),
        ("ls", "strata ls   --storage s3://ckpt/prod"),
        ("show", "strata show --storage file:///var/lib/strata --job recsys --step 120 --rank 0"),
        ("verify", "strata verify --storage file:///var/lib/strata --job recsys --all"),
        ("export", "strata export --storage file:///var/lib/strata --job llm --format dcp --out"),
    ],
)
def test_help_of_each_subcommand_shows_examples(command, example):
    out = strata(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: strata {command}")
    assert "\nexamples:\n" in out.stdout
    assert example in out.stdout
    assert "--storage" in out.stdout


def test_top_level_help_lists_the_commands_and_version_works():
    out = strata("--help")
    assert out.returncode == 0, out.stderr
    for command in ("sidecar", "ls", "show", "verify"):
        assert re.search(rf"^\s+{command}\s+\S", out.stdout, re.M), command
    version = strata("--version")
    assert version.returncode == 0 and re.fullmatch(r"strata \S+\n", version.stdout), version


def test_print_config_takes_flags_over_env_over_defaults_and_redacts_the_token(short_tmp):
    env = {
        "STRATA_STORAGE": f"file://{short_tmp}/from-env",
        "STRATA_METRICS_PORT": "1111",  # overridden by the flag below
        "STRATA_UPLOAD_CONCURRENCY": "7",
        "STRATA_S3_ENDPOINT": "http://127.0.0.1:8333",
        "STRATA_TOKEN": "hunter2-secret",
    }
    out = strata("sidecar", "--print-config", "--metrics-port", "2222", "--socket-mode", "0o660", env=env)
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout + out.stderr
    config = json.loads(out.stdout)
    assert config["storage"] == f"file://{short_tmp}/from-env"  # env
    assert config["metrics_port"] == 2222  # flag beats env
    assert config["upload_concurrency"] == 7  # env beats default
    assert config["s3_endpoint"] == "http://127.0.0.1:8333"  # its env name has no extra prefix
    assert config["socket_mode"] == "0o660"  # flags read octal, printed octal
    assert config["object_bytes"] == 64 << 20 and config["tcp_port"] == 0  # defaults
    assert config["token"] == "***"
    assert not (short_tmp / "from-env").exists()  # printing the config touches nothing
    # No token anywhere: shown empty, not as ***.
    plain = strata("sidecar", "--print-config", env={"STRATA_STORAGE": "file:///x"})
    assert plain.returncode == 0 and json.loads(plain.stdout)["token"] == ""


def test_a_bad_env_value_names_the_variable():
    out = strata("sidecar", "--print-config", env={"STRATA_METRICS_PORT": "ninety"})
    assert out.returncode != 0
    assert "STRATA_METRICS_PORT" in out.stderr and "'ninety'" in out.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["sidecar", "--print-config"], {"STRATA_METRICS_PORT": "ninety"}, "STRATA_METRICS_PORT='ninety'"),
        (["ls", "--storage", "s3://x", "--job", "j"], {}, "bad store url 's3://x'"),
    ],
)
def test_bad_values_are_one_line_errors_not_tracebacks(args, env, message):
    out = strata(*args, env=env)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"strata {args[0]}: ") and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nice", "25"], "--nice must be between 0 and 19, got 25"),
        (["--policy", "sometimes"], "--policy: checkpoint policy 'sometimes' is not one of"),
        (["--quantize", "5"], "--quantize '5' is not one of"),
    ],
)
def test_bad_sidecar_settings_exit_naming_the_setting(short_tmp, flags, message):
    out = strata(
        "sidecar", "--storage", f"file://{short_tmp}/s", "--socket", str(short_tmp / "s.sock"), *flags
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (short_tmp / "s.sock").exists()


def test_sidecar_without_storage_exits_naming_the_flag(short_tmp):
    out = strata("sidecar", "--socket", str(short_tmp / "s.sock"), timeout=30)
    assert out.returncode != 0
    assert "--storage" in out.stderr and "STRATA_STORAGE" in out.stderr
    assert not (short_tmp / "s.sock").exists()


def test_tcp_without_a_token_exits_naming_the_token(short_tmp):
    args = ["sidecar", "--storage", f"file://{short_tmp}/store", "--socket", str(short_tmp / "s.sock")]
    out = strata(*args, "--tcp-port", str(free_port()), "--metrics-port", "0", timeout=30)
    assert out.returncode != 0
    assert "--token" in out.stderr and "STRATA_TOKEN" in out.stderr
    assert "ready" not in out.stdout


# --- inspecting a store ------------------------------------------------------------------------


def test_ls_show_and_verify_a_file_store(make_sidecar, make_client, job_name):
    server = populate(make_sidecar, make_client, job_name)
    store = ["--storage", server.settings.storage, "--job", job_name]

    ls = strata("ls", *store)
    assert ls.returncode == 0, ls.stderr
    lines = ls.stdout.splitlines()
    assert lines[0].split() == ["STEP", "RANKS", "SIZE", "COMMITTED"]
    assert len(lines) == 3, ls.stdout
    for line, step in zip(lines[1:], (1, 2), strict=True):
        assert re.fullmatch(rf"\s+{step}\s+1\s+4\.0 KiB\s+{WHEN}", line), line

    show = strata("show", *store)  # newest step
    assert show.returncode == 0, show.stderr
    assert re.search(rf"^job\s+default/{job_name}$", show.stdout, re.M), show.stdout
    assert re.search(r"^step\s+2\s+\(rank 0 of 1, attempt 0, save \S+\)$", show.stdout, re.M), show.stdout
    assert re.search(r"^format\s+v\d+; 4 objects, 4\.0 KiB$", show.stdout, re.M), show.stdout
    rows = {line.split()[0]: line.split() for line in show.stdout.splitlines() if "float" in line}
    assert rows == {
        "w": ["w", "float32", "(1000,)", "3.9", "KiB", "raw"],
        "b": ["b", "float64", "(7,)", "56", "B", "raw"],
    }, show.stdout

    raw = strata("show", *store, "--step", "1", "--json")
    assert raw.returncode == 0, raw.stderr
    manifest = json.loads(raw.stdout)
    assert (manifest["job"], manifest["step"], manifest["rank"]) == (job_name, 1, 0)
    assert manifest["total_bytes"] == SNAPSHOT_BYTES
    assert sum(o["size"] for o in manifest["objects"]) == SNAPSHOT_BYTES and len(manifest["objects"]) == 4
    assert sorted(t["nbytes"] for t in manifest["tensors"]) == [56, 4000]
    assert sorted(t["offset"] for t in manifest["tensors"]) == [0, 4032]

    verify = strata("verify", *store)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.splitlines() == ["step 2: OK (4 objects, 4.0 KiB)"]
    every = strata("verify", *store, "--all")
    assert every.returncode == 0, every.stdout + every.stderr
    assert every.stdout.splitlines() == ["step 1: OK (4 objects, 4.0 KiB)", "step 2: OK (4 objects, 4.0 KiB)"]

    missing = strata("show", *store, "--rank", "3")
    assert missing.returncode != 0 and "rank 3" in missing.stderr, missing


def test_verify_names_the_corrupted_object(make_sidecar, make_client, job_name):
    server = populate(make_sidecar, make_client, job_name)
    store = ["--storage", server.settings.storage, "--job", job_name]
    key, path = object_path(server, job_name, step=2, index=1)
    corrupt(path)

    out = strata("verify", *store)
    assert out.returncode == 1, out.stdout + out.stderr
    assert key in out.stdout
    assert re.search(rf"^step 2: .*{re.escape(key)}.*xxh3", out.stdout, re.M), out.stdout
    assert out.stdout.splitlines()[-1] == "step 2: CORRUPT (4 objects, 4.0 KiB)"
    # The other step is intact.
    older = strata("verify", *store, "--step", "1")
    assert older.returncode == 0 and older.stdout.splitlines() == ["step 1: OK (4 objects, 4.0 KiB)"], older

    path.write_bytes(path.read_bytes()[:-10])  # truncated
    out = strata("verify", *store, "--step", "2")
    assert out.returncode == 1 and key in out.stdout and "size" in out.stdout, out.stdout


def test_verify_all_reports_each_step_on_its_own(make_sidecar, make_client, job_name):
    server = populate(make_sidecar, make_client, job_name)
    key, path = object_path(server, job_name, step=1, index=0)
    corrupt(path)
    out = strata("verify", "--storage", server.settings.storage, "--job", job_name, "--all")
    assert out.returncode == 1 and key in out.stdout
    summary = [line for line in out.stdout.splitlines() if line.endswith(")")]
    assert summary == ["step 1: CORRUPT (4 objects, 4.0 KiB)", "step 2: OK (4 objects, 4.0 KiB)"]


def test_an_empty_job_says_so(make_sidecar, make_client, job_name):
    server = populate(make_sidecar, make_client, job_name)  # another job has checkpoints
    store = ["--storage", server.settings.storage, "--job", "empty-" + job_name]
    ls = strata("ls", *store)
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.strip() == f"no committed checkpoints for default/empty-{job_name} in {store[1]}"
    for command in ("show", "verify"):
        out = strata(command, *store)
        assert out.returncode != 0
        assert f"no committed checkpoint for default/empty-{job_name}" in out.stderr, out
    other_namespace = strata("ls", "--storage", store[1], "--job", job_name, "--namespace", "team-b")
    assert (
        other_namespace.returncode == 0 and "no committed checkpoints for team-b/" in other_namespace.stdout
    )


def test_store_commands_name_missing_flags(short_tmp):
    no_storage = strata("ls", "--job", "j")
    assert no_storage.returncode != 0 and "--storage (or STRATA_STORAGE)" in no_storage.stderr
    no_job = strata("ls", "--storage", f"file://{short_tmp}/store")
    assert no_job.returncode != 0 and "--job (or STRATA_JOB)" in no_job.stderr


def test_ls_of_a_missing_file_store_fails_and_creates_nothing(short_tmp):
    missing = short_tmp / "no-such-store"
    out = strata("ls", "--storage", f"file://{missing}", "--job", "j")
    assert not missing.exists()
    assert out.returncode != 0 and str(missing) in out.stderr, out


def test_ls_on_s3(make_sidecar, make_client, job_name, s3_store_url):
    url, endpoint = s3_store_url
    populate(make_sidecar, make_client, job_name, url, s3_endpoint=endpoint)

    out = strata("ls", "--storage", url, "--s3-endpoint", endpoint, "--job", job_name)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ["1", "2"], out.stdout
    assert all(re.fullmatch(rf"\s+\d+\s+1\s+4\.0 KiB\s+{WHEN}", row) for row in rows), out.stdout
    # The same through the environment.
    env = {"STRATA_STORAGE": url, "STRATA_S3_ENDPOINT": endpoint, "STRATA_JOB": job_name}
    via_env = strata("ls", env=env)
    assert via_env.returncode == 0 and via_env.stdout == out.stdout, via_env
    verify = strata("verify", "--all", env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.splitlines() == [
        "step 1: OK (4 objects, 4.0 KiB)",
        "step 2: OK (4 objects, 4.0 KiB)",
    ]


def test_an_unreachable_s3_endpoint_is_one_line_naming_it():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = strata("ls", "--storage", "s3://no-server/p", "--s3-endpoint", endpoint, "--job", "j", timeout=60)
    assert out.returncode == 1, out  # a failure to do the work, not wrong input (2)
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("strata ls: ") and endpoint in out.stderr, out.stderr


def test_show_and_verify_a_chain_of_diffs(make_sidecar, make_client, job_name):
    server = make_sidecar(policy="one-shot", quantize="8", quantize_match="table")
    client = make_client(server, job_name, capture_rng=False)
    table = torch.zeros(4096, 16)
    for step in range(3):
        table[step * 10 : step * 10 + 5] += 1.0
        client.save(step, {"table": table, "ids": torch.arange(20_000)}).durable.result(30)
    store = ["--storage", server.settings.storage, "--job", job_name]
    show = strata("show", *store, "--step", "2")
    assert show.returncode == 0, show.stderr
    kind = r"^checkpoint diff on step 0 \(one-shot; restore reads steps \[0\] first\)"
    assert re.search(kind, show.stdout, re.M), show.stdout
    row = next(line for line in show.stdout.splitlines() if line.startswith("table "))
    # 10 rows changed; with one staging segment the step-0 copy is given back before step 1 stages,
    # so the diff compares row digests, one per 256 bytes: 4 of these 64-byte rows, 4 groups written.
    assert re.search(r"rows-diff-quantized  \(8 bits, rel\. L2 error \S+, 16 rows by values\)$", row), row
    ids = next(line for line in show.stdout.splitlines() if line.startswith("ids "))
    assert ids.endswith("rows-diff  (0 rows by values)"), ids
    assert strata("verify", *store, "--all").returncode == 0
    base = mf.read_commit(server.store, "default", job_name, 2).required_commits
    assert [(r.attempt, r.step) for r in base] == [(0, 0)]  # the base, by COMMIT key and sha256
    # A base COMMIT that is not the one the diff was built on (same step, other body) is caught.
    base_key = mf.commit_key("default", job_name, 0, 0)
    original = server.store.get(base_key)
    tampered = mf.Commit.from_json(original)
    tampered.committed_at += 1
    server.store.put(base_key, tampered.to_json())
    verify = strata("verify", *store, "--step", "2")
    assert verify.returncode == 1, verify.stdout
    assert "step 2: needs step 0, whose COMMIT is not the one it was built on" in verify.stdout
    assert "sha256" in verify.stdout
    server.store.put(base_key, original)
    assert strata("verify", *store, "--step", "2").returncode == 0
    server.store.delete([base_key])  # the base is gone
    verify = strata("verify", *store, "--step", "2")
    assert verify.returncode == 1 and "step 2: needs step 0, which is not committed" in verify.stdout
