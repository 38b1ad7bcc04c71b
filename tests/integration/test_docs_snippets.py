"""Every code block of README.md and docs/**/*.md runs, as a reader who followed the quickstart
would run it: a sidecar serving on the embedded S3 storage (SeaweedFS), STRATA_* set.

What runs: each fenced ```python block, and each ```bash / ```sh / ```console block right after
the line ``<!-- snippet: run -->`` (in a console block, the ``$ `` lines, if any; a shell block
stops at its first failing command, as under ``bash -e``). A block right after
``<!-- snippet: skip (why) -->`` is skipped; the reason is required. Each block runs in a fresh
process (a Python block forked by snippet_runner.py once torch is imported, a shell block in
bash), in an empty directory, with the repository on PYTHONPATH and a job of its own
(``STRATA_JOB``), so blocks never resume each other's checkpoints.

The counts go to bench-results.json (``docs_snippets_run``, ``docs_snippets_failed``, and
``readme_lines``: the README stays a page, under 150 lines).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.local.seaweed import SeaweedServer

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench-results.json"
#: seconds one block may take (a reader's snippet is small: most of it is importing torch)
BLOCK_TIMEOUT_S = 120.0  # a loaded CI machine; a block that hangs still fails
#: snippets run at once (each mostly waits on its sidecar and storage once torch is imported)
WORKERS = 2
RUN_MARKER = "<!-- snippet: run -->"
SKIP_MARKER = re.compile(r"<!-- snippet: skip \((?P<why>.*\S.*)\) -->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
PYTHON = ("python", "py", "python3")
SHELLS = ("bash", "sh", "shell", "console")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str = ""  # "run", "skip", or a malformed marker's text
    why: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker != "skip" and (
            self.lang in PYTHON or (self.lang in SHELLS and self.marker == "run")
        )


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file, each with the snippet marker just above it
    (blank lines between allowed)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        block = Block(path, i + 1, m["lang"].lower(), "\n".join(body) + "\n")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        above = lines[k].strip() if k >= 0 else ""
        if above == RUN_MARKER:
            block.marker = "run"
        elif skip := SKIP_MARKER.fullmatch(above):
            block.marker, block.why = "skip", skip["why"].strip()
        elif above.startswith("<!-- snippet"):
            block.marker = above  # malformed: reported as a failure
        found.append(block)
        i = j + 1
    return found


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def console_commands(code: str) -> str:
    """The commands of a console transcript: its ``$ `` lines and their continuations (every
    line when none has a prompt)."""
    if not any(line.startswith("$ ") for line in code.splitlines()):
        return code
    out: list[str] = []
    going_on = False
    for line in code.splitlines():
        if line.startswith("$ ") or going_on:
            command = line[2:] if line.startswith("$ ") and not going_on else line
            out.append(command)
            going_on = command.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


@dataclass
class Outcome:
    block: Block
    ok: bool
    detail: str = ""
    seconds: float = 0.0


class Runner:
    """A ``snippet_runner`` process: it forks a process per snippet once torch is imported."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("snippet_runner.py"))],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, script: Path, env: dict[str, str], out: Path) -> tuple[int, bool]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        request = {"script": str(script), "cwd": str(script.parent), "env": env, "out": str(out)}
        self.proc.stdin.write(json.dumps({**request, "timeout": BLOCK_TIMEOUT_S}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the snippet runner exited ({self.proc.wait()})")
        reply = json.loads(answer)
        return int(reply["rc"]), bool(reply["timed_out"])

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the runner's end of input: it exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stdout.close()


def run_block(block: Block, env: dict[str, str], runner: Runner | None = None) -> Outcome:
    """Run ``block`` in a process of its own (forked by ``runner`` for Python, if given)."""
    if block.marker not in ("", "run", "skip"):
        return Outcome(
            block,
            False,
            f"malformed marker {block.marker!r}: use {RUN_MARKER} or <!-- snippet: skip (why) -->",
        )
    job = "docs-" + re.sub(r"[^a-z0-9]+", "-", block.where.lower()).strip("-")
    env = {**env, "STRATA_JOB": job}
    with tempfile.TemporaryDirectory(prefix="snippet-") as cwd:
        out = Path(cwd).parent / f"{Path(cwd).name}.out"
        t0 = time.monotonic()
        try:
            if block.lang in PYTHON:
                script = Path(cwd) / "snippet.py"
                script.write_text(block.code)
                if runner is not None:
                    rc, timed_out = runner.run(script, env, out)
                else:
                    rc, timed_out = _subprocess([sys.executable, str(script)], cwd, env, out)
            else:
                code = console_commands(block.code) if block.lang == "console" else block.code
                rc, timed_out = _subprocess(["bash", "-eu", "-c", code], cwd, env, out)
            text = out.read_text(errors="replace") if out.exists() else ""
        finally:
            out.unlink(missing_ok=True)
        seconds = time.monotonic() - t0
    if timed_out:
        return Outcome(block, False, f"timed out after {BLOCK_TIMEOUT_S:.0f} s\n{_tail(text)}", seconds)
    if rc != 0:
        return Outcome(block, False, f"exit {rc}\n{_tail(text)}", seconds)
    return Outcome(block, True, seconds=seconds)


def _subprocess(argv: list[str], cwd: str, env: dict[str, str], out: Path) -> tuple[int, bool]:
    with out.open("w") as sink:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a timeout kills what the block started too
        )
        try:
            return proc.wait(BLOCK_TIMEOUT_S), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -signal.SIGKILL, True


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def record(figures: dict[str, int]) -> None:
    """Merge ``figures`` into bench-results.json (created if missing; other keys stay)."""
    data: dict[str, object] = {}
    if RESULTS.exists():
        try:
            loaded = json.loads(RESULTS.read_text())
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            data = loaded
    data.update(figures)
    tmp = RESULTS.with_name(f".{RESULTS.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(RESULTS)


@pytest.fixture(scope="module")
def quickstart_env(seaweed: SeaweedServer) -> Iterator[dict[str, str]]:
    """The environment after the quickstart: a bucket, a sidecar serving on it (its own process,
    stopped by its PID), and the STRATA_* variables pointing at both."""
    bucket = f"docs-{uuid.uuid4().hex[:12]}"
    seaweed.create_bucket(bucket)
    work = Path(tempfile.mkdtemp(prefix="docs-", dir="/tmp"))  # a short path: a unix socket in it
    (work / "shm").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        STRATA_STORAGE=f"s3://{bucket}/checkpoints",
        STRATA_S3_ENDPOINT=seaweed.endpoint,
        STRATA_SOCKET=str(work / "sidecar.sock"),
    )
    log = (work / "sidecar.log").open("w")
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar.cli",
            "sidecar",
            "--metrics-port",
            "0",
            "--shm-dir",
            str(work / "shm"),
        ],
        env=env,
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while not (work / "sidecar.sock").exists():
            if sidecar.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the sidecar did not start: {(work / 'sidecar.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield env
    finally:
        os.kill(sidecar.pid, signal.SIGTERM)
        try:
            sidecar.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(sidecar.pid, signal.SIGKILL)
            sidecar.wait()
        log.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def test_every_docs_snippet_runs(quickstart_env: dict[str, str]) -> None:
    found = [b for path in doc_files() for b in blocks(path)]
    malformed = [b for b in found if b.marker not in ("", "run", "skip")]
    todo = [b for b in found if b.runs] + malformed
    runners = queue.SimpleQueue[Runner]()
    started = [Runner(quickstart_env) for _ in range(WORKERS)]
    for runner in started:
        runners.put(runner)

    def run(block: Block) -> Outcome:
        runner = runners.get()
        try:
            return run_block(block, quickstart_env, runner)
        finally:
            runners.put(runner)

    try:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            outcomes = list(pool.map(run, todo))
    finally:
        for runner in started:
            runner.close()
    failed = [o for o in outcomes if not o.ok]
    readme_lines = len((ROOT / "README.md").read_text().splitlines())
    record(
        {
            "docs_snippets_run": len(outcomes),
            "docs_snippets_failed": len(failed),
            "readme_lines": readme_lines,
        }
    )
    if failed:
        pytest.fail(
            f"{len(failed)} of {len(outcomes)} docs snippets failed:\n"
            + "\n".join(f"{o.block.where} ({o.block.lang}, {o.seconds:.1f} s): {o.detail}" for o in failed),
            pytrace=False,
        )


# --- the collector itself ------------------------------------------------------------------------


def test_markers_choose_what_runs(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "\n".join(
            [
                "```python",
                "print('runs')",
                "```",
                "```bash",
                "echo not marked",
                "```",
                RUN_MARKER,
                "",
                "```console",
                "$ echo one \\",
                "  two",
                "one two",
                "```",
                "<!-- snippet: skip (needs a GPU) -->",
                "```python",
                "import torch; torch.cuda.init()",
                "```",
                "<!-- snippet: skip -->",
                "```python",
                "pass",
                "```",
                "- a list item:",
                "",
                "  ```python",
                "  x = 1",
                "  ```",
                "```yaml",
                "a: 1",
                "```",
            ]
        )
        + "\n"
    )
    found = blocks(doc)
    assert [(b.line, b.lang, b.marker, b.runs) for b in found] == [
        (1, "python", "", True),
        (4, "bash", "", False),
        (9, "console", "run", True),
        (15, "python", "skip", False),
        (19, "python", "<!-- snippet: skip -->", True),  # no reason: reported, not skipped
        (24, "python", "", True),
        (27, "yaml", "", False),
    ]
    assert found[3].why == "needs a GPU"
    assert found[5].code == "x = 1\n"
    assert console_commands(found[2].code) == "echo one \\\n  two\n"
    assert console_commands("kubectl get pods\n") == "kubectl get pods\n"  # no prompts: all commands
    outcome = run_block(found[4], dict(os.environ))
    assert not outcome.ok and "malformed marker" in outcome.detail


def test_a_failing_block_is_named_with_its_error(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("text\n\n```python\nimport sys\nraise SystemExit('no job name: set STRATA_JOB')\n```\n")
    (block,) = blocks(doc)
    outcome = run_block(block, dict(os.environ))
    assert not outcome.ok
    assert outcome.detail.startswith("exit 1\n") and "no job name: set STRATA_JOB" in outcome.detail
    assert block.where.endswith("page.md:3")
