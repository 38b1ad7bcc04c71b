"""Settings precedence and validation, both sides."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from pathlib import Path

import pytest

from sidecar import config
from trainer_client.config import ClientSettings


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p.parse_args(argv)


def test_sidecar_flags_beat_env_beat_defaults():
    env = {
        "STRATA_STORAGE": "file:///env",
        "STRATA_UPLOAD_CONCURRENCY": "8",
        "STRATA_S3_ENDPOINT": "http://e",
    }
    s = config.from_sources(parse(["--storage", "file:///flag"]), env)
    assert s.storage == "file:///flag"  # flag
    assert s.upload_concurrency == 8  # env
    assert s.s3_endpoint == "http://e"  # env name without the STRATA_ prefix rule
    assert s.object_bytes == 64 << 20  # default


def test_sidecar_settings_errors_name_the_setting():
    with pytest.raises(ValueError, match="--storage"):
        config.SidecarSettings().validate()
    with pytest.raises(ValueError, match="--token"):
        config.SidecarSettings(storage="file:///x", tcp_port=5000).validate()
    with pytest.raises(ValueError, match="--upload-concurrency"):
        config.SidecarSettings(storage="file:///x", upload_concurrency=0).validate()
    with pytest.raises(ValueError, match="107"):
        config.SidecarSettings(storage="file:///x", socket="/tmp/" + "s" * 120).validate()
    with pytest.raises(ValueError, match="STRATA_OBJECT_BYTES"):
        config.from_sources(None, {"STRATA_OBJECT_BYTES": "lots"})


def test_sidecar_settings_redact_the_token():
    s = config.SidecarSettings(storage="file:///x", token="hunter2")
    assert s.redacted()["token"] == "***"


def test_client_identity_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("STRATA_JOB", "train")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    s = ClientSettings.from_env()
    assert (s.job, s.rank, s.world_size, s.restart) == ("train", 3, 4, 2)
    monkeypatch.setenv("STRATA_RANK", "1")  # Strata's own variables win
    assert ClientSettings.from_env().rank == 1
    assert ClientSettings.from_env(rank=0).rank == 0  # and arguments win over both


def test_client_settings_errors(monkeypatch):
    monkeypatch.delenv("STRATA_JOB", raising=False)
    with pytest.raises(ValueError, match="STRATA_JOB"):
        ClientSettings.from_env()
    with pytest.raises(ValueError, match="resume='sometimes'"):
        ClientSettings.from_env(job="j", resume="sometimes")
    with pytest.raises(ValueError, match="token"):
        ClientSettings.from_env(job="j", address="10.0.0.1:5000")
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        ClientSettings.from_env(job="j", rank=4, world_size=4)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE='four'"):
        ClientSettings.from_env(job="j")


def test_default_socket_is_private(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert config.SidecarSettings().socket == "/run/user/1000/strata/sidecar.sock"
    monkeypatch.setenv("STRATA_JOB", "j")
    assert ClientSettings.from_env().socket == "/run/user/1000/strata/sidecar.sock"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STRATA_RANK": "abc"}, "STRATA_RANK='abc'"),
        ({"RANK": "abc"}, "RANK='abc'"),  # torchrun's, when Strata's own is not set
        ({"STRATA_WORLD_SIZE": "2.5"}, "STRATA_WORLD_SIZE='2.5'"),
        ({"STRATA_WORLD_SIZE": "0"}, "STRATA_WORLD_SIZE"),
        ({"STRATA_COMMIT_TIMEOUT_S": "nan"}, "STRATA_COMMIT_TIMEOUT_S"),
        ({"STRATA_COMMIT_TIMEOUT_S": "-1"}, "STRATA_COMMIT_TIMEOUT_S"),
        ({"STRATA_SAVE_ON_SIGTERM_S": "nan"}, "STRATA_SAVE_ON_SIGTERM_S"),
        ({"STRATA_RESUME": "sometimes"}, "STRATA_RESUME='sometimes'"),
        ({"STRATA_STAGING_BUFFERS": "3"}, "STRATA_STAGING_BUFFERS='3': expected one of auto, 1, 2"),
        ({"STRATA_RANK": "5", "STRATA_WORLD_SIZE": "4"}, "STRATA_RANK"),
    ],
)
def test_client_env_errors_name_the_variable(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "STRATA_RANK", "STRATA_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STRATA_JOB", "j")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        ClientSettings.from_env()


def test_client_warns_of_a_misspelt_variable_naming_the_one_meant(monkeypatch, caplog):
    monkeypatch.setenv("STRATA_JOB", "j")
    monkeypatch.setenv("STRATA_COMIT_TIMEOUT_S", "60")
    monkeypatch.setenv("STRATA_STORAGE", "file:///x")  # the sidecar's: known, no warning
    with caplog.at_level(logging.WARNING):
        ClientSettings.from_env()
    warned = [r.getMessage() for r in caplog.records if "STRATA_" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "STRATA_COMIT_TIMEOUT_S" in warned[0] and "STRATA_COMMIT_TIMEOUT_S" in warned[0]


def test_every_variable_the_code_reads_is_known():
    """A variable read anywhere must be in the list misspellings are checked against (a new sidecar
    setting too: a trainer sharing the sidecar's environment must not warn of it)."""
    from sidecar.api import envvars

    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("sidecar/**/*.py"), *root.glob("trainer_client/**/*.py")]
    read = {m for p in sources for m in re.findall(r"\bSTRATA_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    read |= {config.env_name(f) for f in dataclasses.fields(config.SidecarSettings)}
    assert read - envvars.KNOWN == set()
