"""`strata launch` without --job names the job after the training script, so examples run in turn
never resume each other's checkpoints."""

from __future__ import annotations

import pytest

from sidecar import cli
from sidecar.local import launch
from sidecar.local.launch import job_from_command


@pytest.mark.parametrize(
    ("command", "job"),
    [
        (["python", "deploy/examples/train_ddp.py", "--steps", "200"], "train_ddp"),
        (["python", "-u", "examples/Train Loader.py"], "train-loader"),
        (["/venv/bin/python3", "-m", "pkg.train", "--lr", "1"], "pkg.train"),
        (["./train.py"], "train"),
        (["bash", "run.sh"], "run.sh"),
        (["python", "-c", "print(1)"], "python"),
        (["...."], "local-job"),
    ],
)
def test_the_job_is_named_after_the_script(command, job):
    assert job_from_command(command) == job


def test_job_and_workdir_default_per_script(monkeypatch):
    monkeypatch.delenv("STRATA_JOB", raising=False)
    args = cli.build_parser().parse_args(["launch", "--nproc", "1", "--", "python", "a.py"])
    assert args.job is None and args.workdir is None and not args.keep_storage
    monkeypatch.setenv("STRATA_JOB", "mine")
    args = cli.build_parser().parse_args(["launch", "--nproc", "1", "--keep-storage", "--", "python", "a.py"])
    assert args.job == "mine" and args.keep_storage


def test_keep_storage_with_a_storage_of_ones_own_is_refused():
    args = cli.build_parser().parse_args(
        ["launch", "--nproc", "1", "--keep-storage", "--storage", "file:///tmp/x", "--", "python", "a.py"]
    )
    with pytest.raises(ValueError, match=r"^--keep-storage keeps the embedded SeaweedFS running"):
        launch.main(args)
