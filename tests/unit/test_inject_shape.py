"""World size and rank for the injection: read from the pod's Job or JobSet (the operator's watch
cache, else one GET), never guessed."""

from __future__ import annotations

import asyncio
from typing import Any

from sidecar.operator.controller import Controller
from sidecar.operator.gang import WatchedJob as _Job
from sidecar.operator.inject import Shape, workload_shape
from sidecar.operator.kube import ApiError
from sidecar.operator.names import (
    JOB_INDEX_LABEL,
    JOB_NAME_LABEL,
    JOBSET_JOB_INDEX_LABEL,
    JOBSET_NAME_LABEL,
    JOBSET_REPLICATED_JOB_LABEL,
)


def pod(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ml", "labels": labels}, "spec": {}}


def job(completions: int) -> dict[str, Any]:
    return {"kind": "Job", "metadata": {"name": "recsys"}, "spec": {"completions": completions}}


def jobset() -> dict[str, Any]:
    """A driver (1 x 1) before the workers (3 replicas x 4 completions)."""
    return {
        "kind": "JobSet",
        "metadata": {"name": "ranker"},
        "spec": {
            "replicatedJobs": [
                {"name": "driver", "replicas": 1, "template": {"spec": {"completions": 1}}},
                {"name": "workers", "replicas": 3, "template": {"spec": {"completions": 4}}},
            ]
        },
    }


def jobset_pod(job_index: str, completion: str) -> dict[str, Any]:
    return pod(
        {
            JOBSET_NAME_LABEL: "ranker",
            JOBSET_REPLICATED_JOB_LABEL: "workers",
            JOBSET_JOB_INDEX_LABEL: job_index,
            JOB_INDEX_LABEL: completion,
        }
    )


def test_a_jobs_world_size_is_its_completions_and_the_rank_its_completion_index() -> None:
    assert workload_shape(job(8), pod({JOB_NAME_LABEL: "recsys", JOB_INDEX_LABEL: "3"})) == Shape(8, None)
    assert workload_shape(None, pod({})) == Shape()


def test_a_jobset_pods_global_rank_counts_the_replicated_jobs_before_it() -> None:
    # driver: rank 0; workers-0: 1..4, workers-1: 5..8, workers-2: 9..12
    assert workload_shape(jobset(), jobset_pod("0", "0")) == Shape(13, 1)
    assert workload_shape(jobset(), jobset_pod("1", "2")) == Shape(13, 7)
    assert workload_shape(jobset(), jobset_pod("2", "3")) == Shape(13, 12)
    # labels missing or not numbers: the world size only (the template's rank applies)
    assert workload_shape(jobset(), jobset_pod("x", "3")) == Shape(13, None)


class _Api:
    def __init__(self, found: dict[str, Any] | None = None, error: Exception | None = None) -> None:
        self.found, self.error, self.urls = found, error, []

    async def get(self, url: str) -> dict[str, Any] | None:
        self.urls.append(url)
        if self.error is not None:
            raise self.error
        return self.found


def test_the_controller_reads_the_watch_cache_first_then_one_get() -> None:
    api = _Api(found=job(4))
    controller = Controller(api)  # type: ignore[arg-type]
    cached = _Job("ml", "recsys")
    cached.workload = job(16)
    controller.jobs[("ml", "recsys")] = cached
    labels = {JOB_NAME_LABEL: "recsys", JOB_INDEX_LABEL: "0"}
    assert asyncio.run(controller.shape_of("ml", pod(labels))) == Shape(16, None)
    assert api.urls == []
    del controller.jobs[("ml", "recsys")]
    assert asyncio.run(controller.shape_of("ml", pod(labels))) == Shape(4, None)
    assert api.urls == ["/apis/batch/v1/namespaces/ml/jobs/recsys"]
    api.found = jobset()
    assert asyncio.run(controller.shape_of("ml", jobset_pod("1", "0"))) == Shape(13, 5)
    assert api.urls[-1] == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets/ranker"


def test_an_api_error_or_a_bare_pod_leaves_the_shape_to_the_template() -> None:
    controller = Controller(_Api(error=ApiError(403, "Forbidden", "no get")))  # type: ignore[arg-type]
    assert asyncio.run(controller.shape_of("ml", pod({JOB_NAME_LABEL: "recsys"}))) == Shape()
    assert asyncio.run(controller.shape_of("ml", pod({}))) == Shape()
