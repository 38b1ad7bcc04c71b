"""The README's quickstart as a reader runs it after `make setup`: its train.py saved by hand, then
its shell block line by line (`source .venv/bin/activate` included), the output lines it shows
found in order. `make quickstart-check` does the same from a fresh clone, timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.quickstart_check import in_order, quickstart, resumed_steps_ok

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    train, commands, expected = quickstart((ROOT / "README.md").read_text())
    (tmp_path / "train.py").write_text(train)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])  # what `make setup` made
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["PYTHONPATH"] = str(ROOT)  # the clone's packages, as the editable install gives them
    done = subprocess.run(
        ["bash", "-c", "set -e\n" + "\n".join(commands) + "\n"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert in_order(expected, output) == "", output[-3000:]
    # the newest committed step before the kill: 50 when its upload beat the crash, else a save before
    assert resumed_steps_ok(output) == "", output[-3000:]

