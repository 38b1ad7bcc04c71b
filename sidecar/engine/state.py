"""What every part of the engine shares: settings, storage, metrics, the one engine lock, the
memory budget, shared segments, the upload pool, the stopping flag, and each job's gang (with
the hints sent to the job's other sidecars). Components get this object; nothing else of theirs
is shared except through their public methods."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sidecar import manifest as mf
from sidecar.api import pb
from sidecar.budget import MemoryBudget, default_limit
from sidecar.config import SidecarSettings
from sidecar.gang import JobGang, Peers, Position
from sidecar.metrics import Metrics
from sidecar.pipeline.settings import quantization
from sidecar.pipeline.workers import shared_pool
from sidecar.shm import Segments, check_dir, socket_tag
from sidecar.store.base import Store

from .types import JobKey


class Shared:
    def __init__(
        self, settings: SidecarSettings, store: Store, metrics: Metrics, peers: Peers | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        #: Guards the components' per-rank and per-job tables (a gang has its own ``cond``).
        self.lock = threading.Lock()
        self.uploads = ThreadPoolExecutor(settings.upload_concurrency, thread_name_prefix="strata-upload")
        self._gangs: dict[JobKey, JobGang] = {}
        self.peers = peers if peers is not None else Peers([])
        self.segments = Segments(
            check_dir(settings.shm_dir), socket_mode=settings.socket_mode, tag=socket_tag(settings.socket)
        )
        self.quant = quantization(settings)
        #: worker processes that quantize (None: in this process); started in the background
        #: when quantization is on, so the first save does not wait for them
        self.encode_pool = shared_pool(settings.encode_workers)
        if self.encode_pool is not None and self.quant.enabled and not self.quant.cast:
            threading.Thread(target=self.encode_pool.warm, name="strata-encode-warm", daemon=True).start()
        limit, source = (
            (settings.memory_budget, "--memory-budget") if settings.memory_budget else default_limit()
        )
        self.memory = MemoryBudget(
            limit,
            source,
            on_change=self._memory_changed,
            on_refused=lambda kind: metrics.memory_refusals.labels(kind).inc(),
        )
        metrics.memory_budget.set(limit)
        self.stopping = threading.Event()
        self._peer_keys: dict[JobKey, bytes] = {}
        self._fresh_read: dict[JobKey, float] = {}

    def peer_key(self, job_key: JobKey, create: bool = True, fresh: bool = False) -> bytes:
        """The job's peer key, read (or created, with ``create``) in storage once per job, or again
        with ``fresh`` (the job's prefix may have been recreated) at most every 10 s: a request
        with a bad MAC must not make this sidecar read storage at its sender's pace."""
        with self.lock:
            known = self._peer_keys.get(job_key)
            if fresh and time.monotonic() - self._fresh_read.get(job_key, -math.inf) >= 10.0:
                self._fresh_read[job_key] = time.monotonic()
                known = None
        if known is None:
            known = mf.peer_key(self.store, *job_key, create=create)
            with self.lock:
                self._peer_keys[job_key] = known
        return known

    def gang(self, job_key: JobKey) -> JobGang:
        with self.lock:
            gang = self._gangs.get(job_key)
            if gang is None:
                gang = self._gangs[job_key] = JobGang(self.store, *job_key, self.settings.keep)
            return gang

    def hint(self, gang: JobGang, position: Position, **hint: Any) -> None:
        self.peers.send(
            pb.HintRequest(
                namespace=gang.namespace, job=gang.job, attempt=position[0], step=position[1], **hint
            )
        )

    def _memory_changed(self, budget: MemoryBudget) -> None:
        for kind, held in budget.held().items():
            self.metrics.memory_held.labels(kind).set(held)
