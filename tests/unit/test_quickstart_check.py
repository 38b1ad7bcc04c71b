"""The quickstart check reads the README as a reader follows it: the train.py block, then the
commands of the shell block after it, and the output lines it shows, in order."""

from __future__ import annotations

from pathlib import Path

from tools.quickstart_check import in_order, quickstart

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_quickstart_is_a_script_commands_and_their_expected_output() -> None:
    train, commands, expected = quickstart((ROOT / "README.md").read_text())
    compile(train, "train.py", "exec")  # a whole script
    assert any(c.startswith("strata launch") for c in commands) and commands[0].startswith("source ")
    assert expected and all(e.startswith("[rank") for e in expected)


def test_expected_lines_must_appear_in_order_with_ellipses_matching_anything() -> None:
    out = "\n".join(
        [
            "[rank 0] resumed from step None",
            "noise",
            "[rank 0] resumed from step 50",
            "[rank 0] done at step 119, loss 1",
        ]
    )
    assert in_order(["[rank 0] resumed from step None", "[rank 0] done at step 119, loss ..."], out) == ""
    assert in_order(["[rank 0] resumed from step 50", "[rank 0] resumed from step None"], out) == (
        "[rank 0] resumed from step None"
    )
