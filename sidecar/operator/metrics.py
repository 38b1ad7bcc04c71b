"""Prometheus metrics of the operator. Each instance owns its registry (never the global one), so
tests, and several operators in one process, never share counters.

One object, :class:`OperatorMetrics`, shared by the report endpoint (``reports.py``) and the
controller. API calls are not counted by hand: :meth:`OperatorMetrics.track_api` hands the metric an
``Api`` whose own ``calls`` counter it reads at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sidecar.metrics import Served

__all__ = ["REJECTION_REASONS", "REPORT_KINDS", "OperatorMetrics"]

#: From a report received to its Checkpoint written: API round trips, so milliseconds to seconds.
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

#: Label values of ``strata_operator_reports_total{kind}`` (anything else counts as "unknown").
REPORT_KINDS = ("commit", "delete", "heartbeat")
#: Label values of ``strata_operator_report_rejections_total{reason}``.
REJECTION_REASONS = ("token", "forbidden", "superseded", "invalid")


class _Counted(Protocol):
    calls: int


class _Expiring(Protocol):
    @property
    def not_after(self) -> float | None: ...


class _Change(Protocol):
    @property
    def kind(self) -> str: ...


class _ApiCalls(Collector):
    """``strata_operator_api_calls_total``: the sum of the tracked clients' ``calls`` counters."""

    def __init__(self) -> None:
        self.apis: list[_Counted] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "strata_operator_api_calls",
            "Kubernetes API requests the operator sent (reads, writes, TokenReviews).",
        )
        family.add_metric([], float(sum(api.calls for api in self.apis)))
        yield family


class _StuckSource(Protocol):
    def stuck_counts(self) -> Iterable[tuple[str, int, int]]: ...


class _Stuck(Collector):
    """``strata_operator_stuck_gangs{cause}`` and ``strata_operator_stuck_pods{cause}``, read from
    the controller at scrape time (so a deleted workload never leaves a stale count)."""

    def __init__(self, source: _StuckSource) -> None:
        self.source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gangs = GaugeMetricFamily(
            "strata_operator_stuck_gangs",
            "Watched workloads with a pod stuck past the grace (StrataJob condition Stuck), by cause.",
            labels=["cause"],
        )
        pods = GaugeMetricFamily(
            "strata_operator_stuck_pods", "Pods stuck past the grace, by cause.", labels=["cause"]
        )
        for cause, gang_count, pod_count in self.source.stuck_counts():
            gangs.add_metric([cause], float(gang_count))
            pods.add_metric([cause], float(pod_count))
        yield gangs
        yield pods


class OperatorMetrics(Served):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reports = Counter(
            "strata_operator_reports_total",
            "Report items from sidecars past authentication, by kind (commit, delete, heartbeat, "
            "unknown) and result (accepted, rejected).",
            ["kind", "result"],
            registry=r,
        )
        self.report_rejections = Counter(
            "strata_operator_report_rejections_total",
            "Refused reports by reason: token (401, per request), forbidden (403, per request), "
            "superseded and invalid (per item).",
            ["reason"],
            registry=r,
        )
        self.report_to_cr = Histogram(
            "strata_operator_report_to_cr_seconds",
            "From a commit report received to its Checkpoint (spec, status and latest label) written.",
            buckets=_SECONDS,
            registry=r,
        )
        self.restarts = Counter(
            "strata_operator_restarts_total",
            "Gang restarts the operator started, by failure reason.",
            ["reason"],
            registry=r,
        )
        self.disruptions = Counter(
            "strata_operator_disruptions_total",
            "Gang restarts after a disruption (evicted, lost with its node, a suspended Job resumed), "
            "which spend no restart budget, by reason.",
            ["reason"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "strata_operator_reconcile_errors_total",
            "Reconciliations (or report writes) that failed (an API error, a connection reset, a timeout, "
            "anything unexpected) and will be retried.",
            registry=r,
        )
        self.watched_jobs = Gauge(
            "strata_operator_watched_jobs",
            "Opted-in Jobs and JobSets the operator is watching.",
            registry=r,
        )
        self.jobs_failed = Counter(
            "strata_operator_jobs_failed_total",
            "Jobs the operator gave up on, by reason: RestartLimitReached (restarts exhausted) or "
            "NotRestartable (a failure no gang restart can fix), IndexFailed (the Job controller gave up on "
            "an index).",
            ["reason"],
            registry=r,
        )
        self.tls_changes = Counter(
            "strata_operator_tls_changes_total",
            "Changes to the operator-managed CA Secret, by kind: created, published (a successor CA "
            "joined the bundle), promoted (it took over signing), renewed (serving certificate), dropped "
            "(expired CAs left the bundle).",
            ["kind"],
            registry=r,
        )
        self.tls_expiry = Gauge(
            "strata_operator_tls_certificate_expiry_timestamp_seconds",
            "When the certificate the webhooks and the report endpoint serve expires (Unix time).",
            registry=r,
        )
        self.retention_deletions = Counter(
            "strata_operator_retention_deletions_total",
            "Objects deleted because their workload's retention (strata.dev/retention) passed, or "
            "(Checkpoints) neither their StrataJob nor their workload exists, by kind "
            "(StrataJob, Checkpoint).",
            ["kind"],
            registry=r,
        )
        self._stuck: _Stuck | None = None
        self._api_calls = _ApiCalls()
        r.register(self._api_calls)
        for reason in REJECTION_REASONS:
            self.report_rejections.labels(reason=reason)  # export zeros from the start
        for reason in ("RestartLimitReached", "NotRestartable", "IndexFailed"):
            self.jobs_failed.labels(reason=reason)
        for kind in ("StrataJob", "Checkpoint"):
            self.retention_deletions.labels(kind=kind)

    def track_tls(self, source: _Expiring) -> None:
        """Export when ``source``'s served certificate expires (read at every scrape)."""
        self.tls_expiry.set_function(lambda: source.not_after or 0.0)

    def tls_changed(self, changes: Iterable[_Change]) -> None:
        for change in changes:
            self.tls_changes.labels(kind=change.kind).inc()

    def track_stuck(self, source: _StuckSource) -> None:
        """Export the stuck gauges from ``source`` (the controller); the newest source wins."""
        if self._stuck is None:
            self._stuck = _Stuck(source)
            self.registry.register(self._stuck)
        self._stuck.source = source

    def track_api(self, api: _Counted) -> None:
        """Count ``api.calls`` (an :class:`~sidecar.operator.kube.Api`) in
        ``strata_operator_api_calls_total``; idempotent."""
        if not any(tracked is api for tracked in self._api_calls.apis):
            self._api_calls.apis.append(api)

    def report(self, kind: object, result: str) -> None:
        """Count one report item: ``result`` is "accepted" or "rejected"."""
        label = kind if isinstance(kind, str) and kind in REPORT_KINDS else "unknown"
        self.reports.labels(kind=label, result=result).inc()

    def reject(self, reason: str, count: int = 1) -> None:
        """Count refusals: ``reason`` is one of :data:`REJECTION_REASONS`."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; one of {REJECTION_REASONS}")
        self.report_rejections.labels(reason=reason).inc(count)
