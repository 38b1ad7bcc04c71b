""" "attempt" means one thing, the gang's generation that storage allocates and the EPOCH records;
the trainer's count of gang restarts is its restart."""

from __future__ import annotations

import pytest

from trainer_client.config import ClientSettings


@pytest.fixture(autouse=True)
def _job(monkeypatch):
    monkeypatch.setenv("STRATA_JOB", "j")
    for name in ("STRATA_RESTART", "STRATA_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def test_the_trainer_reads_its_restart_count_as_restart(monkeypatch):
    monkeypatch.setenv("STRATA_RESTART", "2")
    settings = ClientSettings.from_env()
    assert settings.restart == 2 and not hasattr(settings, "attempt")


def test_the_older_variable_and_torchrun_s_count_are_still_read(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")
    assert ClientSettings.from_env().restart == 4
    monkeypatch.setenv("STRATA_ATTEMPT", "3")
    assert ClientSettings.from_env().restart == 3
    monkeypatch.setenv("STRATA_RESTART", "1")
    assert ClientSettings.from_env().restart == 1


def test_strata_launch_hands_ranks_their_restart_count():
    from sidecar.local import launch

    assert "STRATA_RESTART (gang restarts so far)" in launch.EPILOG
    assert "STRATA_ATTEMPT" not in launch.EPILOG
