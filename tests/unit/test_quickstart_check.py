"""The quickstart check reads the README as a reader follows it: the train.py block, then the
commands of the shell block after it, and the output lines it shows, in order."""

from __future__ import annotations

from pathlib import Path

from tools.quickstart_check import in_order, quickstart, resumed_steps_ok

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
        "no line like '[rank 0] resumed from step None'"
    )


def test_the_restart_may_resume_from_any_save_before_the_crash() -> None:
    """The README's "(or earlier ...)" note: the newest committed step at the kill is 50, or an
    earlier save when step 50 was still uploading; nothing else passes."""
    _, _, expected = quickstart((ROOT / "README.md").read_text())
    assert "[rank 0] resumed from step ..." in expected
    run = "[rank 0] resumed from step None\n[rank 0] resumed from step {}\n[rank 0] done at step 119, loss 1"
    for step, ok in (("50", True), ("40", True), ("60", False), ("45", False), ("None", False)):
        assert (in_order(expected, run.format(step)) == "" and resumed_steps_ok(run.format(step)) == "") is ok
