"""Stuck-gang detection: for each cause, the time from a pod entering the state (the kubelet's or the
scheduler's status write returns; for GangIncomplete, the Job's gated pods exist and one index is
never created) until the StrataJob shows condition Stuck with that cause as its reason. The
operator runs with its default grace (``OperatorConfig.stuck_grace_s``, 30 s), so the figure is
the grace plus what the operator adds; the target is a minute.

Then every cause is fixed at once: ``operator_stuck_gang_clear_s`` is the slowest from the fix
to the condition False.

The operator (kopf, controller), the emulated API and the simulated cluster share this process's
one event loop, as in ``tests/bench/operator.py``. All causes run at the same time, one small Job
each. Run it alone: ``PYTHONPATH=$PWD .venv/bin/python -m tests.bench.operator_stuck``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Row, print_table

__all__ = ["measure"]

JOBS = "/apis/batch/v1/namespaces/default/jobs"
STRATAJOBS = "/apis/strata.dev/v1alpha1/namespaces/default/stratajobs"
TARGET_S = 60.0
#: cause -> the key's infix
CAUSES = {
    "ImagePullBackOff": "image_pull_backoff",
    "CreateContainerConfigError": "create_container_config_error",
    "Unschedulable": "unschedulable",
    "SidecarCrashLoop": "sidecar_crash_loop",
    "GangIncomplete": "gang_incomplete",
}


async def _until(what: Callable[[], Awaitable[Any]], timeout: float, message: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = await what()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}")
        await asyncio.sleep(0.05)


async def _condition(k8s: Any, job: str) -> dict[str, Any] | None:
    from tests.k8s.conftest import call

    status, body = await call(k8s, "GET", f"{STRATAJOBS}/{job}")
    if status != 200:
        return None
    conditions = (body.get("status") or {}).get("conditions") or []
    found: dict[str, Any] | None = next((c for c in conditions if c.get("type") == "Stuck"), None)
    return found


async def _one(k8s: Any, cluster: Any, cause: str, figures: dict[str, Any], fixed: asyncio.Event) -> None:
    from sidecar.operator import names
    from tests.k8s.cluster import create, indexed_job

    job = f"stuck-{CAUSES[cause].replace('_', '-')}"
    if cause == "GangIncomplete":
        cluster.refused.add((job, 1))
        await create(k8s, JOBS, indexed_job(job, 2))

        async def gated() -> bool:
            return bool(cluster.pods(job))

        await _until(gated, 30, f"{job}'s gated pod")
        entered = time.monotonic()
    else:
        cluster.held.add((job, 1))
        await create(k8s, JOBS, indexed_job(job, 2))

        async def released() -> dict[str, Any] | None:
            for pod in cluster.pods(job):
                meta = pod["metadata"]
                if (
                    meta["labels"].get(names.JOB_INDEX_LABEL) == "1"
                    and not pod["spec"].get("schedulingGates")
                    and (meta.get("annotations") or {}).get(names.GENERATION_ANNOTATION)
                ):
                    return pod
            return None

        pod = await _until(released, 30, f"{job}'s index 1 released")
        put = {
            "ImagePullBackOff": cluster.image_pull_backoff,
            "CreateContainerConfigError": cluster.create_container_config_error,
            "Unschedulable": cluster.unschedulable,
            "SidecarCrashLoop": cluster.sidecar_crash_loop,
        }[cause]
        await put(pod)
        entered = time.monotonic()

    async def stuck() -> bool:
        condition = await _condition(k8s, job)
        return condition is not None and condition["status"] == "True" and condition["reason"] == cause

    await _until(stuck, 2 * TARGET_S, f"{job}'s Stuck condition")
    figures[f"operator_stuck_gang_detect_{CAUSES[cause]}_s"] = time.monotonic() - entered
    await fixed.wait()
    fixed_at = time.monotonic()
    if cause == "GangIncomplete":
        cluster.refused.discard((job, 1))
    else:
        await cluster.start(pod)

    async def cleared() -> bool:
        condition = await _condition(k8s, job)
        return condition is not None and condition["status"] == "False"

    await _until(cleared, 60, f"{job}'s Stuck condition cleared")
    figures[f"operator_stuck_gang_clear_{CAUSES[cause]}_s"] = time.monotonic() - fixed_at


async def measure(opts: Options, figures: dict[str, Any]) -> list[Row]:
    import kmock

    from sidecar.operator.run import OperatorConfig, serve
    from tests.k8s.cluster import Cluster
    from tests.k8s.conftest import K8s, write_kubeconfig
    from tests.k8s.emulator import Emulator
    from tests.k8s.test_crds import install_crds

    async with Emulator(keep_requests=False) as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        k8s = K8s(api=api, url=url, kubeconfig=write_kubeconfig(opts.tmp / "kubeconfig", url))
        await install_crds(k8s)
        async with Cluster(k8s).running() as cluster:
            config = OperatorConfig(kubeconfig=str(k8s.kubeconfig), report_host="127.0.0.1", report_port=0)
            figures["operator_stuck_grace_s"] = config.stuck_grace_s
            async with serve(config):
                fixed = asyncio.Event()
                tasks = [asyncio.create_task(_one(k8s, cluster, cause, figures, fixed)) for cause in CAUSES]

                async def detected() -> bool:
                    if any(t.done() and t.exception() for t in tasks):
                        return True
                    return all(f"operator_stuck_gang_detect_{key}_s" in figures for key in CAUSES.values())

                await _until(detected, 3 * TARGET_S, "every cause detected")
                fixed.set()
                await asyncio.gather(*tasks)
    detects = [figures[f"operator_stuck_gang_detect_{key}_s"] for key in CAUSES.values()]
    figures["operator_stuck_gang_detect_s"] = max(detects)
    figures["operator_stuck_gang_clear_s"] = max(
        figures[f"operator_stuck_gang_clear_{key}_s"] for key in CAUSES.values()
    )
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    grace = f.get("operator_stuck_grace_s")
    rows = []
    for key in ["", *(f"_{k}" for k in CAUSES.values())]:
        value = f.get(f"operator_stuck_gang_detect{key}_s")
        rows.append(
            Row(
                f"operator_stuck_gang_detect{key}_s",
                value,
                f"s (state entered -> condition Stuck; grace {grace:g} s)" if grace is not None else "s",
                target=f"<= {TARGET_S:g} s",
                passed=None if value is None else value <= TARGET_S,
            )
        )
    rows.append(
        Row("operator_stuck_gang_clear_s", f.get("operator_stuck_gang_clear_s"), "s (fixed -> Stuck False)")
    )
    return rows


def main() -> None:
    figures: dict[str, Any] = {}
    opts = Options(size_gib=1.0, quick=True, tmp=Path(tempfile.mkdtemp(prefix="strata-bench-stuck-")))
    rows = asyncio.run(measure(opts, figures))
    print_table(rows)
    print("\n".join(f"{key} = {value:.4f}" for key, value in sorted(figures.items())))


if __name__ == "__main__":
    main()
