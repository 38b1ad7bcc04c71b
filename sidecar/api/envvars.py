"""Every ``STRATA_*`` environment variable Strata reads, sidecar and trainer client alike: a
trainer and its sidecar often share one environment, so each side knows the other's names and
warns only of a name neither reads (a misspelling, with the name it is closest to)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

KNOWN = frozenset(
    {
        # the trainer client
        "STRATA_ADDRESS", "STRATA_ATTEMPT",  # STRATA_RESTART's older name, still read
        "STRATA_CHUNK_BYTES", "STRATA_COMMIT_TIMEOUT_S",
        "STRATA_GENERATION", "STRATA_JOB", "STRATA_MAX_MESSAGE_BYTES", "STRATA_NAMESPACE",
        "STRATA_OVERLAP", "STRATA_RANK", "STRATA_REPLICAS", "STRATA_RESTART", "STRATA_RESUME",
        "STRATA_SAVE_ON_SIGTERM_S",
        "STRATA_SHM", "STRATA_SOCKET", "STRATA_STAGING_BUFFERS", "STRATA_TOKEN", "STRATA_WHEN_BUSY",
        "STRATA_WORLD_SIZE",
        # the sidecar's settings (sidecar.config: STRATA_ + the flag's name)
        "STRATA_STORAGE", "STRATA_SOCKET_MODE", "STRATA_TCP_PORT", "STRATA_TCP_HOST",
        "STRATA_METRICS_PORT", "STRATA_METRICS_HOST", "STRATA_S3_ENDPOINT", "STRATA_S3_REGION",
        "STRATA_OBJECT_BYTES", "STRATA_UPLOAD_CONCURRENCY", "STRATA_MAX_SNAPSHOT_BYTES",
        "STRATA_MAX_HELD_SNAPSHOTS", "STRATA_MAX_RANKS", "STRATA_MAX_TREE_BYTES", "STRATA_MAX_TENSORS",
        "STRATA_MEMORY_BUDGET", "STRATA_MAX_BLOCKING_RPCS",
        "STRATA_STORAGE_ATTEMPTS", "STRATA_SHM_DIR", "STRATA_POLICY", "STRATA_MAX_DIFFS",
        "STRATA_QUANTIZE", "STRATA_QUANTIZE_MATCH", "STRATA_EXPECTED_RESTORES", "STRATA_RESTORE_BITS",
        "STRATA_RESTORE_CLASS", "STRATA_EXPECTED_STORAGE_RESTORES",
        "STRATA_ENCODE_WORKERS", "STRATA_NICE", "STRATA_KEEP", "STRATA_TRACKING_CHECK_FRACTION",
        "STRATA_TRACKING_CHECK_CONFIDENCE", "STRATA_GENERATION_FILE", "STRATA_CONDITIONAL_WRITES",
        "STRATA_PEER_PORT", "STRATA_PEER_HOST", "STRATA_PEERS", "STRATA_PEER_FETCH_TIMEOUT_S",
        "STRATA_HINT_FALLBACK_S", "STRATA_REDUNDANCY", "STRATA_PARITY_GROUP", "STRATA_MEMBERS",
        "STRATA_MEMBER_COUNT", "STRATA_MEMBER_INDEX", "STRATA_REDUNDANCY_DIR",
        "STRATA_REDUNDANCY_RATE_MB_S", "STRATA_DRAIN_TIMEOUT_S", "STRATA_REPORT_URL",
        "STRATA_REPORT_TOKEN_FILE", "STRATA_REPORT_CA_FILE", "STRATA_HEARTBEAT_S",
        "STRATA_RESTORE_REQUEST_FILE",
        # the operator, its injection and `strata launch`
        "STRATA_IN_PLACE_RESTART", "STRATA_JOBSET_UID", "STRATA_JOBSET_RESTART", "STRATA_HEARTBEAT_FILE",
        "STRATA_PG_TIMEOUT_S", "STRATA_RESTART_GRACE_S", "STRATA_EXAMPLE_THREADS", "STRATA_PLACEHOLDER",
        # debugging (tracebacks) and test hooks
        "STRATA_DEBUG", "STRATA_FAULTS", "STRATA_FAULTS_RANK", "STRATA_SIDECAR_FAULTS",
        "STRATA_SIDECAR_FAULTS_INDEX", "STRATA_TEST_FAULTS", "STRATA_TEST_STALE_FENCES",
        "STRATA_CHAOS_RESULTS", "STRATA_CHAOS_SEED", "STRATA_CHAOS_TRIALS",
    }
)  # fmt: skip


def unknown(env: Mapping[str, str], known: Iterable[str] = KNOWN) -> list[str]:
    """One warning per ``STRATA_*`` variable in ``env`` that Strata does not read, naming the
    known variable it is closest to, if any is close."""
    names = set(known)
    warnings = []
    for name in sorted(env):
        if not name.startswith("STRATA_") or name in names:
            continue
        # Compared without the prefix every name shares, which would make any two look alike.
        suffixes = [n.removeprefix("STRATA_") for n in names]
        close = difflib.get_close_matches(name.removeprefix("STRATA_"), suffixes, n=1, cutoff=0.6)
        hint = f"did you mean STRATA_{close[0]}?" if close else "Strata reads no variable of that name"
        warnings.append(f"ignoring the environment variable {name}: {hint}")
    return warnings
