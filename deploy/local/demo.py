#!/usr/bin/env python
"""`make demo`: the main job on the embedded default, end to end.

1. start SeaweedFS (a real S3 server) and a Strata sidecar as local processes;
2. train the recommendation example, saving every few steps;
3. SIGKILL the trainer in the middle of streaming a checkpoint (an injection
   hook picks the exact point: the 2nd chunk of the save of step --kill-step);
4. start the trainer again: it resumes from the newest committed step;
5. train the same job uninterrupted with the same seed and compare the final
   parameters and optimizer state bit for bit;
6. the same with 2 ranks under `strata launch`: rank 1 is killed mid-save,
   the launcher stops the whole gang and restarts it from the newest step both
   ranks committed; again compared bit for bit with an uninterrupted run.
Everything is stopped by PID at the end; logs stay under .strata/demo/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sidecar.local.seaweed import SeaweedServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "train_recsys.py"


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def run_trainer(env: dict[str, str], args: list[str], log: Path) -> tuple[int, str]:
    """Run one trainer process, echoing its output; returns (exit code, output)."""
    lines = []
    with (
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc,
        log.open("a") as out,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line)
            print("    " + line.rstrip(), flush=True)
        code = proc.wait()
    return code, "".join(lines)


def gang_demo(strata: str, env: dict[str, str], storage: str, endpoint: str, work: Path, ranks: int) -> bool:
    """`strata launch` with several ranks: kill one mid-save, watch the whole gang restart."""
    ddp = ROOT / "deploy" / "examples" / "train_ddp.py"
    common = ["--steps", "60", "--save-every", "10"]
    launch = [
        strata,
        "launch",
        "--nproc",
        str(ranks),
        "--storage",
        storage,
        "--s3-endpoint",
        endpoint,
        "--backoff-s",
        "0.5",
    ]
    banner(f"{ranks} ranks under `strata launch`; rank 1 is SIGKILLed while saving step 39")
    out, ref = work / "gang.json", work / "gang-ref.json"
    faults = dict(
        env, STRATA_FAULTS="client.stream.chunk@39#1=kill", STRATA_FAULTS_RANK="1", STRATA_TEST_FAULTS="1"
    )
    cmd = [*launch, "--job", "recsys-gang", "--workdir", str(work / "gang"), "--", sys.executable, str(ddp)]
    if subprocess.run([*cmd, *common, "--out", str(out)], env=faults).returncode != 0:
        print("    the gang did not finish")
        return False
    banner(f"uninterrupted {ranks}-rank reference run")
    cmd = [
        *launch,
        "--job",
        "recsys-gang-ref",
        "--workdir",
        str(work / "gang-ref"),
        "--",
        sys.executable,
        str(ddp),
    ]
    if subprocess.run([*cmd, *common, "--no-checkpoint", "--out", str(ref)], env=env).returncode != 0:
        return False
    got, want = json.loads(out.read_text()), json.loads(ref.read_text())
    banner(f"result ({ranks} ranks)")
    same = got["digest"] == want["digest"]
    print(f"    gang restarted from step {got['resumed_from']} (29: step 39 was torn on rank 1)")
    print(f"    bitwise identical to the uninterrupted run: {'YES' if same else 'NO'}")
    return same and got["resumed_from"] == 29


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--kill-step", type=int, default=49, help="SIGKILL the trainer while streaming this step"
    )
    parser.add_argument("--workdir", default=str(ROOT / ".strata" / "demo"))
    parser.add_argument("--ranks", type=int, default=2, help="ranks in the gang-restart part")
    args = parser.parse_args()

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="strata-demo-", dir="/tmp"))  # unix socket paths must stay short
    socket = sock_dir / "sidecar.sock"
    sidecar = None
    seaweed = SeaweedServer(work / "seaweed", log_path=work / "seaweed.log")
    try:
        banner("starting SeaweedFS (S3) and the Strata sidecar")
        seaweed.start()
        seaweed.create_bucket("strata-demo")
        print(f"    SeaweedFS S3 at {seaweed.endpoint} (pid {seaweed.pid})")
        storage = "s3://strata-demo/checkpoints"
        strata = str(Path(sys.executable).parent / "strata")
        env = dict(os.environ, STRATA_S3_ENDPOINT=seaweed.endpoint, STRATA_STORAGE=storage)
        sidecar_log = (work / "sidecar.log").open("w")
        sidecar = subprocess.Popen(
            [strata, "sidecar", "--socket", str(socket), "--metrics-port", "0"],
            env=env,
            stdout=sidecar_log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not socket.exists():
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sidecar did not start; see {work / 'sidecar.log'}")
            time.sleep(0.1)
        print(f"    sidecar on unix:{socket} (pid {sidecar.pid}), storage {storage}")

        # when_busy=wait: a save waits for the previous stream instead of being skipped, so the
        # save of --kill-step (where the kill is armed) is certain to happen.
        trainer_env = dict(
            env,
            STRATA_SOCKET=str(socket),
            STRATA_JOB="recsys-demo",
            STRATA_NAMESPACE="demo",
            STRATA_WHEN_BUSY="wait",
        )
        common = ["--steps", str(args.steps), "--save-every", str(args.save_every)]
        log = work / "trainer.log"

        banner(f"training; the trainer will be SIGKILLed mid-stream while saving step {args.kill_step}")
        killed_env = dict(
            trainer_env, STRATA_FAULTS=f"client.stream.chunk@{args.kill_step}#1=kill", STRATA_TEST_FAULTS="1"
        )
        code, _ = run_trainer(killed_env, common, log)
        if code != -signal.SIGKILL:
            print(f"expected the trainer to die by SIGKILL, got exit code {code}")
            return 1
        print(f"    trainer killed (SIGKILL, exit {code})")

        banner("restarting the trainer (restart 1): it resumes from the newest committed step")
        out = work / "resumed.json"
        code, _ = run_trainer(dict(trainer_env, STRATA_RESTART="1"), [*common, "--out", str(out)], log)
        if code != 0:
            print(f"resumed trainer failed with exit code {code}")
            return 1
        resumed = json.loads(out.read_text())

        banner("uninterrupted reference run, same seed, no checkpointing")
        ref_out = work / "reference.json"
        code, _ = run_trainer(trainer_env, [*common, "--no-checkpoint", "--out", str(ref_out)], log)
        if code != 0:
            return 1
        reference = json.loads(ref_out.read_text())

        banner("committed checkpoints (strata ls)")
        subprocess.run([strata, "ls", "--job", "recsys-demo", "--namespace", "demo"], env=env, check=True)

        banner("result (one rank)")
        expected = (args.kill_step // args.save_every) * args.save_every - 1
        print(
            f"    killed while saving step {args.kill_step}; resumed from step {resumed['resumed_from']}"
            f" (newest committed before the kill: {expected})"
        )
        same = resumed["digest"] == reference["digest"]
        print(f"    final state after kill + resume : {resumed['digest']}")
        print(f"    final state, uninterrupted run  : {reference['digest']}")
        print(f"    bitwise identical: {'YES' if same else 'NO'}")
        if resumed["resumed_from"] != expected or not same:
            print(f"    FAILED (wanted resume step {expected} and identical states)")
            return 1

        ok = gang_demo(strata, env, storage, seaweed.endpoint, work, args.ranks)
        return 0 if ok else 1
    finally:
        if sidecar is not None and sidecar.poll() is None:
            sidecar.send_signal(signal.SIGTERM)
            try:
                sidecar.wait(30)
            except subprocess.TimeoutExpired:
                sidecar.kill()
        seaweed.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
