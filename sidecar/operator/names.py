"""Names shared by the operator, its admission logic, the chart and the sidecar's reports: one place,
so a label or annotation is never spelled two ways."""

from __future__ import annotations

# Reserved trainer exit codes live in the wire contract (the trainer client exits with them): 75 "a
# peer died, the gang restarts" (podFailurePolicy Ignore), 76 "Strata's restart limit is spent"
# (FailJob).
from sidecar.api import EXIT_LIMIT_SPENT as EXIT_LIMIT_SPENT
from sidecar.api import EXIT_PEER_DIED as EXIT_PEER_DIED

GROUP = "strata.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Opt-in label on a pod template (and so on its pods).
OPT_IN_LABEL = "strata.dev/checkpoint"
OPT_IN_VALUE = "enabled"
#: Settings travel as ``strata.dev/<setting>`` annotations (the sidecar's ``STRATA_<SETTING>``).
ANNOTATION_PREFIX = "strata.dev/"

#: Scheduling gate the admission logic adds to opted-in Job-owned pods; the operator lifts it.
GANG_GATE = "strata.dev/gang"
#: Pod annotation the operator writes before lifting the gate: the gang generation RUN/RESTART,
#: read by the sidecar through a downward-API volume.
GENERATION_ANNOTATION = "strata.dev/generation"
#: Pod annotation carrying a one-shot restore request for this generation (a step, or "none").
RESTORE_REQUEST_ANNOTATION = "strata.dev/restore-request"
#: Pod annotation the webhook writes: the CA bundle (PEM) the sidecar verifies the report endpoint
#: with, read through the downward-API volume (so no Secret or ConfigMap per namespace).
REPORT_CA_ANNOTATION = "strata.dev/report-ca"
#: Pod annotations the injection reads: a Secret whose keys become the sidecar's env (storage
#: credentials), and the shared-memory volume's sizeLimit.
STORAGE_SECRET_ANNOTATION = "strata.dev/storage-secret"
SHM_SIZE_ANNOTATION = "strata.dev/shm-size"
#: Pod annotations overriding the injected sidecar's resources: memory (request = limit) and CPU
#: request, Kubernetes quantities.
SIDECAR_MEMORY_ANNOTATION = "strata.dev/sidecar-memory"
SIDECAR_CPU_ANNOTATION = "strata.dev/sidecar-cpu"
#: Job annotation: roll back once to this step at the next generation (mutable).
RESUME_FROM_ANNOTATION = "strata.dev/resume-from"
#: Job annotation: "fresh" starts a new run under a reused Job name (default: resume).
RUN_ANNOTATION = "strata.dev/run"

#: Labels on Checkpoint objects.
JOB_LABEL = "strata.dev/job"
LATEST_LABEL = "strata.dev/latest"

#: The restore request that tells a released pod's sidecar to refuse its trainer: the limit is spent.
STOP_REQUEST = "stop"

#: The sidecars' peer port when strata.dev/redundancy is on (container port PEER_PORT_NAME; the chart's
#: optional peer NetworkPolicy admits it between opted-in pods of a namespace under a default-deny).
PEER_PORT = 9411
PEER_PORT_NAME = "strata-peer"

#: Audience of the projected service-account token a sidecar sends with its reports.
REPORT_AUDIENCE = "strata.dev/report"

# JobSet: its API group, and the domain of the labels it puts on pods
JOBSET_API_GROUP = "jobset.x-k8s.io"
JOBSET_GROUP = "jobset.sigs.k8s.io"
JOBSET_RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"
JOBSET_REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
# The Job controller's own pod labels.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"

#: The injected sidecar container (a native sidecar: an init container with restartPolicy Always).
SIDECAR_CONTAINER = "strata-sidecar"
#: Env var marking the stand-in sidecar the workload webhook puts in a pod template (the pod webhook
#: completes it in each pod); ``strata sidecar`` run with it set stays up doing nothing.
PLACEHOLDER_ENV = "STRATA_PLACEHOLDER"
