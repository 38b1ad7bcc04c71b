"""The ``strata`` command."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sidecar import __version__, config
from sidecar import manifest as mf
from sidecar.api import MAX_STEP, progress
from sidecar.errors import CommandFailed, CorruptObject, ObjectNotFound, StrataError
from sidecar.local import dev_storage, launch
from sidecar.operator import cli as operator_cli
from sidecar.operator.names import PLACEHOLDER_ENV, SIDECAR_CONTAINER
from sidecar.pipeline.plan import read_snapshot
from sidecar.store import open_store
from sidecar.store.base import Store

EPILOG_SIDECAR = """\
examples:
  # serve on the default unix socket, checkpoints to SeaweedFS/MinIO/S3
  strata sidecar --storage s3://ckpt/prod --s3-endpoint http://127.0.0.1:8333
  # local disk instead of S3
  strata sidecar --storage file:///var/lib/strata
  # show the effective settings (flags > STRATA_* env > defaults) and exit
  STRATA_STORAGE=file:///tmp/x strata sidecar --print-config
"""

EPILOG_STORE = """\
examples:
  strata ls   --storage s3://ckpt/prod --s3-endpoint http://127.0.0.1:8333 --job recsys
  strata show --storage file:///var/lib/strata --job recsys --step 120 --rank 0
  strata verify --storage file:///var/lib/strata --job recsys            # newest step
  strata verify --storage file:///var/lib/strata --job recsys --all      # every committed step
  strata export --storage file:///var/lib/strata --job llm --format dcp --out /tmp/llm-dcp
  strata export --storage file:///var/lib/strata --job recsys --format torch --out /tmp/recsys
  strata import --storage file:///var/lib/strata --job llm2 --from /tmp/llm-dcp --step 1000
  strata markers --storage file:///var/lib/strata --job recsys                 # steps marked unusable
  strata markers --storage file:///var/lib/strata --job recsys --clear --step 120
