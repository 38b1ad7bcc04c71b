"""What every part of the engine shares: settings, storage, metrics, the one engine lock, the
memory budget, shared segments, the upload pool, the stopping flag, and each job's gang (with
the hints sent to the job's other sidecars). Components get this object; nothing else of theirs
is shared except through their public methods."""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sidecar import manifest as mf
from sidecar.api import pb
from sidecar.budget import MemoryBudget, default_limit
from sidecar.config import SidecarSettings
from sidecar.errors import NotFound, StrataError, Unauthenticated
from sidecar.gang import (
    MAX_HINT_TEXT,
    JobGang,
    Peers,
    Position,
    ReplayCache,
    check_fresh,
    check_protocol,
    hint_mac,
    sign_hint,
)
from sidecar.metrics import Metrics
from sidecar.pipeline.settings import quantization
from sidecar.pipeline.workers import shared_pool
from sidecar.shm import Segments, check_dir, socket_tag
from sidecar.store.base import Store

from .types import JobKey

log = logging.getLogger(__name__)

#: the most jobs whose gang state (and peer key) one sidecar keeps; past it the least recently
#: used job's are dropped. That state is a cache of storage (the epoch, the fences) and of hints:
#: a dropped job's next save or restore reads storage again, and a commit of it in flight falls
#: back to storage (``--hint-fallback-s``). A sidecar serves a few jobs; only a trainer on this
#: sidecar's socket creates one (hints for a job with no gang here are dropped).
MAX_GANGS = 1024


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
        #: the nonces of the signed peer requests taken (each is taken once)
        self.replays = ReplayCache()

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
                while len(self._peer_keys) > 2 * MAX_GANGS:  # jobs asked of without a gang here
                    oldest = next(iter(self._peer_keys))
                    self._peer_keys.pop(oldest)
                    self._fresh_read.pop(oldest, None)
        return known

    def authenticate(
        self,
        job_key: JobKey,
        protocol: int,
        issued_at: float,
        nonce: bytes,
        sign: Callable[[bytes], str],
        mac: str,
    ) -> bytes:
        """The job's peer key, when a peer request of this protocol is fresh, ``mac`` is
        ``sign(key)``, and its nonce was not taken before (then it is taken). FailedPrecondition
        for another protocol (a sidecar of another version), Unauthenticated otherwise."""
        if not mac:
            raise Unauthenticated(
                "unsigned request (a sidecar before peer protocol 2 sends unsigned hints: every "
                "sidecar of a gang must run the same version)"
            )
        check_protocol(protocol)
        check_fresh(issued_at)
        try:
            key = self.peer_key(job_key, create=False)
            if not hmac.compare_digest(sign(key), mac):  # the prefix may have been recreated
                key = self.peer_key(job_key, create=False, fresh=True)
        except NotFound:
            raise Unauthenticated(f"{job_key[1]} has no peer key yet: nothing can be signed") from None
        if not hmac.compare_digest(sign(key), mac):
            raise Unauthenticated("request not signed with this job's peer key")
        self.replays.take(nonce, issued_at)
        return key

    def gang(self, job_key: JobKey) -> JobGang:
        with self.lock:
            gang = self._gangs.get(job_key)
            if gang is None:
                if len(self._gangs) >= MAX_GANGS:
                    self._evict(len(self._gangs) - MAX_GANGS + 1)
                gang = self._gangs[job_key] = JobGang(self.store, *job_key, self.settings.keep)
            gang.used = time.monotonic()
            return gang

    def _evict(self, n: int) -> None:
        """Drop the ``n`` least recently used gangs. Caller holds ``lock``."""
        for job_key, gang in sorted(self._gangs.items(), key=lambda kv: kv[1].used)[:n]:
            del self._gangs[job_key]
            self._peer_keys.pop(job_key, None)
            self._fresh_read.pop(job_key, None)
            with gang.cond:
                gang.cond.notify_all()  # anything waiting on it asks storage now
            log.info("%s/%s: idle the longest of %d jobs; its gang state is dropped", *job_key, MAX_GANGS)

    def take_hint(self, req: pb.HintRequest) -> None:
        """A hint from another sidecar (bounded by sidecar.gang.check_hint already), taken when
        this sidecar serves a rank of its job (NotFound otherwise: nothing is kept for it) and it
        is signed with the job's peer key."""
        job_key = (req.namespace, req.job)
        with self.lock:
            gang = self._gangs.get(job_key)
        if gang is None:
            raise NotFound(f"{req.namespace}/{req.job} has no rank on this sidecar; hint dropped")
        self.authenticate(
            job_key, req.protocol, req.issued_at, req.nonce, lambda k: hint_mac(k, req), req.mac
        )
        gang.apply_hint(req)

    def hint(self, gang: JobGang, position: Position, **hint: Any) -> None:
        """Tell the job's other sidecars (signed; best effort)."""
        if not self.peers:
            return
        req = pb.HintRequest(
            namespace=gang.namespace, job=gang.job, attempt=position[0], step=position[1], **hint
        )
        kind = req.WhichOneof("hint")
        if kind in ("skip", "gone"):  # a receiver refuses longer ones
            text = getattr(req, kind)
            text.reason = text.reason[:MAX_HINT_TEXT]
        try:
            key = self.peer_key((gang.namespace, gang.job))
        except (StrataError, OSError) as exc:
            log.warning("no hint to peers (commits fall back to storage): no peer key (%s)", exc)
            return
        sign_hint(key, req)
        self.peers.send(req)

    def _memory_changed(self, budget: MemoryBudget) -> None:
        for kind, held in budget.held().items():
            self.metrics.memory_held.labels(kind).set(held)
