"""Prometheus metrics of one sidecar. Each instance owns its registry, so tests
(and several sidecars in one process) never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Served:
    """A ``/metrics`` HTTP endpoint for ``self.registry`` (the sidecar's and the operator's)."""

    registry: CollectorRegistry

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http_server = server
        return int(server.server_address[1])

    def shutdown(self) -> None:
        server = getattr(self, "_http_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()


class Metrics(Served):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.save_stall = Histogram(
            "strata_save_stall_seconds",
            "Time save() held the training thread (staging copy), as reported by the client.",
            ["training_job"],
            buckets=_SECONDS,
            registry=r,
        )
        self.received_bytes = Counter(
            "strata_received_bytes_total",
            "Snapshot bytes received from trainers.",
            ["training_job"],
            registry=r,
        )
        self.uploaded_bytes = Counter(
            "strata_uploaded_bytes_total",
            "Bytes written to storage (objects and metadata).",
            ["training_job"],
            registry=r,
        )
        self.upload_duration = Histogram(
            "strata_upload_duration_seconds",
            "From a snapshot fully received to its rank MANIFEST durable.",
            ["training_job"],
            buckets=_SECONDS,
            registry=r,
        )
        self.checkpoints = Counter(
            "strata_checkpoints_total",
            "Saves by outcome: committed, failed (storage), aborted (stream cut), refused (invalid or busy).",
            ["training_job", "result"],
            registry=r,
        )
        self.saves_skipped = Counter(
            "strata_saves_skipped_total",
            "Saves the client skipped because the previous one was still streaming.",
            ["training_job"],
            registry=r,
        )
        self.storage_errors = Counter(
            "strata_storage_errors_total",
            "Failed storage operations after retries.",
            ["training_job", "op"],
            registry=r,
        )
        self.restores = Counter(
            "strata_restores_total",
            "Restores served, by source (memory, peer, storage).",
            ["training_job", "source"],
            registry=r,
        )
        self.restore_classes = Counter(
            "strata_restore_classes_total",
            "Restores served, by class: exact (every tensor as saved) or stored (lossy tensors as "
            "storage holds them).",
            ["training_job", "restore_class"],
            registry=r,
        )
        self.replica_reads = Counter(
            "strata_replica_reads_total",
            "Another rank's share of the replicated tensors read for a restoring rank, by source "
            "(memory: this sidecar serves the owner; peer: the owner's sidecar; storage).",
            ["training_job", "source"],
            registry=r,
        )
        self.replica_read_bytes = Counter(
            "strata_replica_read_bytes_total",
            "Bytes of those reads, by source.",
            ["training_job", "source"],
            registry=r,
        )
        self.reshard_reads = Counter(
            "strata_reshard_reads_total",
            "A rank's snapshot of a commit saved by another number of ranks, read for a rank of this "
            "job (a resharded load: DCP's StrataReader), by source (memory, peer, storage).",
            ["training_job", "source"],
            registry=r,
        )
        self.reshard_read_bytes = Counter(
            "strata_reshard_read_bytes_total",
            "Bytes of those reads, by source.",
            ["training_job", "source"],
            registry=r,
        )
        self.restore_fallbacks = Counter(
            "strata_restore_fallbacks_total",
            "Restores that skipped an unusable newer step (corrupt or missing objects).",
            ["training_job"],
            registry=r,
        )
        self.last_commit = Gauge(
            "strata_last_commit_timestamp_seconds",
            "Unix time of the newest job-level COMMIT this sidecar wrote or saw.",
            ["training_job"],
            registry=r,
        )
        self.last_committed_step = Gauge(
            "strata_last_committed_step", "Newest committed training step.", ["training_job"], registry=r
        )
        self.encoded = Counter(
            "strata_encoded_checkpoints_total",
            "Rank checkpoints written, by kind: full or diff (changed rows only).",
            ["training_job", "kind"],
            registry=r,
        )
        self.changed_rows = Gauge(
            "strata_changed_rows_ratio",
            "Rows a rank's newest diff wrote, over all rows of its diffed tensors.",
            ["training_job"],
            registry=r,
        )
        self.quantization_error = Gauge(
            "strata_quantization_relative_error",
            "Largest relative L2 error of a quantized tensor in a rank's newest checkpoint (0: lossless).",
            ["training_job"],
            registry=r,
        )
        self.value_diff_fallbacks = Counter(
            "strata_tracking_mismatches_total",
            "Tensors whose lookup tracking missed a changed row; they were diffed by value instead.",
            ["training_job"],
            registry=r,
        )
        self.conditional_writes = Gauge(
            "strata_storage_conditional_writes",
            "1 when storage honours If-None-Match/If-Match (probed at start), else 0: without them "
            "two writers of one COMMIT or EPOCH are not told apart.",
            registry=r,
        )
        self.superseded = Counter(
            "strata_superseded_total",
            "Saves that stopped because a newer attempt of the job fenced them off.",
            ["training_job"],
            registry=r,
        )
        self.attempt = Gauge(
            "strata_attempt",
            "The storage-allocated attempt this sidecar's ranks run as.",
            ["training_job"],
            registry=r,
        )
        self.held_bytes = Gauge("strata_held_snapshot_bytes", "Snapshot bytes held in memory.", registry=r)
        self.redundancy_pushes = Counter(
            "strata_redundancy_pushes_total",
            "Pushes of this member's committed share to other members, by kind (replica, parity) and "
            "outcome (ok, failed, skipped: a lossy step, superseded: a newer step committed first).",
            ["training_job", "kind", "outcome"],
            registry=r,
        )
        self.redundancy_push_duration = Histogram(
            "strata_redundancy_push_duration_seconds",
            "From a commit to its redundancy pushed to every member that holds it.",
            ["training_job"],
            buckets=_SECONDS,
            registry=r,
        )
        self.redundancy_held_bytes = Gauge(
            "strata_redundancy_held_bytes",
            "Bytes of copies and parity this member holds for others (in --redundancy-dir).",
            registry=r,
        )
        self.peer_rebuilds = Counter(
            "strata_peer_rebuilds_total",
            "Restores of this member's share from other members, by how (replica, parity) and outcome "
            "(ok, failed: storage was read instead).",
            ["training_job", "how", "outcome"],
            registry=r,
        )
        self.peer_rebuild_received_bytes = Counter(
            "strata_peer_rebuild_received_bytes_total",
            "Bytes this member received to rebuild its share from parity: about one share down a "
            "chain of its group's survivors; the parity and every survivor's share when pulled.",
            ["training_job", "how"],
            registry=r,
        )
        self.memory_budget = Gauge(
            "strata_memory_budget_bytes",
            "The sidecar's own memory budget (shared-memory segments are the trainer's, not in it).",
            registry=r,
        )
        self.memory_held = Gauge(
            "strata_memory_held_bytes",
            "Bytes held against the memory budget, by kind (snapshot, restore, prefetch, encode, "
            "redundancy).",
            ["kind"],
            registry=r,
        )
        self.memory_refusals = Counter(
            "strata_memory_refusals_total",
            "Requests refused with RESOURCE_EXHAUSTED because they did not fit the memory budget.",
            ["kind"],
            registry=r,
        )
        self.busy_refusals = Counter(
            "strata_rpc_refusals_total",
            "Blocking calls refused with RESOURCE_EXHAUSTED because --max-blocking-rpcs were running.",
            ["method"],
            registry=r,
        )
