"""Engine: the one object the gRPC servicer (and the server, the tests) calls. It builds the
components over one Shared state and hands each call to the component that owns it; it holds
no logic of its own beyond the order of shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from sidecar import manifest as mf
from sidecar.api import MAX_STEP, pb
from sidecar.config import SidecarSettings
from sidecar.errors import InvalidArgument
from sidecar.gang import JobGang, Peers, Position
from sidecar.metrics import Metrics
from sidecar.store.base import Store

from .admission import Admission
from .attempts import Attempts
from .commit import Commits
from .held import Held
from .redundancy import Redundancy
from .reports import Reports
from .restore import Restorer
from .state import Shared
from .types import Identity, JobKey, RestoreData, Snapshot, TensorSpec


class Engine:
    def __init__(
        self, settings: SidecarSettings, store: Store, metrics: Metrics, peers: Peers | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.started = time.time()
        self.shared = shared = Shared(settings, store, metrics, peers)
        self.peers = shared.peers
        self.segments = shared.segments
        self.quant = shared.quant
        self.memory = shared.memory
        self.held = Held(shared)
        self.reports = Reports(shared)
        self.reporter = self.reports.reporter
        self.redundancy = Redundancy(shared, self.held)
        self.attempts = Attempts(shared, self.held, self.reports)
        self.commits = Commits(shared, self.held, self.reports, self.redundancy)
        self.restorer = Restorer(shared, self.held, self.attempts, self.redundancy)
        self.segments.on_drop(
            lambda name, owner: self.held.drop_segment(name, owner, self.redundancy.protecting)  # type: ignore[arg-type]
        )
        self.attempts.holdings_of = self._holdings
        self.admission = Admission(
            shared, self.held, self.attempts, self.commits, self.restorer, self.reports
        )

    def _holdings(self, identity: Identity, generation: str) -> mf.Holdings:
        copies, parity = self.redundancy.exact_copies(identity.job_key)
        return mf.Holdings(generation, identity.rank, self.held.exact_positions(identity), copies, parity)

    def set_peers(self, peers: Peers) -> None:
        """The job's other sidecars (known once the members are parsed)."""
        self.shared.peers.close()
        self.shared.peers = self.peers = peers

    @property
    def stopping(self) -> bool:
        return self.shared.stopping.is_set()

    @property
    def _stale_fences(self) -> bool:
        """Test hook (tests/integration/test_zombies.py): see Commits.stale_fences."""
        return self.commits.stale_fences

    @_stale_fences.setter
    def _stale_fences(self, value: bool) -> None:
        self.commits.stale_fences = value

    def close(self) -> None:
        """Finish uploads in progress; commits still waiting for other ranks give up. Peers
        learn that this sidecar's ranks save nothing more."""
        # Peers first, while every snapshot still counts as uploading: a step whose MANIFEST is
        # durable here may still commit without this sidecar, so nobody may abort it for us.
        ranks = {(s.identity.job_key, s.identity.rank, s.attempt) for s in self.snapshots()}
        for job_key, rank, attempt in ranks:
            self.commits.announce_gone(job_key, rank, attempt, "its sidecar is stopping")
        self.shared.stopping.set()
        for snap in self.snapshots():
            gang = self.gang(snap.identity.job_key)
            with gang.cond:
                gang.cond.notify_all()
        self.commits.shutdown()
        self.shared.uploads.shutdown(wait=True)
        if self.shared.encode_pool is not None:
            # Its workers stop now, not at the interpreter's exit (a sidecar run inside another
            # process, a multiprocessing child say, would wait for them forever); another sidecar
            # of this process that quantizes later starts a new pool.
            self.shared.encode_pool.close()
        self.segments.close()
        self.redundancy.close()
        self.peers.close()
        self.reports.close()  # the commits just finished are reported too

    # --- generations and attempts (attempts.py) ---------------------------------------------

    def gang(self, job_key: JobKey) -> JobGang:
        return self.shared.gang(job_key)

    def generation_of(self, identity: Identity) -> mf.Generation:
        return self.attempts.generation_of(identity)

    def greet(self, identity: Identity, protocol_version: int, handshake: bool = False) -> None:
        self.attempts.greet(identity, protocol_version, handshake)

    def epoch_for(self, identity: Identity) -> mf.Epoch:
        return self.attempts.epoch_for(identity)

    def check_not_stopped(self, identity: Identity) -> None:
        self.attempts.check_not_stopped(identity)

    # --- save (admission.py) ----------------------------------------------------------------

    def begin_save(
        self,
        protocol_version: int,
        identity: Identity,
        step: int,
        save_id: str,
        tensors: list[TensorSpec],
        tree: bytes,
        segment: tuple[str, int] | None = None,
        replicas: list[mf.ReplicaEntry] | None = None,
    ) -> Snapshot:
        return self.admission.begin_save(
            protocol_version, identity, step, save_id, tensors, tree, segment, replicas or []
        )

    def write_chunk(self, snap: Snapshot, data: bytes) -> None:
        self.admission.write_chunk(snap, data)

    def finish(self, snap: Snapshot, footer_total: int, stall_s: float, skipped: int) -> None:
        self.admission.finish(snap, footer_total, stall_s, skipped)

    def abort(self, snap: Snapshot, reason: str) -> None:
        self.admission.abort(snap, reason)

    def wait_committed(self, identity: Identity, step: int, save_id: str, timeout: float) -> Snapshot | None:
        """The snapshot once it is final (or still pending at the timeout); None if unknown."""
        return self.held.wait_committed(save_id, timeout)

    def snapshots(self) -> list[Snapshot]:
        return self.held.snapshots()

    # --- the commit and the gang (commit.py) ------------------------------------------------

    def on_hint(self, req: pb.HintRequest) -> None:
        self.commits.on_hint(req)

    def report_skip(self, identity: Identity, step: int, reason: str) -> None:
        """The trainer will not save ``step``: the job-level commit of it fails at once."""
        identity.validate()
        if step < 0:
            raise InvalidArgument(f"step must be >= 0, got {step}")
        if step > MAX_STEP:
            raise InvalidArgument(f"step must be <= {MAX_STEP} (keys hold 12 digits), got {step}")
        epoch = self.attempts.epoch_for(identity)
        self.commits.skip(identity, epoch.attempt, step, reason)

    def rank_gone(self, identity: Identity, attempt: int, reason: str) -> None:
        self.commits.rank_gone(identity, attempt, reason)

    def rank_back(self, identity: Identity, attempt: int) -> None:
        self.commits.rank_back(identity, attempt)

    def peers_gone(
        self,
        identity: Identity,
        attempt: int,
        known: tuple[int, ...],
        timeout: float,
        until: threading.Event | None = None,
    ) -> tuple[int, ...]:
        return self.commits.peers_gone(identity, attempt, known, timeout, until)

    def wake(self, identity: Identity) -> None:
        self.commits.wake(identity)

    # --- restore and queries (restore.py) ---------------------------------------------------

    def open_restore(self, identity: Identity, step: int | None, files_ok: bool = False) -> RestoreData:
        return self.restorer.open_restore(identity, step, files_ok)

    def open_rank(
        self,
        identity: Identity,
        owner: int,
        step: int | None = None,
        attempt: int | None = None,
        header_only: bool = False,
    ) -> RestoreData:
        return self.restorer.open_rank(identity, owner, step, attempt, header_only)

    def serve_fetch(
        self, req: pb.FetchRequest
    ) -> tuple[pb.RestoreHeader, Iterator[memoryview | bytes], bytes]:
        return self.restorer.serve_fetch(req)

    # --- redundancy between members (redundancy.py) -----------------------------------------

    def on_protect(self, requests: Iterator[pb.ProtectRequest]) -> pb.ProtectResponse:
        return self.redundancy.on_protect(requests)

    def serve_parity(self, req: pb.ParityRequest) -> tuple[pb.ParityHeader, Iterator[bytes], bytes]:
        return self.redundancy.serve_parity(req)

    def serve_chain(
        self, req: pb.ChainRequest, budget_s: float
    ) -> tuple[pb.ChainHeader, Iterator[memoryview], bytes]:
        return self.redundancy.serve_chain(req, budget_s)

    def prefetch(self, identity: Identity, files_ok: bool = False) -> None:
        self.restorer.prefetch(identity, files_ok)

    def list_checkpoints(self, namespace: str, job: str) -> list[tuple[mf.Commit, bool]]:
        return self.restorer.list_checkpoints(namespace, job)

    def in_memory(self, namespace: str, job: str, position: Position) -> bool:
        return self.held.in_memory(namespace, job, position)

    def describe(self, namespace: str, job: str, step: int, rank: int) -> tuple[mf.Commit, bytes]:
        return self.restorer.describe(namespace, job, step, rank)