The storage flags also read STRATA_STORAGE, STRATA_S3_ENDPOINT, STRATA_NAMESPACE and STRATA_JOB.
"""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage", default=os.environ.get("STRATA_STORAGE"), help="s3://bucket/prefix or file:///path"
    )
    p.add_argument("--s3-endpoint", default=os.environ.get("STRATA_S3_ENDPOINT"), help="S3 endpoint URL")
    p.add_argument("--namespace", default=os.environ.get("STRATA_NAMESPACE", "default"), help="job namespace")
    p.add_argument("--job", default=os.environ.get("STRATA_JOB"), help="job name")


def _open(args: argparse.Namespace) -> Store:
    if not args.storage:
        raise ValueError("--storage (or STRATA_STORAGE) is required")
    if not args.job:
        raise ValueError("--job (or STRATA_JOB) is required")
    if args.storage.startswith("s3://"):
        return open_store(args.storage, endpoint_url=args.s3_endpoint or None)
    if args.storage.startswith("file://"):
        return open_store(args.storage, create=False)  # a mistyped path must not become an empty store
    return open_store(args.storage)


def cmd_sidecar(args: argparse.Namespace) -> int:
    if PLACEHOLDER_ENV in os.environ:
        return _stand_in()
    settings = config.from_sources(args)
    settings.validate()  # --print-config shows only settings the sidecar would run with
    if args.print_config:
        print(json.dumps(settings.redacted(), indent=2, sort_keys=True))
        return 0
    from sidecar.budget import tune_allocator
    from sidecar.server import SidecarServer  # grpc server only when serving
    from sidecar.server.app import raise_nofile, yield_cpu

    yield_cpu(settings)
    raise_nofile()
    tune_allocator()
    server = SidecarServer(settings).start()
    done, hurry = threading.Event(), threading.Event()

    def stop(signum: int, _frame: Any) -> None:
        (hurry if done.is_set() else done).set()  # a second signal cuts the drain short

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"strata sidecar {__version__} ready on unix:{server.socket_path}", flush=True)
    done.wait()
    drain_shutdown(server, settings.drain_timeout_s, hurry)
    return 0


def _stand_in() -> int:
    """The sidecar's stand-in from a workload's pod template, run as written: the pod webhook that
    completes it in each pod did not (the chart uninstalled, the webhook failing open, the opt-in
    label removed). A native sidecar that exits is restarted forever and keeps the pod from being
    Ready, so it stays up doing nothing until it is stopped, and says why."""
    logging.getLogger("strata").warning(
        "this %s is the stand-in from the workload's pod template, not completed by the operator's "
        "webhook: this pod runs without checkpointing (the pod is not opted in, or the operator's pod "
        "webhook was not called); idle until stopped",
        SIDECAR_CONTAINER,
    )
    done = threading.Event()

    def stop(_signum: int, _frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done.wait()
    return 0


def drain_shutdown(server: Any, drain_s: float, hurry: threading.Event | None = None) -> None:
    """The sidecar's SIGTERM: a trainer that got SIGTERM with it (`strata launch`, a sidecar that
    is not a native one) may still save and wait for that save, so serve attached trainers until
    they detach or ``drain_s`` passes; then finish the uploads in hand and stop. A native sidecar
    on Kubernetes is stopped only after its trainer exited: the drain ends at once."""
    log = logging.getLogger("strata")
    t0 = time.monotonic()
    attached = server.drain(0)
    if attached:
        log.info("SIGTERM: serving %d attached trainer(s) until they exit (up to %.0f s)", attached, drain_s)
        left = server.drain(drain_s, hurry)
        if left:
            log.warning(
                "drain ended after %.1f s with %d trainer(s) still attached", time.monotonic() - t0, left
            )
        else:
            log.info("every trainer detached after %.1f s", time.monotonic() - t0)
    log.info("SIGTERM: finishing uploads in hand")
    t1 = time.monotonic()
    server.stop(grace=5)
    log.info("uploads finished in %.1f s; sidecar stopped", time.monotonic() - t1)


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open(args)
    steps = mf.committed_steps(store, args.namespace, args.job)
    if not steps:
        print(f"no committed checkpoints for {args.namespace}/{args.job} in {args.storage}")
        return 0
    print(f"{'STEP':>12}  {'RANKS':>5}  {'SIZE':>10}  COMMITTED")
    for step in steps:
        c = mf.read_commit(store, args.namespace, args.job, step)
        print(f"{step:>12}  {c.world_size:>5}  {_human(c.total_bytes):>10}  {_when(c.committed_at)}")
    return 0


def _pick_step(store: Store, args: argparse.Namespace) -> int:
    if args.step is not None:
        return int(args.step)
    step = mf.newest_committed(store, args.namespace, args.job)
    if step is None:
        raise SystemExit(f"strata: no committed checkpoint for {args.namespace}/{args.job}")
    return step


def cmd_show(args: argparse.Namespace) -> int:
    store = _open(args)
    step = _pick_step(store, args)
    commit = mf.read_commit(store, args.namespace, args.job, step)
    m = mf.load_manifest(store, commit, args.rank)
    if args.json:
        print(m.to_json().decode())
        return 0
    print(f"job        {m.namespace}/{m.job}")
    print(f"step       {m.step}  (rank {m.rank} of {m.world_size}, attempt {m.attempt}, save {m.save_id})")
    print(f"committed  {_when(commit.committed_at)}")
    print(f"format     v{m.format_version}; {len(m.objects)} objects, {_human(m.total_bytes)}")
    stored = sum(o.size for o in m.objects)
    if m.checkpoint == "diff":
        kind = f"diff on step {m.base_step} ({m.policy}; restore reads steps {m.requires} first)"
    else:
        kind = f"full ({m.policy})" if m.policy else "full"
    print(f"checkpoint {kind}; {_human(stored)} stored")
    print(f"\n{'TENSOR':<48} {'DTYPE':<10} {'SHAPE':<20} {'SIZE':>10}  ENCODING")
    for t in m.tensors:
        detail = []
        if t.bits or t.cast:
            detail.append(f"{t.bits} bits" if t.bits else t.cast)
        if t.rel_l2_error is not None:
            detail.append(f"rel. L2 error {t.rel_l2_error:.2e}")
        if t.changed_rows >= 0:
            detail.append(f"{t.changed_rows} rows by {t.tracking or 'values'}")
        extra = f"  ({', '.join(detail)})" if detail else ""
        print(
            f"{t.name:<48} {t.dtype:<10} {tuple(t.shape)!s:<20} {_human(t.nbytes):>10}  {t.encoding}{extra}"
        )
    foreign = m.foreign()
    if m.replicas:
        owners, mine = sorted({r.owner for r in foreign}), len(m.replicas) - len(foreign)
        print(
            f"\nreplicas   {len(m.replicas)} replicated tensors: this rank saved {mine}, "
            f"{_human(sum(r.nbytes for r in foreign))} of them saved by rank(s) {owners}"
        )
        for r in foreign:
            print(
                f"{r.name:<48} {r.dtype:<10} {tuple(r.shape)!s:<20} {_human(r.nbytes):>10}  on rank {r.owner}"
            )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open(args)
    steps = mf.committed_steps(store, args.namespace, args.job) if args.all else [_pick_step(store, args)]
    corrupt_steps = 0
    for step in steps:
        bad = 0
        commit = mf.read_commit(store, args.namespace, args.job, step)
        # A diff is only as good as the commits it is applied on: the very ones it names
        # (COMMIT key and sha256), not just any commit of those steps.
        for base_ref in commit.required_commits:
            needs = f"step {step}: needs step {base_ref.step}"
            try:
                mf.load_ref(store, base_ref)
            except ObjectNotFound:
                print(f"{needs}, which is not committed ({base_ref.key} is missing)")
                bad += 1
            except CorruptObject as exc:
                print(f"{needs}, whose COMMIT is not the one it was built on: {exc}")
                bad += 1
        named = {r.step for r in commit.required_commits}
        for base in commit.requires:
            if base not in named and not mf.is_committed(store, args.namespace, args.job, base):
                print(f"step {step}: needs step {base}, which is not committed")
                bad += 1
        objects = []
        manifests = {}
        for ref in commit.manifests:
            try:
                manifests[ref.rank] = mf.load_manifest(store, commit, ref.rank)
                objects.extend(manifests[ref.rank].objects)
            except (CorruptObject, StrataError) as exc:
                print(f"step {step}: rank {ref.rank} MANIFEST: {exc}")
                bad += 1
        if len(manifests) == len(commit.manifests):
            try:  # every replicated tensor held by its owner, every rank's sample equal to the owner's
                mf.check_replicas(step, manifests)
            except StrataError as exc:
                print(f"step {step}: {exc}")
                bad += 1
        total = sum(o.size for o in objects)
        with progress.bar(total, f"verify step {step}") as shown:
            for obj in objects:
                try:
                    mf.read_object(store, obj)
                except StrataError as exc:
                    progress.write(f"step {step}: {exc}")
                    bad += 1
                shown.update(obj.size)
        print(f"step {step}: {'OK' if not bad else 'CORRUPT'} ({len(objects)} objects, {_human(total)})")
        corrupt_steps += bool(bad)
    return 1 if corrupt_steps else 0


def stage_export(
    store: Store, commit: mf.Commit, staging: Path, on_bytes: Callable[[int], object] | None = None
) -> None:
    """Every rank's snapshot of ``commit``, as a restore from storage gives it, into ``staging``
    (``rank-<r>.bin``) with what ``trainer_client.export`` needs to rebuild its state
    (``rank-<r>.json``: the tensors and where they lie, the replicated ones, the tree)."""
    with ThreadPoolExecutor(8, thread_name_prefix="strata-export") as pool:
        for ref in commit.manifests:
            manifest = mf.load_manifest(store, commit, ref.rank)
            refs = {r.step: r for r in manifest.required_commits}

            def load(older: int, rank: int = ref.rank, refs: dict = refs) -> mf.Manifest:
                if older not in refs:
                    raise ObjectNotFound(f"step {commit.step} names no COMMIT for its base step {older}")
                return mf.load_manifest(store, mf.load_ref(store, refs[older]), rank)

            pieces = read_snapshot(store, manifest, load, pool)
            with open(staging / f"rank-{ref.rank}.bin", "wb") as f:
                for piece in pieces:
                    f.write(piece)
                    if on_bytes is not None:
                        on_bytes(len(piece))
            (staging / f"rank-{ref.rank}.json").write_text(
                json.dumps(
                    {
                        "tensors": [
                            {
                                "name": t.name,
                                "dtype": t.dtype,
                                "shape": t.shape,
                                "offset": t.offset,
                                "nbytes": t.nbytes,
                                "bits": t.bits,
                                "cast": t.cast,
                                "rel_l2_error": t.rel_l2_error,
                            }
                            for t in manifest.tensors
                        ],
                        "replicas": [
                            {"name": r.name, "index": r.index, "owner": r.owner} for r in manifest.replicas
                        ],
                        "world_size": commit.world_size,
                        "tree": manifest.tree,
                    }
                )
            )
            del pieces


def cmd_export(args: argparse.Namespace) -> int:
    """A committed step, whatever API saved it, in a format that loads without Strata (``--format``
    dcp, torch or safetensors): every rank's snapshot is read here (torch-free) into a staging
    directory under ``--out``, then a Python with torch (``--python``, this one by default) writes
    the files from it (``trainer_client.export``, which also says how the ranks were laid out)."""
    store = _open(args)
    step = _pick_step(store, args)
    commit = mf.read_commit(store, args.namespace, args.job, step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".strata-export-", dir=out))
    try:
        with progress.bar(commit.total_bytes, f"export step {step}: read") as shown:
            stage_export(store, commit, staging, on_bytes=shown.update)
        if progress.shown():
            print(f"export step {step}: writing the files with {args.python}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [args.python, "-m", "trainer_client.export", str(staging), str(out), "--format", args.format],
            capture_output=True,
            text=True,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _torch_half_done(done, "export", "writing", args.python)
    print(f"step {step} of {args.namespace}/{args.job} ({commit.world_size} ranks) exported to {out}")
    print(done.stdout.strip())
    return 0


def _torch_half_done(done: subprocess.CompletedProcess[str], command: str, verb: str, python: str) -> None:
    """Exit with what went wrong in the torch half of ``strata export``/``import`` (a subprocess:
    this CLI never imports torch), naming the fix when torch or the client is missing there."""
    if done.returncode == 0:
        return
    if "No module named" in done.stderr:
        extra = "export" if "safetensors" in done.stderr else "trainer"
        raise SystemExit(
            f"strata {command}: {verb} the files needs torch and the trainer client in {python}: "
            f"pip install -e '<this repository>[{extra}]' there, or pass --python PATH to one that has them\n"
            + done.stderr.strip().splitlines()[-1]
        )
    said = done.stderr.strip() or done.stdout.strip()
    raise SystemExit(f"strata {command}: {said.removeprefix(command + ': ')}")


def _run_shown(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the torch half, its stdout and stderr captured (the error to report), and its stderr
    also passed on as it comes when this stderr is a terminal: the child's progress bars."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    err = bytearray()
    passing = progress.shown()

    def pump(stream: Any, into: bytearray, echo: bool) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            into += chunk
            if echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()

    out = bytearray()
    reader = threading.Thread(target=pump, args=(proc.stdout, out, False), daemon=True)
    reader.start()
    pump(proc.stderr, err, passing)
    reader.join()
    code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    text = err.decode(errors="replace")
    if passing:  # drop what was already shown but keep the last line for the error report
        text = "\n".join(line.split("\r")[-1] for line in text.splitlines())
    return subprocess.CompletedProcess(argv, code, out.decode(errors="replace"), text)


def cmd_import(args: argparse.Namespace) -> int:
    """A plain DCP directory (``dcp.save`` with ``FileSystemWriter``) in, as committed step
    ``--step`` of a new job: a sidecar for the job's storage runs in this process (torch-free), and a
    Python with torch (``--python``) reads the directory without unpickling anything but DCP's
    metadata classes and saves it through that sidecar as one rank (``trainer_client.import_dcp``);
    ``StrataReader`` then loads it on any number of ranks."""
    store = _open(args)
    source = Path(args.source)
    if not (source / ".metadata").is_file():
        raise SystemExit(f"strata import: {source} is not a DCP checkpoint (it has no .metadata)")
    if not 0 <= args.step <= MAX_STEP:
        raise SystemExit(
            f"strata import: --step must be 0 to {MAX_STEP} (keys hold 12 digits), got {args.step}"
        )
    steps = mf.committed_steps(store, args.namespace, args.job)
    if steps:
        raise SystemExit(
            f"strata import: {args.namespace}/{args.job} already has committed steps (newest {steps[-1]}): "
            "import into a new job name"
        )
    from sidecar.server import SidecarServer  # grpc server only when importing

    work = Path(tempfile.mkdtemp(prefix="strata-import-"))
    try:
        settings = config.SidecarSettings(
            storage=args.storage,
            s3_endpoint=args.s3_endpoint or "",
            socket=str(work / "sidecar.sock"),
            shm_dir=str(work / "shm"),
            metrics_port=0,
            keep=0,
        )
        (work / "shm").mkdir()
        server = SidecarServer(settings).start()
        try:
            show = ["--progress"] if progress.shown() else []
            done = _run_shown(
                [
                    args.python,
                    "-m",
                    "trainer_client.import_dcp",
                    str(source),
                    "--step",
                    str(args.step),
                    *show,
                ],
                env=dict(
                    os.environ,
                    STRATA_SOCKET=server.socket_path,
                    STRATA_JOB=args.job,
                    STRATA_NAMESPACE=args.namespace,
                    STRATA_RANK="0",
                    STRATA_WORLD_SIZE="1",
                    STRATA_GENERATION="import/0",
                ),
            )
        finally:
            server.stop(grace=5)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _torch_half_done(done, "import", "reading", args.python)
    print(
        f"{source} imported as step {args.step} of {args.namespace}/{args.job}: load it on any number of "
        "ranks with torch.distributed.checkpoint.load(state, storage_reader=StrataReader(client))"
    )
    return 0


# --- markers and EPOCH repair: what a restore skips, and fences a damaged record hides -----------


def cmd_markers(args: argparse.Namespace) -> int:
    """List the job's UNUSABLE markers (why, who, when), or clear them (--clear, --step)."""
    store = _open(args)
    steps = None if not args.step else set(args.step)
    if args.clear:
        gone = mf.clear_markers(store, args.namespace, args.job, steps)
        for mk in gone:
            print(f"cleared: {mk.describe()}")
        if not gone:
            print(f"no unusable markers to clear for {args.namespace}/{args.job}")
        return 0
    markers = [
        mk for mk in mf.unusable_markers(store, args.namespace, args.job) if steps is None or mk.step in steps
    ]
    if args.json:
        print(json.dumps([dataclasses.asdict(mk) for mk in markers], indent=1))
        return 0
    if not markers:
        print(f"no unusable markers for {args.namespace}/{args.job}")
        return 0
    print(f"{'STEP':>12}  {'ATTEMPT':>7}  {'CAUSE':<8}  {'MARKED':<23}  BY / DETAIL")
    for mk in markers:
        when = _when(mk.at) if mk.at else "-"
        print(f"{mk.step:>12}  {mk.attempt:>7}  {mk.cause:<8}  {when:<23}  {mk.by or '-'}")
        print(f"{'':>12}  {'':>7}  {'':<8}  {'':<23}  {mk.detail}")
    return 0


