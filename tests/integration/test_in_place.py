"""In-place gang restart, the sidecar and the trainer: the operator's instruction (the answer to a
heartbeat) makes the sidecar adopt the new generation, tell its attached trainer on the Attach
stream, and the trainer exit 77 (its container's restart rule restarts it); the restarted trainer
runs as the new generation and restores from the sidecar's memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sidecar.api import EXIT_RESTART_IN_PLACE

TRAINER = textwrap.dedent(
    """
    import sys, time, torch
    from trainer_client import CheckpointClient
    client = CheckpointClient(job="job", socket=sys.argv[1], connect_timeout_s=10, resume="never")
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    client.save(7, state).durable.result(timeout=30)
    print("saved", flush=True)
    while True:  # blocked, as a rank waiting in a collective for a dead peer
        time.sleep(0.1)
    """
)


@pytest.mark.timeout(120)
def test_the_instruction_makes_the_trainer_exit_77_and_the_next_one_restores_from_memory(
    make_sidecar, make_client, short_tmp: Path
) -> None:
    generation = short_tmp / "generation"
    generation.write_text("run1/0")
    request = short_tmp / "restore-request"
    request.write_text("none")  # the first release's one-shot request, still in the file
    server = make_sidecar(generation_file=str(generation), restore_request_file=str(request))
    env = {**os.environ, "STRATA_RESTART_GRACE_S": "0.2", "STRATA_NAMESPACE": "default"}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, server.socket_path],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline()
        assert line.strip() == "saved", line + trainer.stdout.read()
        reports = server.engine.reports
        assert reports.adopt_restart(("default", "job"), "run1/1", "rank 1 exited with code 1")
        assert not reports.adopt_restart(("default", "job"), "run1/1")  # not twice, never older
        assert trainer.wait(timeout=30) == EXIT_RESTART_IN_PLACE
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if trainer.stdout is not None:
            trainer.stdout.close()
    # The restarted trainer: the sidecar's generation is the new one (the file still says run1/0),
    # and the restore comes from memory, not the stale "none" request.
    client = make_client(server, "job", namespace="default")
    assert client.restore({"w": __import__("torch").zeros(1024)}) == 7
    assert client.last_restore is not None and client.last_restore["source"] == "memory"
    from sidecar.engine import Identity

    ident = Identity("default", "job", 0, 1, 0, "")
    assert str(server.engine.generation_of(ident)) == "run1/1"
    assert server.engine.epoch_for(ident).generation == "run1/1"


def test_an_instruction_of_another_run_or_malformed_is_ignored(make_sidecar, short_tmp: Path) -> None:
    generation = short_tmp / "generation"
    generation.write_text("run1/3")
    server = make_sidecar(generation_file=str(generation))
    reports = server.engine.reports
    reports.on_instruction({"namespace": "default", "job": "job", "restart": {"generation": "nonsense"}})
    reports.on_instruction({"namespace": "default", "job": "job", "something": "newer"})
    assert reports.restart_generation(("default", "job")) is None
    reports.on_instruction({"namespace": "default", "job": "job", "restart": {"generation": "run2/9"}})
    from sidecar.engine import Identity

    ident = Identity("default", "job", 0, 1, 0, "")
    assert str(server.engine.generation_of(ident)) == "run1/3"  # another run's generation never wins
    assert reports.restart_for(("default", "job"), "run2/1") == "run2/9"
    assert reports.restart_for(("default", "job"), "run2/9") == ""
