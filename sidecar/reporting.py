"""Reports from the sidecar to the operator: commits, retention deletes and heartbeats.

Best effort and never on the commit path: :meth:`Reporter.report` only appends to a bounded queue
(the oldest item is dropped, and counted, when it is full) and never raises; one background thread
POSTs batches as JSON to ``{report_url}/v1/reports``::

    request   {"reports": [item, ...]}            Authorization: Bearer <token>
    response  200 {"accepted": n, "rejected": [{"index": i, "error": "..."}],
                   "instructions": [{"namespace", "job", "restart": {"generation", "reason"}}, ...]}
              401 bad token, 403 pod not allowed to report on that job, 400 malformed body

``instructions`` (optional) is how the operator tells this sidecar something without a listener or
a credential of its own: the answer to the sidecar's own authenticated report. Each goes to
``on_instruction`` in the reporting thread; today the only one is an in-place gang restart (the
operator answers a heartbeat with the generation the gang runs next).

The token is read from ``report_token_file`` at every send (projected service-account tokens
rotate). While the operator is unreachable (connection errors, 5xx, 401, 408, 429) the batch is
kept and retried with capped exponential backoff and jitter; any other 4xx is logged once per
reason and the batch dropped, so a malformed report is never retried forever. Heartbeats are
state, not events: only the newest per (namespace, job, rank) waits to be sent.

Only the standard library (urllib.request, ssl): the sidecar gains no dependency.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import random
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from sidecar import manifest as mf
from sidecar.store.base import Store

log = logging.getLogger(__name__)

#: An item, or a function that builds it (or several) in the reporting thread.
Item = dict[str, Any]
Pending = Item | Callable[[], Item | list[Item]]

MAX_QUEUE = 10_000
MAX_BATCH = 200
REQUEST_TIMEOUT_S = 10.0
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 30.0
#: How long the sidecar's shutdown waits for queued reports to go out.
FLUSH_TIMEOUT_S = 5.0
#: HTTP statuses worth retrying: the operator (or its token review) may be back soon.
_RETRY_STATUSES = frozenset({401, 408, 429})


class ReportMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter(
            "strata_reports_sent_total",
            "Reports the operator accepted, by kind (commit, delete, heartbeat).",
            ["kind"],
            registry=registry,
        )
        self.dropped = Counter(
            "strata_reports_dropped_total",
            "Reports given up on, by reason: overflow (queue full), rejected (by the operator), "
            "refused (HTTP 4xx), error (could not be built), shutdown (unsent at exit).",
            ["reason"],
            registry=registry,
        )
        self.retries = Counter(
            "strata_report_retries_total",
            "Report batches sent again because the operator was unreachable or refused them for now.",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "strata_report_queue_depth", "Reports waiting to be sent to the operator.", registry=registry
        )


class Reporter:
    """Sends reports to the operator from one background thread (none when ``url`` is empty).

    ``heartbeats``: called every ``heartbeat_s`` seconds in the reporting thread; returns the
    heartbeat items to send (0 or no function: no periodic heartbeats). ``on_instruction``: called
    with each instruction an answer carries (an exception it raises is logged, never fatal).
    """

    def __init__(
        self,
        url: str,
        registry: CollectorRegistry,
        *,
        token_file: str = "",
        ca_file: str = "",
        heartbeat_s: float = 0.0,
        heartbeats: Callable[[], list[Item]] | None = None,
        on_instruction: Callable[[Item], None] | None = None,
        max_queue: int = MAX_QUEUE,
        max_batch: int = MAX_BATCH,
        backoff_initial_s: float | None = None,
        backoff_max_s: float | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/reports" if url else ""
        self.token_file, self.ca_file = token_file, ca_file
        self.heartbeat_s = heartbeat_s if heartbeats is not None else 0.0
        self._heartbeats = heartbeats
        self._on_instruction = on_instruction
        self.max_queue, self.max_batch = max(1, max_queue), max(1, max_batch)
        # Read at construction, not import: tests shorten them.
        self.backoff_initial_s = BACKOFF_INITIAL_S if backoff_initial_s is None else backoff_initial_s
        self.backoff_max_s = BACKOFF_MAX_S if backoff_max_s is None else backoff_max_s
        self.registry = registry
        self.metrics = ReportMetrics(registry)
        self._cond = threading.Condition()
        self._queue: collections.deque[Pending] = collections.deque()
        self._beats: dict[tuple[str, str, int], Item] = {}
        self._closing = False
        self._deadline = math.inf
        self._said: set[str] = set()
        self._ssl: ssl.SSLContext | None = None
        self._ssl_stamp: float | None = None
        self._thread: threading.Thread | None = None
        if self.url:
            self._thread = threading.Thread(target=self._run, name="strata-report", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    # --- producers ------------------------------------------------------------------------

    def report(self, item: Pending) -> None:
        """Queue ``item`` (or a function building it); never blocks, never raises."""
        if not self.enabled:
            return
        try:
            with self._cond:
                if self._closing and not self._thread_alive():
                    self.metrics.dropped.labels("shutdown").inc()
                    return
                if isinstance(item, dict) and item.get("kind") == "heartbeat":
                    self._beats[_beat_key(item)] = item
                else:
                    while len(self._queue) >= self.max_queue:
                        self._queue.popleft()
                        self.metrics.dropped.labels("overflow").inc()
                    self._queue.append(item)
                self._depth()
                self._cond.notify_all()
        except Exception:  # reporting must never hurt the caller
            log.exception("could not queue a report")

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Send what is queued, waiting at most ``timeout`` seconds; what is left is dropped."""
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + max(0.0, timeout)
            self._cond.notify_all()
        self._thread.join(timeout + 1.0)
        with self._cond:
            left = len(self._queue) + len(self._beats)
            self._queue.clear()
            self._beats.clear()
            self._depth()
        if left:
            self.metrics.dropped.labels("shutdown").inc(left)
            log.warning("%d report(s) to the operator were not sent before shutdown", left)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _depth(self) -> None:
        self.metrics.queue_depth.set(len(self._queue) + len(self._beats))

    # --- the reporting thread -------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        retry_at = 0.0
        next_beat = time.monotonic() + self.heartbeat_s if self.heartbeat_s > 0 else math.inf
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._closing and (now >= self._deadline or not (self._queue or self._beats)):
                        return
                    if now >= next_beat:
                        break
                    if (self._queue or self._beats) and now >= retry_at:
                        break
                    wake = min(next_beat, self._deadline if self._closing else math.inf)
                    if self._queue or self._beats:
                        wake = min(wake, retry_at)
                    self._cond.wait(None if wake == math.inf else max(0.0, wake - now))
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_s
                self._collect_heartbeats()
                if time.monotonic() < retry_at:
                    continue
            events, beats = self._take()
            if not events and not beats:
                continue
            outcome = self._send(events + beats)
            if outcome == "retry":
                self._put_back(events, beats)
                failures += 1
                self.metrics.retries.inc()
                delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** min(failures - 1, 30))
                retry_at = time.monotonic() + delay * random.uniform(0.5, 1.0)
            else:
                failures, retry_at = 0, 0.0

    def _collect_heartbeats(self) -> None:
        assert self._heartbeats is not None
        try:
            beats = self._heartbeats()
        except Exception:
            log.exception("could not build heartbeats")
            return
        for beat in beats:
            self.report(beat)

    def _take(self) -> tuple[list[Item], list[Item]]:
        """Up to ``max_batch`` events (oldest first) and every waiting heartbeat."""
        with self._cond:
            pending: list[Pending] = []
            while self._queue and len(pending) < self.max_batch:
                pending.append(self._queue.popleft())
            beats = list(self._beats.values())
            self._beats.clear()
            self._depth()
        events: list[Item] = []
        for item in pending:
            try:
                built = item() if callable(item) else item
            except Exception as exc:
                self.metrics.dropped.labels("error").inc()
                self._say_once(f"build:{type(exc).__name__}", "could not build a report: %r", exc)
                continue
            events.extend(built if isinstance(built, list) else [built])
        return events, beats

    def _put_back(self, events: list[Item], beats: list[Item]) -> None:
        with self._cond:
            self._queue.extendleft(reversed(events))
            while len(self._queue) > self.max_queue:
                self._queue.pop()  # the newest queued beyond the bound: what was sent first stays first
                self.metrics.dropped.labels("overflow").inc()
            for beat in beats:
                self._beats.setdefault(_beat_key(beat), beat)  # unless a newer one came meanwhile
            self._depth()

    def _send(self, items: list[Item]) -> str:
        """POST one batch: "sent", "dropped" (permanently refused) or "retry"."""
        try:
            body = json.dumps({"reports": items}, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            self.metrics.dropped.labels("error").inc(len(items))
            self._say_once("encode", "could not encode %d report(s): %s", len(items), exc)
            return "dropped"
        headers = {"Content-Type": "application/json"}
        if self.token_file:
            try:
                with open(self.token_file) as f:  # every send: projected tokens rotate
                    token = f.read().strip()
            except OSError as exc:
                self._say_once(
                    "retry:token", "cannot read the report token %s (will retry): %s", self.token_file, exc
                )
                return "retry"
            if not token:  # being written, or not projected yet: never send an empty credential
                self._say_once(
                    "retry:empty-token", "the report token %s is empty (will retry)", self.token_file
                )
                return "retry"
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        timeout = REQUEST_TIMEOUT_S
        if self._closing:
            timeout = max(0.1, min(timeout, self._deadline - time.monotonic()))
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context()) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            detail = _detail(exc)
            if exc.code in _RETRY_STATUSES or exc.code >= 500:
                self._say_once(f"retry:{exc.code}", "operator answered %d (will retry): %s", exc.code, detail)
                return "retry"
            self.metrics.dropped.labels("refused").inc(len(items))
            self._say_once(
                f"http:{exc.code}:{detail}",
                "operator refused %d report(s) with %d (dropped, not retried): %s",
                len(items),
                exc.code,
                detail,
            )
            return "dropped"
        except (OSError, ValueError) as exc:  # URLError, timeouts, resets, TLS failures
            self._say_once(
                f"retry:{type(exc).__name__}", "operator unreachable at %s (will retry): %s", self.url, exc
            )
            return "retry"
        self._said = {s for s in self._said if not s.startswith("retry:")}  # a new outage is said again
        self._accepted(items, answer)
        return "sent"

    def _accepted(self, items: list[Item], answer: bytes) -> None:
        rejected: dict[int, str] = {}
        instructions: list[Item] = []
        try:
            raw = json.loads(answer)
            for entry in raw.get("rejected") or []:
                rejected[int(entry["index"])] = str(entry.get("error", ""))
            instructions = [i for i in raw.get("instructions") or [] if isinstance(i, dict)]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            self._say_once("answer", "operator's answer is not the expected JSON (%s); counted as sent", exc)
        for instruction in instructions:
            if self._on_instruction is None:
                break
            try:
                self._on_instruction(instruction)
            except Exception:  # an instruction never stops the reports
                log.exception("could not follow the operator's instruction %s", sorted(instruction))
        for index, item in enumerate(items):
            if index in rejected:
                self.metrics.dropped.labels("rejected").inc()
                self._say_once(
                    f"rejected:{rejected[index]}",
                    "operator rejected a %s report: %s",
                    item.get("kind"),
                    rejected[index],
                )
            else:
                self.metrics.sent.labels(str(item.get("kind", ""))).inc()

    def _context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https://"):
            return None
        stamp = None
        if self.ca_file:
            try:
                stamp = os.stat(self.ca_file).st_mtime
            except OSError:
                stamp = None
        if self._ssl is None or stamp != self._ssl_stamp:  # a rotated CA bundle is read again
            self._ssl = ssl.create_default_context(cafile=self.ca_file or None)
            self._ssl_stamp = stamp
        return self._ssl

    def _say_once(self, reason: str, message: str, *args: Any) -> None:
        if reason in self._said:
            log.debug(message, *args)
            return
        if len(self._said) < 256:
            self._said.add(reason)
        log.warning(message, *args)