def cmd_repair_epoch(args: argparse.Namespace) -> int:
    """Rewrite a damaged EPOCH record from the history of the records before it and the restore
    step the operator names (the one that attempt restored)."""
    store = _open(args)
    fences = mf.read_fences(store, args.namespace, args.job)
    try:
        damage = mf.epoch_damage(store, args.namespace, args.job, args.attempt)
    except ObjectNotFound:
        raise SystemExit(
            f"strata repair-epoch: attempt {args.attempt} has no EPOCH record; nothing written"
        ) from None
    if damage is None:
        raise SystemExit(
            f"strata repair-epoch: the EPOCH record of attempt {args.attempt} reads fine; nothing written"
        )
    restore: tuple[int, int] | None = None
    if args.restore_step != "none":
        try:
            step = int(args.restore_step)
        except ValueError:
            raise SystemExit(
                f"strata repair-epoch: --restore-step must be a step or none, got {args.restore_step!r}"
            ) from None
        earlier = mf.Fences(
            {a: r for a, r in fences.restores.items() if a < args.attempt}, fences.newest, fences.generations
        )
        attempts = [
            a
            for a in mf.step_commits(store, args.namespace, args.job, step)
            if a < args.attempt and earlier.valid(a, step)
        ]
        if not attempts:
            raise SystemExit(
                f"strata repair-epoch: step {step} has no valid COMMIT of an attempt before "
                f"{args.attempt}; nothing written"
            )
        restore = (attempts[-1], step)
    epoch = mf.repair_epoch(store, args.namespace, args.job, args.attempt, restore, fences, args.generation)
    print(
        f"rewrote {mf.epoch_key(args.namespace, args.job, args.attempt)}: attempt {epoch.attempt} restores "
        + ("nothing" if restore is None else f"step {restore[1]} (attempt {restore[0]})")
    )
    return 0


