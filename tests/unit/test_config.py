"""Settings precedence and validation, both sides."""

from __future__ import annotations

import argparse

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
    assert (s.job, s.rank, s.world_size, s.attempt) == ("train", 3, 4, 2)
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
    with pytest.raises(ValueError, match="world_size"):
        ClientSettings.from_env(job="j")


def test_default_socket_is_private(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert config.SidecarSettings().socket == "/run/user/1000/strata/sidecar.sock"
    monkeypatch.setenv("STRATA_JOB", "j")
    assert ClientSettings.from_env().socket == "/run/user/1000/strata/sidecar.sock"
