"""Follow the README's quickstart literally, from a fresh clone, and time it.

    python -m tools.quickstart_check [--repo URL_OR_PATH] [--results bench-results.json]

Clones the repository into a new directory, runs ``make setup`` as the README says, saves the
quickstart's ``train.py`` block as ``train.py`` and runs the shell block that follows it line by
line in one bash (``source .venv/bin/activate`` included), then checks that the ``# [rank 0] ...``
lines the block shows as its output appear in order (``...`` matches anything; a line's note after
two spaces, ``  (...)``, is for the reader, and a note saying "or earlier" lets the step number
before it be any earlier one: :func:`resumed_steps_ok` checks those). Prints each phase's
time and writes ``quickstart_fresh_clone_s`` (clone to the last command's end; target: under 600 s
on a 2-core machine) and ``quickstart_ok`` into the results file.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_START = "<!-- --8<-- [start:train] -->"
TRAIN_END = "<!-- --8<-- [end:train] -->"


def quickstart(readme: str) -> tuple[str, list[str], list[str]]:
    """The README's train.py, the commands of the shell block after it, and the output lines that
    block shows (``# [rank 0] ...`` comments), in order."""
    start, end = readme.index(TRAIN_START), readme.index(TRAIN_END)
    train = re.search(r"```python\n(.*?)```", readme[start:end], re.S)
    shell = re.search(r"```bash\n(.*?)```", readme[end:], re.S)
    if train is None or shell is None:
        raise SystemExit(
            "the README has no quickstart: a python block between the train markers, then a bash block"
        )
    commands, expected = [], []
    for line in shell.group(1).splitlines():
        if line.startswith("# [rank"):
            want, _, note = line[2:].partition("  (")
            if "or earlier" in note:
                want = re.sub(r"\d+$", "...", want.rstrip())
            expected.append(want.strip())
        elif line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.split("  #")[0].rstrip())
    return train.group(1), commands, expected


def resumed_steps_ok(output: str, crash_at: int = 60, save_every: int = 10) -> str:
    """ "" when the restart after the crash resumed from a step saved before it; else what it did."""
    steps = re.findall(r"\[rank 0\] resumed from step (\w+)", output)
    if len(steps) < 2 or not steps[1].isdigit():
        return f"no resume after the crash: {steps}"
    step = int(steps[1])
    if not (0 <= step < crash_at and step % save_every == 0):
        return f"resumed from step {step}, not a save before step {crash_at}"
    return ""


def in_order(expected: list[str], output: str) -> str:
    """What is missing: the first expected line not found after the previous one, or ""."""
    at = 0
    for want in expected:
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        found = re.compile(pattern).search(output, at)
        if found is None:
            return f"no line like {want!r}"
        at = found.end()
    return ""


def run(repo: str, workdir: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    t0 = time.monotonic()
    clone = workdir / "strata"
    subprocess.run(["git", "clone", "-q", repo, str(clone)], check=True)
    out["clone_s"] = time.monotonic() - t0
    t = time.monotonic()
    print("make setup ...", flush=True)
    subprocess.run(["make", "setup"], cwd=clone, check=True, stdout=subprocess.DEVNULL)
    out["setup_s"] = time.monotonic() - t
    print(f"  setup {out['setup_s']:.0f} s", flush=True)
    train, commands, expected = quickstart((clone / "README.md").read_text())
    (clone / "train.py").write_text(train)
    t = time.monotonic()
    script = "set -e\n" + "\n".join(commands) + "\n"
    print("the quickstart's commands ...", flush=True)
    done = subprocess.run(
        ["bash", "-c", script], cwd=clone, capture_output=True, text=True, timeout=900, check=False
    )
    out["commands_s"] = time.monotonic() - t
    out["quickstart_fresh_clone_s"] = time.monotonic() - t0
    output = done.stdout + done.stderr
    missing = in_order(expected, output) or resumed_steps_ok(output)
    out["quickstart_ok"] = float(done.returncode == 0 and not missing)
    if not out["quickstart_ok"]:
        print(output[-4000:], file=sys.stderr)
        why = f"exit code {done.returncode}" if done.returncode else missing
        print(f"the quickstart failed: {why}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.quickstart_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(ROOT), help="what to clone (default: this checkout's repository)")
    p.add_argument(
        "--results", type=Path, default=ROOT / "bench-results.json", help="merge the figures into it"
    )
    p.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="strata-quickstart-"))
    try:
        out = run(args.repo, workdir)
    finally:
        if args.keep:
            print(f"clone kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    for k, v in out.items():
        print(f"{k:28s} {v:8.1f}")
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    results.update({k: out[k] for k in ("quickstart_fresh_clone_s", "quickstart_ok")})
    args.results.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0 if out["quickstart_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
