"""`strata launch`: run a distributed job as local processes with automatic gang restart.

    strata launch --nproc 4 -- python train.py --epochs 3

Starts SeaweedFS (unless --storage is given) and --sidecars sidecars (one per
simulated pod, each serving a contiguous block of ranks, telling each other of
their commits over TCP loopback), then the ranks with torchrun-style
environment. The launcher owns the gang generation (a run id plus the restart
count), written to a generation file every sidecar reads. When any rank fails, every
other rank is killed at once (surviving gloo/NCCL ranks would otherwise block
until their timeout), the decision core (sidecar.coordinator) decides, and
all ranks start again with a fresh rendezvous port; they resume from the
newest step every rank committed.

Restarts are in place by default (``--restart inplace``): the sidecars and what they hold in
memory are kept, as an in-place restart of the trainer containers keeps a pod's sidecar, so
ranks restore from memory. ``--restart pod`` also kills and restarts every sidecar with its
redundancy directory wiped, as recreating the pods would: ranks restore from peers or storage.
``--redundancy buddy|parity`` protects each simulated pod's committed snapshots in the others'
memory (sidecar.redundancy).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, start_http_server

from sidecar import manifest as mf
from sidecar.coordinator import (
    OOM_EXIT_CODE,
    Failure,
    FailureKind,
    RestartPolicy,
    RestartTracker,
    classify_exit,
)
from sidecar.errors import CommandFailed
from sidecar.local.oom import OomCounter
from sidecar.local.seaweed import SeaweedError, SeaweedServer
from sidecar.store import open_store

log = logging.getLogger("strata.launch")
#: How long ranks may keep running once one rank finished cleanly (a rank stuck in teardown).
EXIT_GRACE_S = 60.0

EPILOG = """\
examples:
  strata launch --nproc 4 -- python deploy/examples/train_ddp.py --steps 200
  strata launch --nproc 2 --storage s3://ckpt/jobs --s3-endpoint http://minio:9000 \\
      --job exp7 -- python train.py
  strata launch --nproc 2 --max-restarts 5 --hang-timeout-s 600 -- python train.py
  strata launch --nproc 2 --keep-storage -- python train.py   # then `strata ls` as it prints
  strata launch --nproc 4 --sidecars 4 --redundancy parity --job ddp-parity \
      -- python deploy/examples/train_ddp.py

