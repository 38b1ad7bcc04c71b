"""Runs docs snippets (tests/integration/test_docs_snippets.py), each in a process of its own,
forked from this one once it has imported torch: importing it takes most of a small snippet's
time, and a fork starts with it imported but nothing else run.

Reads one JSON request per line on stdin, ``{"script", "cwd", "env", "out", "timeout"}``, and
answers one line each, ``{"rc", "timed_out"}``: the script ran as ``__main__`` in ``cwd`` with
exactly ``env``, stdout and stderr to ``out``.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

# Preloaded: torch, what every snippet imports and most of its start-up time. Not grpc (nor the
# trainer client, which imports it): a process forked after grpc started is not one grpc supports,
# and a snippet's DataLoader workers fork that child again.
import torch  # noqa: F401


def _child(script: str, cwd: str, env: dict[str, str], out: str) -> None:
    os.setsid()  # a timeout kills what the snippet started too
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script]
    sys.path[0] = cwd
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (a client's close, say)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL, True
        time.sleep(0.02)


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req["script"], req["cwd"], req["env"], req["out"])
        rc, timed_out = _wait(pid, float(req["timeout"]))
        print(json.dumps({"rc": rc, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    main()
