"""The controller's defences against a misbehaving apiserver, without one: which failures are
transient, the retry's backoff and Retry-After, and the pod list that corrects the pod index."""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import pytest

from sidecar.operator import names
from sidecar.operator.controller import RETRY_MAX_S, Controller
from sidecar.operator.gang import WatchedJob
from sidecar.operator.kube import ApiError, transient
from sidecar.operator.run import OperatorConfig, _settings


class _Api:
    """Answers every request with ``answer`` (a pod LIST), or raises ``error``."""

    def __init__(self, answer: Any = None, error: BaseException | None = None) -> None:
        self.answer, self.error = answer, error
        self.requests: list[tuple[str, str, Any]] = []

    async def request(self, method: str, url: str, body: Any = None, **kwargs: Any) -> Any:
        self.requests.append((method, url, kwargs.get("params")))
        if self.error is not None:
            raise self.error
        return self.answer


def _pod(name: str, rv: int, job: str = "train", uid: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid or f"uid-{name}",
            "resourceVersion": str(rv),
            "labels": {names.JOB_NAME_LABEL: job, names.OPT_IN_LABEL: names.OPT_IN_VALUE},
        },
        "status": {"phase": "Running"},
    }


def test_transient_failures_are_the_ones_a_busy_or_restarting_apiserver_causes() -> None:
    assert transient(aiohttp.ServerDisconnectedError())
    assert transient(ConnectionResetError())
    assert transient(TimeoutError())
    for status in (409, 429, 500, 503, 504):
        assert transient(ApiError(status, "", ""))
    for status in (400, 403, 404, 422):
        assert not transient(ApiError(status, "", ""))
    assert not transient(KeyError("a bug"))


@pytest.mark.asyncio
async def test_retries_back_off_exponentially_with_jitter_capped_and_never_before_retry_after() -> None:
    now = [1000.0]
    controller = Controller(_Api(), clock=lambda: now[0], rng=random.Random(7))  # type: ignore[arg-type]
    job = WatchedJob("default", "train")
    delays = []
    for _ in range(12):
        controller._retry_later(job, aiohttp.ServerDisconnectedError())
        delays.append(job.hold_until - now[0])
    assert delays[0] < 0.3 and delays[3] > delays[0]  # 0.2 s doubling, jittered down to half
    assert max(delays) <= RETRY_MAX_S and delays[-1] >= RETRY_MAX_S / 2
    assert job.timer is not None  # armed again: no job waits for an event that never comes
    job.retries = 0
    controller._retry_later(job, ApiError(429, "TooManyRequests", "slow down", retry_after=5.0))
    assert 5.0 <= job.hold_until - now[0] <= 6.0
    controller._retry_later(job, KeyError("a bug"))  # unexpected: logged with its traceback, retried
    assert job.retries == 2
    controller.close()


@pytest.mark.asyncio
async def test_reconcile_never_raises_and_holds_until_the_backoff_ends() -> None:
    now = [1000.0]
    controller = Controller(_Api(), clock=lambda: now[0])  # type: ignore[arg-type]
    job = WatchedJob("default", "train")
    calls = []

    async def failing(watched: WatchedJob) -> None:
        calls.append(now[0])
        raise aiohttp.ClientOSError(104, "Connection reset by peer")

    controller._reconcile = failing  # type: ignore[method-assign]
    await controller.reconcile(job)
    await controller.reconcile(job)  # an event within the backoff: no call
    assert calls == [1000.0] and job.retries == 1
    now[0] = job.hold_until
    await controller.reconcile(job)
    assert len(calls) == 2 and job.retries == 2
    controller.close()


@pytest.mark.asyncio
async def test_the_pod_list_drops_pods_it_lacks_keeps_newer_ones_and_adds_unknown_ones() -> None:
    gone, newer, kept, deleted = _pod("gone", 5), _pod("newer", 50), _pod("kept", 6), _pod("deleted", 7)
    unknown = _pod("unknown", 8)
    api = _Api({"metadata": {"resourceVersion": "10"}, "items": [kept, unknown, deleted]})
    controller = Controller(api)  # type: ignore[arg-type]
    job = controller._job("default", "train")
    job.pods = {"gone": gone, "newer": newer, "kept": kept}
    controller.tombstones["uid-deleted"] = float("inf")  # its deletion seen after the list was asked
    assert await controller.resync_pods() == 2  # one gone, one added
    assert set(job.pods) == {"newer", "kept", "unknown"}  # "deleted" is not brought back
    assert api.requests == [
        ("GET", "/api/v1/pods", {"labelSelector": f"{names.OPT_IN_LABEL}={names.OPT_IN_VALUE}"})
    ]
    await controller.resync_pods("default")
    assert api.requests[-1][1] == "/api/v1/namespaces/default/pods"  # one LIST per watched namespace


def test_kopf_watches_get_a_client_timeout() -> None:
    watching = _settings(OperatorConfig()).watching
    assert watching.server_timeout is not None and watching.client_timeout is not None
    assert watching.client_timeout > watching.server_timeout and watching.connect_timeout