The job is named after the script (train.py: train) unless --job or STRATA_JOB names it: a rerun
of the same script resumes its newest committed step, another script starts a job of its own.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, STRATA_JOB,
STRATA_SOCKET (its pod's sidecar), STRATA_RESTART (gang restarts so far), STRATA_GENERATION and
STRATA_PG_TIMEOUT_S
(use trainer_client.init_process_group()).
Testing hooks (honoured only with STRATA_TEST_FAULTS=1, which every rank and sidecar inherits):
STRATA_FAULTS goes only to rank $STRATA_FAULTS_RANK of the first start (restart 0),
STRATA_SIDECAR_FAULTS only to the first start of sidecar $STRATA_SIDECAR_FAULTS_INDEX (default 0).
"""


@dataclass
class LaunchSettings:
    nproc: int
    command: list[str]
    job: str
    namespace: str
    storage: str | None
    s3_endpoint: str | None
    workdir: Path
    policy: RestartPolicy
    hang_timeout_s: float
    pg_timeout_s: float
    metrics_port: int
    keep: int = 3
    sidecars: int = 1
    #: on SIGTERM/SIGINT of the launcher: how long ranks may take to exit (a pod's
    #: terminationGracePeriodSeconds) before they are killed
    grace_period_s: float = 30.0
    #: "inplace": sidecars (and their memory) survive a gang restart; "pod": they are recreated
    restart: str = "inplace"
    redundancy: str = "off"
    parity_group: int = 4
    #: leave the embedded SeaweedFS running after exit, so `strata ls` can inspect the run
    keep_storage: bool = False

    def sidecar_of(self, rank: int) -> int:
        """Ranks fill pods in order, as a Job's completion index would."""
        return rank * self.sidecars // self.nproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(stream: object, prefix: str) -> None:
    with stream:  # type: ignore[attr-defined]  # closed at EOF: no pipe left open per restart
        for line in stream:  # type: ignore[attr-defined]
            sys.stdout.write(f"{prefix}{line}")
            sys.stdout.flush()


class Gang:
    """The ranks of one attempt."""

    def __init__(
        self, settings: LaunchSettings, attempt: int, sockets: list[str], heartbeat_dir: Path, generation: str
    ) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.heartbeats = [heartbeat_dir / f"rank-{r}" for r in range(settings.nproc)]
        self.started = time.monotonic()
        self.first_exit: float | None = None
        port = _free_port()  # a fresh rendezvous port: the old one may linger in TIME_WAIT
        fault_rank = os.environ.get("STRATA_FAULTS_RANK")
        # The OOM-kill counter of each rank's memory cgroup, read before it can die: a SIGKILL
        # with the counter grown is the OOM killer's. Ranks inherit the launcher's cgroup.
        own = OomCounter.find()
        own_before = own.read() if own is not None else None
        self.oom: list[tuple[OomCounter, int] | None] = []
        self.pumps: list[threading.Thread] = []
        for rank in range(settings.nproc):
            env = dict(os.environ)
            env.pop("STRATA_FAULTS", None)
            if attempt == 0 and fault_rank is not None and int(fault_rank) == rank:
                env["STRATA_FAULTS"] = os.environ.get("STRATA_FAULTS", "")
            self.heartbeats[rank].unlink(missing_ok=True)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(settings.nproc),
                LOCAL_WORLD_SIZE=str(settings.nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                STRATA_JOB=settings.job,
                STRATA_NAMESPACE=settings.namespace,
                STRATA_SOCKET=sockets[settings.sidecar_of(rank)],
                STRATA_RESTART=str(attempt),
                STRATA_GENERATION=generation,
                STRATA_PG_TIMEOUT_S=str(settings.pg_timeout_s),
                STRATA_HEARTBEAT_FILE=str(self.heartbeats[rank]),
                PYTHONUNBUFFERED="1",
            )
            proc = subprocess.Popen(
                settings.command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its own process group: kill takes its children too
            )
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] "), daemon=True)
            pump.start()
            self.pumps.append(pump)
            self.procs.append(proc)
            counter = OomCounter.find(proc.pid) or own
            before = own_before if counter == own else counter.read() if counter is not None else None
            self.oom.append((counter, before) if counter is not None and before is not None else None)

    def classify(self, rank: int, code: int) -> Failure:
        """A rank's non-zero exit; a SIGKILL while its cgroup's oom_kill counter grew is an OOM."""
        watch = self.oom[rank] if rank < len(self.oom) else None
        if watch is not None and code in (-signal.SIGKILL, OOM_EXIT_CODE):
            counter, before = watch
            after = counter.read()
            if after is not None and after > before:
                return classify_exit(
                    code,
                    rank=rank,
                    oom_killed=True,
                    detail=f"cgroup {counter.cgroup} {counter.path.name} oom_kill {before}\u2192{after}; "
                    "raise that cgroup's memory limit or lower the rank's memory use "
                    "(smaller batches, fewer data-loader workers)",
                )
        return classify_exit(code, rank=rank)

    def poll(self, hang_timeout_s: float) -> Failure | bool | None:
        """A Failure, True when every rank exited 0, or None while running."""
        failed = [
            self.classify(r, code) for r, p in enumerate(self.procs) if (code := p.poll()) not in (None, 0)
        ]
        if failed:
            # Peers of a killed rank die soon after with collective errors; blame the kill (an OOM first).
            return min(failed, key=lambda f: (f.kind != FailureKind.OOM, f.kind != FailureKind.SIGNAL))
        if all(p.poll() == 0 for p in self.procs):
            return True
        finished = [r for r, p in enumerate(self.procs) if p.poll() == 0]
        if finished and self.first_exit is None:
            self.first_exit = time.monotonic()
        if self.first_exit is not None and time.monotonic() - self.first_exit > EXIT_GRACE_S:
            stuck = next(r for r, p in enumerate(self.procs) if p.poll() is None)
            return Failure(
                FailureKind.HANG,
                stuck,
                detail=f"still running {EXIT_GRACE_S:.0f} s after rank {finished[0]} finished",
            )
        if hang_timeout_s > 0:
            now = time.time()
            for rank, beat in enumerate(self.heartbeats):
                last = beat.stat().st_mtime if beat.exists() else now - (time.monotonic() - self.started)
                if now - last > hang_timeout_s and self.procs[rank].poll() is None:
                    return Failure(FailureKind.HANG, rank, detail=f"no save for {hang_timeout_s:.0f} s")
        return None

    def terminate(self, grace_s: float, hurry: threading.Event) -> None:
        """What a pod's deletion does: SIGTERM to each rank's main process (a container's PID 1),
        ``grace_s`` to exit (a save on SIGTERM), then SIGKILL to whatever is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            if hurry.wait(0.05):
                break
        left = [r for r, p in enumerate(self.procs) if p.poll() is None]
        if left:
            log.warning("ranks %s did not exit within %.0f s of SIGTERM; killing them", left, grace_s)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for pump in self.pumps:
            pump.join(timeout=1.0)  # the ranks' last lines, before the launcher reports them


def restart_counter(registry: CollectorRegistry) -> Counter:
    """The launcher's one metric, served on --metrics-port."""
    return Counter(
        "strata_restarts_total", "Gang restarts decided, by failure kind.", ["reason"], registry=registry
    )