def _beat_key(item: Item) -> tuple[str, str, int]:
    return (str(item.get("namespace")), str(item.get("job")), int(item.get("rank") or 0))


def _detail(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read(512).decode("utf-8", "replace").strip()
    except Exception:
        text = ""
    return text or str(exc.reason)


# --- items -------------------------------------------------------------------------------------


def location(storage: str, namespace: str, job: str) -> str:
    """The storage URL of the job's prefix, without credentials."""
    parts = urllib.parse.urlsplit(storage)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/") + f"/{namespace}/{job}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))


def commit_item(
    commit: mf.Commit, commit_sha256: str, manifests: dict[int, tuple[str, bytes]], where: str
) -> Item:
    """The commit report of ``commit`` (its body's sha256), from its ranks' manifests as stored
    (rank -> (key, body)). A step is a diff when any rank's manifest is; its base step is the
    newest base a rank names. ``bits``: the widest lossy encoding (a float16/bfloat16 cast counts
    16), None when every tensor is stored losslessly."""
    ranks = []
    kinds: set[str] = set()
    reshardable = False
    bases: list[int] = []
    bits: list[int] = []
    parsed: list[mf.Manifest] = []
    for ref in sorted(commit.manifests, key=lambda r: r.rank):
        key, body = manifests[ref.rank]
        manifest = mf.Manifest.from_json(body, key)
        parsed.append(manifest)
        kinds.add(manifest.checkpoint)
        if ref.rank == 0:
            reshardable = manifest.dcp  # saved through DCP: loads on any number of ranks
        if manifest.base_step is not None:
            bases.append(manifest.base_step)
        encodings: collections.Counter[str] = collections.Counter()
        for t in manifest.tensors:
            encodings[t.encoding] += 1
            if t.bits:
                bits.append(t.bits)
            elif t.cast:
                bits.append(16)
        ranks.append(
            {
                "rank": ref.rank,
                "manifest_key": key,
                "sha256": mf.sha256(body),
                "bytes": manifest.total_bytes,
                "encodings": dict(sorted(encodings.items())),
            }
        )
    diff = "diff" in kinds
    # ... or every rank saved the same replicated state: client.resume() loads it on any number
    reshardable = reshardable or mf.replicated(parsed)
    return {
        "kind": "commit",
        "namespace": commit.namespace,
        "job": commit.job,
        "step": commit.step,
        "attempt": commit.attempt,
        "generation": commit.generation,
        "world_size": commit.world_size,
        "reshardable": reshardable,
        "commit_key": commit.key,
        "commit_sha256": commit_sha256,
        "location": where,
        "type": "diff" if diff else "full",
        "base_step": max(bases) if diff and bases else None,
        "requires": sorted(set(commit.requires) | {r.step for r in commit.required_commits}),
        "bits": max(bits) if bits else None,
        "bytes": commit.total_bytes,
        "committed_at": commit.committed_at,
        "ranks": ranks,
    }


def stored_commit_items(
    store: Store, namespace: str, job: str, where: str, positions: Iterable[tuple[int, int]]
) -> list[Item]:
    """Commit reports of committed steps read back from storage (at start: the operator may have
    missed them). A step that cannot be read is skipped and logged."""
    out = []
    for attempt, step in positions:
        key = mf.commit_key(namespace, job, step, attempt)
        try:
            commit, digest = mf.read_commit_at(store, key)
            bodies = {}
            for ref in commit.manifests:
                body = store.get(ref.key)
                if mf.sha256(body) != ref.sha256:
                    raise ValueError(f"{ref.key}: sha256 differs from the one COMMIT recorded")
                bodies[ref.rank] = (ref.key, body)
            out.append(commit_item(commit, digest, bodies, where))
        except Exception as exc:
            log.warning("%s/%s: step %d not re-reported: %s", namespace, job, step, exc)
    return out


def delete_item(namespace: str, job: str, step: int, attempt: int) -> Item:
    return {"kind": "delete", "namespace": namespace, "job": job, "step": step, "attempt": attempt}
