"""A misspelt flag or command of `strata` is answered with the one meant."""

from __future__ import annotations

import pytest

from sidecar import cli


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["ls", "--stroage", "file:///x", "--job", "j"],
            "strata ls: error: unrecognized arguments: "
            "--stroage file:///x; --stroage: did you mean --storage?",
        ),
        (["sidecar", "--objcet-bytes=4G"], "--objcet-bytes: did you mean --object-bytes?"),
        (["launch", "--nprco", "2", "--", "python", "t.py"], "--nprco: did you mean --nproc?"),
        (["launch", "--nproc", "2", "--jbo", "x", "--", "python", "t.py"], "--jbo: did you mean --job?"),
        (["verfiy"], "invalid choice: 'verfiy'"),
        (["verfiy"], "did you mean verify?"),
    ],
)
def test_misspelt_flags_and_commands_name_the_one_meant(argv, expected, capsys):
    assert expected in _error(argv, capsys)


def test_flags_after_the_training_command_are_not_strata_s(capsys):
    """What follows `--` belongs to the training command, however it is spelt."""
    args = cli.build_parser().parse_args(["launch", "--nproc", "1", "--", "python", "t.py", "--stroage"])
    assert args.command[-1] == "--stroage"
    assert capsys.readouterr().err == ""
