"""Operator resilience: gang restarts that meet an apiserver's faults, against the emulated API
(tests/k8s/emulator.py and its fault knobs) with the emulated Job controller and kubelets
(tests/k8s/cluster.py) and the real operator (``serve``), all on one event loop.

Scenario: one opted-in Indexed Job of ``WORLD`` pods that take ``TERMINATION_S`` to terminate,
``strata.dev/backoff-seconds: "0"``, the operator with its defaults (a pod list every 60 s, the
fence 30 s past a grace period). Each trial fails one pod and times the gang restart: from the
failing PATCH until every pod of the next generation runs. Three kinds, interleaved per round:

- ``operator_restart_undisturbed_s``: nothing else happens;
- ``operator_restart_after_watch_expiry_s``: once the old gang is evicted, the pods' watch expires
  (410) and the pods' lists and watches stay down until the evicted pods are gone: no DELETED event
  reaches the operator; kopf lists again after the outage, and the operator's pod list that follows
  a relisting finds the old pods gone;
- ``operator_restart_after_conn_reset_s``: the watch streams are reset as the pod fails, the first
  eviction is reset before it applies and the next after (its answer lost), and the release's first
  pod patch is reset.

Each is a median over the trials with a 95% CI (``_ci_lo_s``/``_ci_hi_s``) and ``_n``; the target
is within 2x the undisturbed restart. A trial whose restart does not complete within ``STUCK_S``
fails the section with what the operator knows of the job (stuck is never a figure).

Standalone: ``python -m tests.bench.operator_resilience [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Row, median, median_ci, print_table

WORLD = 8
TERMINATION_S = 1.0
STUCK_S = 60.0
JOB = "resilience"
JOBS = "/apis/batch/v1/namespaces/default/jobs"
OPERATOR = "strata-operator"  # the operator's User-Agent: the cluster simulation's calls stay untouched
KINDS = ("undisturbed", "after_watch_expiry", "after_conn_reset")

__all__ = ["measure"]


class Stuck(RuntimeError):
    """A gang restart that did not complete."""


def _running_generation(pods: list[dict[str, Any]]) -> str | None:
    from sidecar.operator import names

    live = [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and not p.get("spec", {}).get("schedulingGates")
    ]
    generations = {(p["metadata"].get("annotations") or {}).get(names.GENERATION_ANNOTATION) for p in live}
    return generations.pop() if len(live) == WORLD and len(generations) == 1 else None


async def _until(what: Callable[[], Any], timeout: float, message: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := what()):
        if time.monotonic() > deadline:
            raise Stuck(f"timed out after {timeout:.0f} s waiting for {message}")
        await asyncio.sleep(0.02)
    return found


class _Trials:
    def __init__(self, k8s: Any, cluster: Any, op: Any) -> None:
        self.k8s, self.cluster, self.op = k8s, cluster, op
        self.restart = 0

    def at(self, restart: int) -> bool:
        generation = _running_generation(self.cluster.by_job().get(JOB, []))
        return generation is not None and generation.endswith(f"/{restart}")

    def describe(self) -> str:
        job = self.op.controller.jobs.get(("default", JOB))
        status = (job.status if job is not None else None) or {}
        pods = self.cluster.pods(JOB)
        shown = ", ".join(
            f"{p['metadata']['name']}:{p.get('status', {}).get('phase')}"
            + (" gated" if p.get("spec", {}).get("schedulingGates") else "")
            + (" deleting" if p["metadata"].get("deletionTimestamp") else "")
            for p in pods
            if p.get("status", {}).get("phase") != "Failed"
        )
        return (
            f"StrataJob phase {status.get('phase')}, generation {status.get('generation')}, pending "
            f"{status.get('pendingRestart')}; the operator indexes {len(job.pods) if job else 0} pods; "
            f"live pods: {shown}"
        )

    async def one(self, kind: str, trial: int) -> float:
        """One gang restart of ``kind``: seconds from the failing PATCH until the next generation runs."""
        from tests.k8s.emulator import PODS

        self.restart += 1
        pods = sorted(self.cluster.pods(JOB), key=lambda p: p["metadata"]["name"])
        old = [p for p in pods if p.get("status", {}).get("phase") == "Running"]
        victim = old[trial % len(old)]
        others = {p["metadata"]["name"] for p in old} - {victim["metadata"]["name"]}
        api = self.k8s.api
        if kind == "after_conn_reset":
            api.reset_next(1, method="POST", path=r"/eviction$", agent=OPERATOR)
            api.reset_next(1, method="POST", path=r"/eviction$", agent=OPERATOR, applied=True)
            api.reset_next(1, method="PATCH", path=r"/pods/[^/]+$", agent=OPERATOR)
        t0 = time.monotonic()
        await self.cluster.fail(victim)
        try:
            if kind == "after_conn_reset":
                await api.reset_watches()
            elif kind == "after_watch_expiry":

                def evicted() -> bool:
                    live = {p["metadata"]["name"]: p for p in self.cluster.pods(JOB)}
                    return all(live.get(n, {}).get("metadata", {}).get("deletionTimestamp") for n in others)

                await _until(evicted, STUCK_S, "the old gang's eviction")
                async with api.watch_outage(PODS):
                    await _until(
                        lambda: not others & {p["metadata"]["name"] for p in self.cluster.pods(JOB)},
                        STUCK_S,
                        "the evicted pods gone",
                    )
            await _until(lambda: self.at(self.restart), STUCK_S, f"generation {self.restart} running")
        except Stuck as exc:
            raise Stuck(
                f"operator_restart_{kind}: trial {trial + 1} stuck: {exc}; {self.describe()}"
            ) from None
        finally:
            api._rules.clear()  # a trial's unspent faults never reach the next
        return time.monotonic() - t0


async def _scenario(opts: Options, trials: int) -> dict[str, list[float]]:
    import kmock

    from sidecar.operator.run import OperatorConfig, serve
    from tests.k8s.cluster import Cluster, create, indexed_job
    from tests.k8s.conftest import K8s, write_kubeconfig
    from tests.k8s.emulator import Emulator
    from tests.k8s.test_crds import install_crds

    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    async with Emulator(keep_requests=False) as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        k8s = K8s(api=api, url=url, kubeconfig=write_kubeconfig(opts.tmp / "kubeconfig", url))
        await install_crds(k8s)
        async with Cluster(k8s, termination_s=TERMINATION_S).running() as cluster:
            config = OperatorConfig(kubeconfig=str(k8s.kubeconfig), report_host="127.0.0.1", report_port=0)
            async with serve(config) as op:
                annotations = {"strata.dev/backoff-seconds": "0", "strata.dev/max-restarts": "1000"}
                await create(k8s, JOBS, indexed_job(JOB, WORLD, annotations=annotations))
                run = _Trials(k8s, cluster, op)
                await _until(lambda: run.at(0), STUCK_S, "generation 0 running")
                for trial in range(trials):
                    for kind in KINDS:
                        await asyncio.sleep(0.3)  # the last writes of the previous restart land
                        times[kind].append(await run.one(kind, trial))
                    print(
                        f"     round {trial + 1}/{trials}: "
                        + ", ".join(f"{k} {times[k][-1]:.2f} s" for k in KINDS),
                        flush=True,
                    )
    return times


async def measure(opts: Options, figures: dict[str, Any]) -> list[Row]:
    """The three restarts' figures (into ``figures``) and their rows; raises Stuck where one hangs."""
    trials = 3 if opts.quick else 10
    times = await _scenario(opts, trials)
    for kind in KINDS:
        key = f"operator_restart_{kind}"
        lo, hi = median_ci(times[kind])
        figures[f"{key}_s"] = median(times[kind])
        figures[f"{key}_ci_lo_s"], figures[f"{key}_ci_hi_s"] = lo, hi
        figures[f"{key}_n"] = len(times[kind])
    return _rows(figures)


def _rows(f: dict[str, Any]) -> list[Row]:
    base = f.get("operator_restart_undisturbed_s")
    rows = []
    for kind in KINDS:
        key = f"operator_restart_{kind}"
        value = f.get(f"{key}_s")
        ratio = value / base if value is not None and base else None
        unit = (
            f"s (95% CI {f[f'{key}_ci_lo_s']:.2f}-{f[f'{key}_ci_hi_s']:.2f}, n={f[f'{key}_n']}; "
            f"{WORLD}-pod gang)"
        )
        undisturbed = kind == "undisturbed"
        rows.append(
            Row(
                f"{key}_s",
                value,
                unit,
                None if undisturbed else ratio,
                "" if undisturbed else "undisturbed",
                target="" if undisturbed else "<= 2x undisturbed",
                passed=None if undisturbed or ratio is None else ratio <= 2.0,
            )
        )
    return rows


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 trials of each kind (default: 10)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        opts = Options(size_gib=0.0, quick=args.quick, tmp=Path(tmp))
        figures: dict[str, Any] = {}
        rows = asyncio.run(measure(opts, figures))
    print_table(rows)


if __name__ == "__main__":
    _main()