class Launcher:
    def __init__(self, settings: LaunchSettings) -> None:
        self.s = settings
        self.registry = CollectorRegistry()
        self.restarts = restart_counter(self.registry)
        self.tracker = RestartTracker(settings.policy, settings.nproc, on_decision=self._record)
        self.seaweed: SeaweedServer | None = None
        self.sidecars: list[subprocess.Popen[bytes] | None] = [None] * settings.sidecars
        self.sock_dir = Path(tempfile.mkdtemp(prefix="strata-launch-", dir="/tmp"))
        # Each simulated pod's memory-backed emptyDir for redundancy (tmpfs when there is one).
        shm = Path("/dev/shm")
        self.red_root = Path(tempfile.mkdtemp(prefix="strata-launch-", dir=shm if shm.is_dir() else None))
        self.sockets = [str(self.sock_dir / f"sidecar-{i}.sock") for i in range(settings.sidecars)]
        self.peer_ports = [_free_port() for _ in range(settings.sidecars)]
        self.storage = settings.storage
        self.endpoint = settings.s3_endpoint
        self._sidecar_starts = [0] * settings.sidecars
        #: the run's identity; the generation is "<run>/<restart count>"
        self.run_id = uuid.uuid4().hex[:12]
        self.generation_file = settings.workdir / "generation"
        #: the signal the launcher got (SIGTERM/SIGINT), and a second one (stop waiting)
        self.signalled: int | None = None
        self.hurry = threading.Event()
        #: set by any signal: ends a restart backoff at once
        self.woken = threading.Event()
        self._sidecars_signalled = False

    def on_signal(self, signum: int, _frame: object) -> None:
        self.woken.set()
        if self.signalled is None:
            self.signalled = signum
        else:
            self.hurry.set()

    def shut_down(self, gang: Gang | None) -> int:
        """The launcher got SIGTERM/SIGINT: stop like a pod does. SIGTERM goes to every rank and
        every sidecar at once (sidecars keep serving attached trainers until they exit), ranks get
        ``grace_period_s``, then sidecars finish their uploads (``stop``)."""
        assert self.signalled is not None
        name = signal.Signals(self.signalled).name
        log.warning(
            "%s: forwarding SIGTERM to the ranks and sidecars; ranks have %.0f s to exit",
            name,
            self.s.grace_period_s,
        )
        for proc in self.sidecars:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        self._sidecars_signalled = True
        t0 = time.monotonic()
        if gang is not None:
            gang.terminate(self.s.grace_period_s, self.hurry)
            codes = [p.returncode for p in gang.procs]
            log.info("ranks exited in %.2f s with %s", time.monotonic() - t0, codes)
        return 128 + self.signalled

    def _record(self, decision: object) -> None:
        from sidecar.coordinator import Decision

        assert isinstance(decision, Decision)
        if decision.restart:
            self.restarts.labels(decision.reason).inc()
        (log.warning if decision.restart else log.error)("%s", decision.message)

    def start_services(self) -> None:
        self.s.workdir.mkdir(parents=True, exist_ok=True)
        if self.storage is None:
            seaweed = SeaweedServer(self.s.workdir / "seaweed", log_path=self.s.workdir / "seaweed.log")
            try:
                seaweed.start()
            except SeaweedError as exc:
                raise CommandFailed(f"strata launch: {exc}") from None
            self.seaweed = seaweed
            seaweed.create_bucket("strata")
            self.storage, self.endpoint = "s3://strata/checkpoints", seaweed.endpoint
            log.info("embedded SeaweedFS S3 at %s (pid %d)", self.endpoint, seaweed.pid)
        self.announce()
        self.write_generation(0)
        for index in range(self.s.sidecars):
            self.start_sidecar(index)
        if self.s.metrics_port:
            start_http_server(self.s.metrics_port, addr="127.0.0.1", registry=self.registry)

    def ls_command(self) -> str:
        """The `strata ls` that lists this run's checkpoints."""
        assert self.storage is not None
        endpoint = f" --s3-endpoint {self.endpoint}" if self.endpoint else ""
        return (
            f"strata ls --storage {shlex.quote(self.storage)}{endpoint} "
            f"--namespace {self.s.namespace} --job {self.s.job}"
        )

    def announce(self) -> None:
        """Where this run's checkpoints go, before any rank prints: a rerun with the same job name
        resumes them."""
        where = f" at {self.endpoint}" if self.endpoint else ""
        embedded = f" (embedded SeaweedFS, pid {self.seaweed.pid})" if self.seaweed is not None else ""
        print(
            f"strata launch: job {self.s.namespace}/{self.s.job}, {self.s.nproc} rank(s)\n"
            f"  workdir  {self.s.workdir}  (sidecar and storage logs)\n"
            f"  storage  {self.storage}{where}{embedded}\n"
            f"  list it  {self.ls_command()}",
            file=sys.stderr,
            flush=True,
        )

    def write_generation(self, restart: int) -> str:
        """The one place sidecars read the gang generation from (a downward-API file in a pod)."""
        generation = f"{self.run_id}/{restart}"
        tmp = self.generation_file.with_name(".generation.tmp")
        tmp.write_text(generation + "\n")
        tmp.replace(self.generation_file)
        return generation

    def start_sidecar(self, index: int) -> None:
        strata = str(Path(sys.executable).parent / "strata")
        env = dict(os.environ)
        env.pop("STRATA_FAULTS", None)
        fault_index = int(os.environ.get("STRATA_SIDECAR_FAULTS_INDEX", "0"))
        if not self._sidecar_starts[index] and index == fault_index:  # testing hook: first start only
            env["STRATA_FAULTS"] = os.environ.get("STRATA_SIDECAR_FAULTS", "")
        self._sidecar_starts[index] += 1
        if self.endpoint:
            env["STRATA_S3_ENDPOINT"] = self.endpoint
        assert self.storage is not None
        socket_path = self.sockets[index]
        peers = ",".join(f"127.0.0.1:{p}" for i, p in enumerate(self.peer_ports) if i != index)
        redundancy = []
        if self.s.redundancy != "off":
            redundancy = [
                "--redundancy",
                self.s.redundancy,
                "--parity-group",
                str(self.s.parity_group),
                "--members",
                ",".join(f"127.0.0.1:{p}" for p in self.peer_ports),
                "--member-index",
                str(index),
                "--redundancy-dir",
                str(self.red_root / f"pod-{index}"),
            ]
        name = "sidecar.log" if self.s.sidecars == 1 else f"sidecar-{index}.log"
        with (self.s.workdir / name).open("a") as out:
            proc = subprocess.Popen(
                [
                    strata,
                    "sidecar",
                    "--storage",
                    self.storage,
                    "--socket",
                    socket_path,
                    "--metrics-port",
                    "0",
                    "--metrics-host",
                    "127.0.0.1",
                    "--keep",
                    str(self.s.keep),
                    "--generation-file",
                    str(self.generation_file.resolve()),
                    *(["--peer-port", str(self.peer_ports[index]), "--peers", peers] if peers else []),
                    *redundancy,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only; it forwards
            )
        self.sidecars[index] = proc
        deadline = time.monotonic() + 30
        while not Path(socket_path).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CommandFailed(
                    f"sidecar {index} did not start ({_last_line(self.s.workdir / name)}); "
                    f"see {self.s.workdir / name}"
                )
            time.sleep(0.05)
        log.info("sidecar %d on unix:%s (pid %d), storage %s", index, socket_path, proc.pid, self.storage)

    def recreate_pods(self) -> None:
        """What recreating every pod does to its sidecar: killed, its memory and emptyDir gone."""
        for index, proc in enumerate(self.sidecars):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            shutil.rmtree(self.red_root / f"pod-{index}", ignore_errors=True)
        log.info("pod-level restart: every sidecar recreated with empty memory")

    def dead_sidecar(self) -> Failure | None:
        for index, proc in enumerate(self.sidecars):
            if proc is not None and proc.poll() is not None:
                return Failure(FailureKind.LOST, detail=f"sidecar {index} died (exit {proc.returncode})")
        return None

    def checkpoint_shape(self) -> tuple[int | None, bool]:
        """The number of ranks that saved the newest committed checkpoint (None: there is none),
        and whether it loads on any number of ranks (saved through torch.distributed.checkpoint,
        or replicated state every rank saved alike: read only when the number differs from
        --nproc)."""
        assert self.storage is not None
        options = {"endpoint_url": self.endpoint} if self.storage.startswith("s3://") else {}
        store = open_store(self.storage, **options)
        try:
            step = mf.newest_committed(store, self.s.namespace, self.s.job)
            if step is None:
                return None, False
            commit = mf.read_commit(store, self.s.namespace, self.s.job, step)
            if commit.world_size == self.s.nproc:
                return commit.world_size, False
            first = mf.load_manifest(store, commit, 0)
            if first.dcp:
                return commit.world_size, True
            # every rank saved the same replicated state (client.resume() reshards it)
            rest = [mf.load_manifest(store, commit, r) for r in range(1, commit.world_size)]
            return commit.world_size, mf.replicated([first, *rest])
        finally:
            store.close()

    def run(self) -> int:
        self.start_services()
        heartbeat_dir = self.s.workdir / "heartbeats"
        heartbeat_dir.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while True:
            if self.signalled is not None:
                return self.shut_down(None)
            saved_by, reshardable = self.checkpoint_shape()
            config = self.tracker.check_world_size(self.s.nproc, saved_by, reshardable)
            if config is not None:
                self.tracker.decide(config)
                return 2
            if reshardable and saved_by != self.s.nproc:
                log.info(
                    "the newest checkpoint was saved by %s ranks and is reshardable (through DCP, or "
                    "replicated state client.resume() restores on any number of ranks): starting %d",
                    saved_by,
                    self.s.nproc,
                )
            log.info(
                "restart %d: starting %d ranks of %s/%s", attempt, self.s.nproc, self.s.namespace, self.s.job
            )
            generation = self.write_generation(attempt)
            gang = Gang(self.s, attempt, self.sockets, heartbeat_dir, generation)
            outcome: Failure | bool | None = None
            while outcome is None:
                time.sleep(0.05)
                if self.signalled is not None:
                    return self.shut_down(gang)
                outcome = gang.poll(self.s.hang_timeout_s)
                if outcome is None:
                    outcome = self.dead_sidecar()
            if outcome is True:
                log.info("all %d ranks finished", self.s.nproc)
                return 0
            assert isinstance(outcome, Failure)
            failed_at = time.monotonic()
            gang.kill()
            log.warning("%s; stopped all ranks in %.2f s", outcome.describe(), time.monotonic() - failed_at)
            if self.signalled is not None:
                return self.shut_down(None)
            decision = self.tracker.decide(outcome)
            if not decision.restart:
                return outcome.exit_code or 1
            if self.s.restart == "pod":
                self.recreate_pods()
            for index, proc in enumerate(self.sidecars):
                if proc is not None and proc.poll() is not None:
                    self.start_sidecar(index)
            self.woken.wait(decision.delay_s)
            if self.signalled is not None:  # SIGTERM during the backoff: no new gang
                return self.shut_down(None)
            attempt = decision.attempt

    def stop(self) -> None:
        running = [p for p in self.sidecars if p is not None and p.poll() is None]
        for proc in running:
            if not self._sidecars_signalled:  # a second SIGTERM would cut a sidecar's drain short
                proc.send_signal(signal.SIGTERM)  # finishes in-flight uploads first
        for proc in running:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.seaweed is not None:
            self._stop_storage(self.seaweed)
        for path in self.sockets:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(self.red_root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.sock_dir.rmdir()

    def _stop_storage(self, seaweed: SeaweedServer) -> None:
        data = seaweed.data_dir
        if not self.s.keep_storage:
            seaweed.stop()
            print(
                f"strata launch: checkpoints kept in {data}; `strata dev-storage --dir {data}` serves "
                "them again (or launch with --keep-storage)",
                file=sys.stderr,
                flush=True,
            )
            return
        ls = self.ls_command()
        pid = seaweed.detach()
        print(
            f"strata launch: the embedded SeaweedFS keeps running (pid {pid}) for inspection:\n"
            f"  {ls}\n"
            f"  stop it with: kill {pid}   (the data stays in {data})",
            file=sys.stderr,
            flush=True,
        )


def job_from_command(command: list[str]) -> str:
    """The job name a launch takes from its training command when none is given: the script's
    name (``python examples/train_ddp.py`` -> ``train_ddp``, ``python -m pkg.train`` ->
    ``pkg.train``), so two scripts never share (and resume) each other's checkpoints while a rerun
    of one script resumes its own."""
    name = ""
    for i, arg in enumerate(command):
        if arg == "-m" and i + 1 < len(command):
            name = command[i + 1]
            break
        if arg == "-c":  # inline code: named after the interpreter
            break
        if arg.endswith(".py") or (i > 0 and not arg.startswith("-")):
            name = Path(arg).name.removesuffix(".py")
            break
    if not name and command:
        name = Path(command[0]).name
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")[:253]
    return name or "local-job"


def _last_line(path: Path) -> str:
    """The last line a sidecar wrote: its one-line reason when it refused to start."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, required=True, help="number of ranks (processes) to run")
    p.add_argument(
        "--job",
        default=os.environ.get("STRATA_JOB"),
        help="job name [STRATA_JOB]; default: the training script's name (train_ddp for "
        "train_ddp.py), so a rerun of a script resumes it and another script starts its own job",
    )
    p.add_argument("--namespace", default=os.environ.get("STRATA_NAMESPACE", "default"), help="namespace")
    p.add_argument(
        "--storage", default=os.environ.get("STRATA_STORAGE"), help="default: an embedded SeaweedFS"
    )
    p.add_argument("--s3-endpoint", default=os.environ.get("STRATA_S3_ENDPOINT"), help="S3 endpoint URL")
    p.add_argument("--max-restarts", type=int, default=3, help="gang restarts before giving up (default 3)")
    p.add_argument("--backoff-s", type=float, default=1.0, help="first restart delay; doubles each time")
    p.add_argument(
        "--hang-timeout-s", type=float, default=0.0, help="restart when a rank saves nothing this long"
    )
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="process-group timeout handed to ranks")
    p.add_argument(
        "--workdir", help="logs and the embedded S3's data (default: .strata/launch/<job>, one per job)"
    )
    p.add_argument(
        "--keep-storage",
        action="store_true",
        help="leave the embedded SeaweedFS running after exit (printing its pid and the `strata ls` "
        "to inspect the run); by default it stops, its data kept in the workdir",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="serve strata_restarts_total here (0: off)")
    p.add_argument("--keep", type=int, default=3, help="committed steps the sidecar keeps (0: all)")
    p.add_argument(
        "--sidecars",
        type=int,
        default=1,
        help="sidecars, one per simulated pod, each serving a block of ranks (default 1: one for all)",
    )
    p.add_argument(
        "--grace-period-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: SIGTERM every rank and sidecar, give ranks this long to exit "
        "(a pod's terminationGracePeriodSeconds; default 30), then kill them",
    )
    p.add_argument(
        "--restart",
        choices=("inplace", "pod"),
        default="inplace",
        help="inplace (default): a gang restart restarts the ranks and keeps the sidecars and their "
        "memory; pod: it also recreates every sidecar with empty memory, as recreating pods does",
    )
    p.add_argument(
        "--redundancy",
        choices=("off", "buddy", "parity"),
        default="off",
        help="protect each simulated pod's committed snapshots in the other pods' memory: buddy (a "
        "copy on the next pod) or parity (XOR over groups of --parity-group pods); needs --sidecars >= 2",
    )
    p.add_argument("--parity-group", type=int, default=4, help="pods per parity group (default 4)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")


def main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("give the training command after --, e.g. -- python train.py")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if not 1 <= args.sidecars <= args.nproc:
        raise ValueError(f"--sidecars must be between 1 and --nproc ({args.nproc}), got {args.sidecars}")
    job = args.job or job_from_command(command)
    mf.check_name("job", job)
    if args.redundancy == "buddy" and args.sidecars < 2:
        raise ValueError("--redundancy buddy needs --sidecars >= 2 (a copy on another pod)")
    if args.redundancy == "parity" and args.sidecars < 3:
        raise ValueError("--redundancy parity needs --sidecars >= 3 (use buddy for 2)")
    if args.keep < 0:
        raise ValueError(f"--keep must be >= 0 (0: keep every committed step), got {args.keep}")
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be a TCP port, 0 to 65535 (0: off), got {args.metrics_port}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    for flag in ("backoff_s", "hang_timeout_s", "grace_period_s"):
        if not 0 <= getattr(args, flag) < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {getattr(args, flag)}")
    if not 0 < args.pg_timeout_s < float("inf"):
        raise ValueError(f"--pg-timeout-s must be positive seconds, got {args.pg_timeout_s}")
    if args.keep_storage and args.storage is not None:
        given = "--storage" if "--storage" in sys.argv else "STRATA_STORAGE"
        raise ValueError(
            f"--keep-storage keeps the embedded SeaweedFS running; with {given} ({args.storage}) "
            "there is none"
        )
    if args.storage is not None and not args.storage.startswith(("s3://", "file://")):
        raise ValueError(
            f"--storage {args.storage!r}: expected s3://bucket/prefix or file:///path (every sidecar "
            "process reaches it), or none for an embedded SeaweedFS"
        )
    settings = LaunchSettings(
        nproc=args.nproc,
        command=command,
        job=job,
        namespace=args.namespace,
        storage=args.storage,
        s3_endpoint=args.s3_endpoint,
        workdir=Path(args.workdir) if args.workdir else Path(".strata/launch") / job,
        policy=RestartPolicy(max_restarts=args.max_restarts, backoff_s=args.backoff_s),
        hang_timeout_s=args.hang_timeout_s,
        pg_timeout_s=args.pg_timeout_s,
        metrics_port=args.metrics_port,
        keep=args.keep,
        sidecars=args.sidecars,
        grace_period_s=args.grace_period_s,
        restart=args.restart,
        redundancy=args.redundancy,
        parity_group=args.parity_group,
        keep_storage=args.keep_storage,
    )
    launcher = Launcher(settings)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (a pod's deletion, a scheduler) and Ctrl-C stop the job the way a pod stops.
        previous = {sig: signal.signal(sig, launcher.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return launcher.run()
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