def _add_bucket_commands(sub: Any) -> None:
    p = sub.add_parser(
        "markers",
        help="list (or clear) the steps marked unusable, with why and who marked them",
        description="List the job's UNUSABLE markers: steps a rank could not restore (cause: missing "
        "after retries, or corrupt), which every later restore skips. --clear makes them restorable again.",
        epilog=EPILOG_STORE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _store_args(p)
    p.add_argument("--step", type=int, action="append", help="only this step (repeatable)")
    p.add_argument("--clear", action="store_true", help="delete the markers (of --step, else all)")
    p.add_argument("--json", action="store_true", help="print the markers as JSON")
    p.set_defaults(func=cmd_markers)
    p = sub.add_parser(
        "repair-epoch",
        help="rewrite a damaged EPOCH record from the records before it",
        description="Rewrite a damaged EPOCH/<attempt> record: its history from the records before it, "
        "its restore step as given (the step that attempt restored).",
        epilog=EPILOG_STORE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _store_args(p)
    p.add_argument("--attempt", type=int, required=True, help="the attempt whose record is damaged")
    p.add_argument("--restore-step", required=True, help="the step that attempt restored, or none")
    p.add_argument("--generation", default="repaired/0", help="the generation it ran (default: repaired/0)")
    p.set_defaults(func=cmd_repair_epoch)


class Parser(argparse.ArgumentParser):
    """argparse that names the flag a misspelt one was closest to (``--stroage``: did you mean
    ``--storage``?), the command's own flags, and a misspelt command too."""

    _argv: list[str] | None = None

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # The unknown flag went past the subcommand's parser: say it with that one's usage.
            chosen = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    chosen = action.choices.get(str(getattr(parsed, action.dest, "")), self)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str) -> Any:
        hints = []
        flags = [o for o in self._option_string_actions if o.startswith("--")]
        for token in self._argv or ():
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in self._option_string_actions:
                close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
                if close:
                    hints.append(f"{name}: did you mean {close[0]}?")
        if "invalid choice" in message:
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for token in self._argv or ():
                        close = difflib.get_close_matches(token, list(action.choices), n=1, cutoff=0.6)
                        if f"'{token}'" in message and close:
                            hints.append(f"did you mean {close[0]}?")
                            break
        super().error("; ".join([message, *hints]))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="strata",
        description="Strata: checkpointing for PyTorch training on Kubernetes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and tracebacks with errors (or STRATA_DEBUG=1)",
    )
    # Not dest="command": `strata launch` names its training command so.
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "sidecar",
        help="serve trainers of this pod over gRPC and upload their checkpoints",
        description="Run the sidecar: receive snapshots from trainers on a unix socket, "
        "upload them and commit them.",
        epilog=EPILOG_SIDECAR,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the effective settings and exit")
    p.set_defaults(func=cmd_sidecar)

    p = sub.add_parser(
        "launch",
        help="run a distributed job locally with automatic gang restart",
        description="Run --nproc ranks as local processes with a sidecar and (by default) an embedded "
        "SeaweedFS. When a rank fails, all ranks are stopped and restarted from the newest committed step.",
        epilog=launch.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_arguments(p)
    p.set_defaults(func=launch.main)

    p = sub.add_parser(
        "dev-storage",
        help="run a local S3 server (the embedded SeaweedFS) with a bucket, for trying Strata out",
        description="Start SeaweedFS on 127.0.0.1, create the bucket, print the settings to use with "
        "`strata sidecar`, the trainer and `strata ls`, and stay in the foreground: Ctrl-C stops it.",
        epilog=dev_storage.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dev_storage.add_arguments(p)
    p.set_defaults(func=dev_storage.main)

    p = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (gang restarts, Checkpoint and StrataJob objects)",
        description="Run the operator: watch opted-in Jobs and JobSets, restart their gangs, "
        "and turn the sidecars' reports into Checkpoint objects.",
        epilog=operator_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    operator_cli.add_arguments(p)
    p.set_defaults(func=operator_cli.main)

    for name, func, text in (
        ("ls", cmd_ls, "list the committed checkpoints of a job"),
        ("show", cmd_show, "print one rank's manifest of a committed step"),
        ("verify", cmd_verify, "re-read a committed step and check every checksum"),
        (
            "export",
            cmd_export,
            "write a committed step as a plain DCP directory, a torch.save file or safetensors",
        ),
        ("import", cmd_import, "take a plain DCP checkpoint directory in as a new job's committed step"),
    ):
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=EPILOG_STORE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _store_args(p)
        if name == "export":
            p.add_argument(
                "--format",
                choices=["dcp", "torch", "safetensors"],
                required=True,
                help="dcp: a plain DCP directory; torch: a torch.load-able file; safetensors: tensors only",
            )
            p.add_argument("--out", required=True, help="directory to write (created if missing)")
        if name == "import":
            p.add_argument("--from", dest="source", required=True, help="the DCP directory (dcp.save's)")
            p.add_argument("--step", type=int, default=0, help="the step it becomes (default: 0)")
        if name in ("export", "import"):
            p.add_argument(
                "--python",
                default=sys.executable,
                help="a Python with torch and strata-ckpt[trainer], which reads or writes DCP's files "
                "(default: this one)",
            )
        if name in ("show", "verify", "export"):
            p.add_argument("--step", type=int, help="step to use (default: newest committed)")
        if name == "show":
            p.add_argument("--rank", type=int, default=0, help="rank whose manifest to show")
            p.add_argument("--json", action="store_true", help="print the raw manifest JSON")
        if name == "verify":
            p.add_argument("--all", action="store_true", help="verify every committed step")
        p.set_defaults(func=func)
    _add_bucket_commands(sub)
    return parser


#: Exit status of a command given wrong flags, variables or names (argparse's own).
EXIT_USAGE = 2
#: Exit status of a command that was given sensible input but could not do its work.
EXIT_FAILED = 1
#: Exit status when the reader of the output went away (`strata show | head`), as a shell reports
#: a command SIGPIPE ended.
EXIT_PIPE = 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Every expected failure ends here as one line naming what is wrong, without a traceback
    (``-v`` or ``STRATA_DEBUG=1`` shows it): exit 2 for wrong input, 1 for a failure to do the work
    (storage unreachable, a process that died)."""
    args = build_parser().parse_args(argv)
    # The server logs its progress; the read-only commands print their own and log only problems.
    quiet = logging.INFO if args.subcommand in ("sidecar", "launch", "operator") else logging.WARNING
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else quiet,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for warning in config.unknown_env():
        logging.getLogger("strata").warning("%s", warning)
    debug = args.verbose or os.environ.get("STRATA_DEBUG", "") not in ("", "0")
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe can still be told apart
        return status
    except BrokenPipeError:
        # Nobody reads the rest: drop it (Python would complain again flushing stdout at exit).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except (StrataError, ValueError, OSError, CommandFailed) as exc:
        if debug:
            raise
        print(f"strata {args.subcommand}: {exc}", file=sys.stderr)
        # Storage that cannot be reached (a StrataError that may pass on retry) is a failure to do
        # the work, not wrong input.
        failed = isinstance(exc, (OSError, CommandFailed)) or getattr(exc, "temporary", False)
        return EXIT_FAILED if failed else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
