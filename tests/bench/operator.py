"""Operator section: the operator (kopf watches, controller, report endpoint) against the emulated
Kubernetes API (tests/k8s/emulator.py) with an emulated Job controller and kubelets
(tests/k8s/cluster.py), all on this process's one event loop.

Scenario: 200 watched opted-in Indexed Jobs (199 with 1-2 pods, one with 64), pods take 2 s to
terminate, ``strata.dev/backoff-seconds: "0"`` (the configured backoff is not measured).

- ``operator_failure_to_decision_*``: a pod's PATCH to Failed returns -> the controller decides the
  gang restart (``Controller.decisions``); one pod in each of many small jobs, spread in time, plus
  the 64-pod job.
- ``operator_api_calls_per_restart``: the operator's API requests (``Operator.api.calls``) from
  that 64-pod failure until its new generation runs, with nothing else restarting, per pod of the
  gang (the target is per pod); ``_total`` is the whole restart's count. kopf's watch streams are
  not in it (they are long-lived, not per restart).
- ``operator_report_to_cr_*``: a commit report POSTed to ``/v1/reports`` -> the Checkpoint exists
  with ``status.ready`` (as the client sees it), two reports per job, open-loop arrivals at 10/s;
  ``_stress_`` is one more per job at 40/s, no target (it saturates the one shared loop).
- ``operator_rss_bytes``: this process's VmRSS once every job is watched and running: the operator
  with the emulated API, the cluster simulation and whatever the bench entry point imported (torch);
  ``_delta_`` is that minus VmRSS before the operator started and the jobs were created (still
  including the emulator's objects, their version history and its event log).

Further scenarios, each on a fresh emulated cluster, live in their own modules (``SCENARIOS``):
``operator_failover`` (the operator SIGKILLed mid-restart, a new process takes over),
``operator_stuck`` (each stuck cause until the StrataJob's Stuck condition),
``operator_resilience`` (gang restarts meeting an expired watch or connection resets) and
``operator_preemption`` (Kueue suspend/resume cycles, which spend no crash budget).

The emulator runs with ``keep_requests=False`` (kmock's request history, which it scans on every
request, would otherwise be measured as the operator's latency). The loop lag printed per phase
shows how busy the one loop that the operator, the emulated API and the clients share was.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

from tests.bench.common import MiB, Options, Phases, Row, median_ci

BIG_WORLD = 64
TERMINATION_S = 2.0
#: Commit reports a second: 200 jobs each committing every 20 s (a steady, generous load). Then a
#: burst at STRESS_RATE, printed and stored but without a target: on this one event loop, shared
#: with the emulated API and the clients, that saturates the loop (see the loop lag printed).
REPORT_RATE = 10.0
STRESS_RATE = 40.0
JOBS = "/apis/batch/v1/namespaces/default/jobs"
CHECKPOINTS = "/apis/strata.dev/v1alpha1/namespaces/default/checkpoints"
ANNOTATIONS = {"strata.dev/backoff-seconds": "0", "strata.dev/max-restarts": "10"}
#: The controller's own Event log lines expected here (one per restart): kept out of the output.
EXPECTED_EVENTS = {"GangRestart", "GangReleased"}

__all__ = ["Options", "run"]


# --- helpers ------------------------------------------------------------------------------------


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _quantile_ci(values: list[float], q: float, confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free CI for the q-quantile from order statistics (binomial ranks, as
    ``common.median_ci`` for the median): x(l) .. x(u); u past the sample gives its maximum."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return math.nan, math.nan
    tail = (1 - confidence) / 2
    pmf = [math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(n + 1)]
    cdf, acc = [], 0.0
    for p in pmf:
        acc += p
        cdf.append(acc)  # cdf[r] = P(X <= r)
    lo = 1
    while lo < n and cdf[lo] <= tail:  # P(X <= lo) <= tail: x(lo+1) is still a lower bound
        lo += 1
    hi = next((r for r in range(1, n + 1) if cdf[r - 1] >= 1 - tail), n)
    return xs[lo - 1], xs[hi - 1]


def _summary(figures: dict[str, Any], key: str, values: list[float]) -> None:
    figures[f"{key}_n"] = len(values)
    if not values:
        return
    figures[f"{key}_p50_s"] = _quantile(values, 0.5)
    figures[f"{key}_p99_s"] = _quantile(values, 0.99)
    figures[f"{key}_max_s"] = max(values)
    lo, hi = median_ci(values)
    figures[f"{key}_p50_ci_lo_s"], figures[f"{key}_p50_ci_hi_s"] = lo, hi
    lo, hi = _quantile_ci(values, 0.99)
    figures[f"{key}_p99_ci_lo_s"], figures[f"{key}_p99_ci_hi_s"] = lo, hi


def _call_kind(method: str, url: str) -> str:
    """What an operator API request was, without namespace and names."""
    parts = url.split("?")[0].strip("/").split("/")
    if parts and parts[0] == "api":
        parts = parts[2:]  # api, v1
    elif parts and parts[0] == "apis":
        parts = parts[3:]  # apis, group, version
    if len(parts) >= 2 and parts[0] == "namespaces":
        parts = parts[2:]
    resource = parts[0] if parts else "?"
    sub = f"/{parts[2]}" if len(parts) >= 3 else ""
    return f"{method} {resource}{sub}"


class _QuietEvents(logging.Filter):
    """Drops the controller's log line of the Events every restart posts (hundreds here); every other
    record passes, counted by level."""

    def __init__(self) -> None:
        super().__init__()
        self.passed: collections.Counter[str] = collections.Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 3 and args[2] in EXPECTED_EVENTS:
            return False
        self.passed[record.levelname] += 1
        return True


def _generation(pod: dict[str, Any]) -> str | None:
    from sidecar.operator import names

    return (pod["metadata"].get("annotations") or {}).get(names.GENERATION_ANNOTATION)


def _running_generation(pods: list[dict[str, Any]], world: int) -> str | None:
    """The generation all ``world`` pods run, ungated and not deleting; None while they do not."""
    live = [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and not p.get("spec", {}).get("schedulingGates")
    ]
    generations = {_generation(p) for p in live}
    if len(live) != world or len(generations) != 1:
        return None
    return generations.pop()


async def _until(what: Any, timeout: float, message: str, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = what()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}")
        await asyncio.sleep(poll)


def _restart_of(generation: str | None) -> int:
    tail = (generation or "").rpartition("/")[2]
    return int(tail) if tail.isdigit() else -1


# --- the scenario -------------------------------------------------------------------------------------


def _worlds(quick: bool) -> dict[str, int]:
    small = 39 if quick else 199
    worlds = {f"job-{i:03d}": 1 + i % 2 for i in range(small)}
    worlds["big"] = 16 if quick else BIG_WORLD
    return worlds


class _Lag:
    """Event-loop lag (how late a 10 ms sleep wakes) while it runs: the loop is shared by the
    operator, the emulated API, the cluster and the clients, so a saturated loop shows here."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self.samples.append(time.monotonic() - t - 0.01)

    def take(self) -> str:
        xs, self.samples = self.samples, []
        return f"loop lag p99 {_quantile(xs, 0.99) * 1e3:.0f} ms, max {max(xs, default=0) * 1e3:.0f} ms"

    def close(self) -> None:
        self._task.cancel()


@dataclasses.dataclass
class _Run:
    """What the steps share: the emulator, the cluster, the operator and the jobs."""

    opts: Options
    figures: dict[str, Any]
    phases: Phases
    k8s: Any
    cluster: Any
    op: Any
    worlds: dict[str, int]
    lag: _Lag
    latencies: list[float] = dataclasses.field(default_factory=list)
    early: int = 0  # decisions made before the failing PATCH had returned to the client

    def at_restart(self, restart: int, names: list[str]) -> bool:
        pods = self.cluster.by_job()
        return all(
            _restart_of(_running_generation(pods.get(n, []), self.worlds[n])) == restart for n in names
        )

    def first_pod(self, name: str, pods: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        found = (pods or self.cluster.by_job())[name]
        return sorted(found, key=lambda p: p["metadata"]["name"])[0]

    def note_decision(self, name: str, before: float, failed: float) -> float | None:
        at = next((t for n, t in self.op.controller.decisions if n == name and t >= before), None)
        if at is None:
            return None
        self.early += at < failed
        self.latencies.append(max(0.0, at - failed))
        return max(0.0, at - failed)


def _print_stuck(run: _Run, restart: int) -> None:
    """The jobs not (yet) running generation ``restart``, as the controller sees them."""
    pods = run.cluster.by_job()
    stuck = [
        n for n in run.worlds if _restart_of(_running_generation(pods.get(n, []), run.worlds[n])) != restart
    ]
    print(f"     {len(stuck)} jobs not at generation {restart}:", flush=True)
    for name in stuck[:5]:
        job = run.op.controller.jobs.get(("default", name))
        status = (job.status if job is not None else None) or {}
        last = (status.get("lastFailure") or {}).get("message")
        print(
            f"       {name}: phase {status.get('phase')}, generation {status.get('generation')}, "
            f"restarts {status.get('restarts')}, last failure {last!r}",
            flush=True,
        )


async def _start_jobs(run: _Run) -> None:
    from tests.k8s.cluster import create, indexed_job

    t0 = time.monotonic()
    for name, world in run.worlds.items():
        await create(run.k8s, JOBS, indexed_job(name, world, annotations=ANNOTATIONS))
    try:
        await _until(lambda: run.at_restart(0, list(run.worlds)), 120, "every job at generation 0")
    except TimeoutError:
        _print_stuck(run, 0)
        raise
    run.figures["operator_setup_s"] = time.monotonic() - t0


async def _big_restart(run: _Run) -> None:
    """One gang restart of the 64-pod job with nothing else restarting: its API calls, by kind."""
    op, big = run.op, run.worlds["big"]
    kinds: collections.Counter[str] = collections.Counter()
    original = op.api.request

    async def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        kinds[_call_kind(method, url)] += 1
        return await original(method, url, *args, **kwargs)

    op.api.request = counted
    try:
        victim = sorted(run.cluster.by_job()["big"], key=lambda p: p["metadata"]["name"])[big // 2]
        calls0, evicted0 = op.api.calls, len(run.k8s.api.evictions)
        before = time.monotonic()
        await run.cluster.fail(victim)
        failed = time.monotonic()
        await _until(lambda: run.at_restart(1, ["big"]), 60, "the 64-pod job at generation 1")
        ran = time.monotonic()
        calls = op.api.calls - calls0
        await asyncio.sleep(2.0)
        late = op.api.calls - calls0 - calls
        evicted = len(run.k8s.api.evictions) - evicted0
    finally:
        del op.api.request  # the class's method again
    decision = run.note_decision("big", before, failed)
    f = run.figures
    f["operator_api_calls_per_restart_total"] = calls
    f["operator_api_calls_per_restart"] = calls / big
    f["operator_api_calls_after_restart"] = late
    f["operator_big_restart_s"] = ran - failed
    f["operator_big_restart_pods_evicted"] = evicted
    if decision is not None:
        f["operator_big_failure_to_decision_s"] = decision
    print(
        f"     {big}-pod restart: decided in {decision or math.nan:.4f} s, ran in {ran - failed:.1f} s; "
        f"{calls} API calls (+{late} in the 2 s after): "
        + ", ".join(f"{k} {v}" for k, v in kinds.most_common())
        + f"; the emulator evicted {evicted} pods (the rest hit pods already Terminating); {run.lag.take()}",
        flush=True,
    )


async def _small_failures(run: _Run, failures: int) -> None:
    """One pod fails in each of ``failures`` small jobs, 0.2 s apart (restarts overlap)."""
    pods = run.cluster.by_job()
    victims = sorted(n for n in run.worlds if n != "big")[:failures]
    marks: dict[str, tuple[float, float]] = {}
    for name in victims:
        pod = run.first_pod(name, pods)
        before = time.monotonic()
        await run.cluster.fail(pod)
        marks[name] = (before, time.monotonic())
        await asyncio.sleep(0.2)
    await _until(lambda: run.at_restart(1, victims), 90, "every failed job at generation 1", 0.2)
    missing = [
        name for name, (before, failed) in marks.items() if run.note_decision(name, before, failed) is None
    ]
    if missing:
        print(f"     no decision recorded for {len(missing)} jobs: {missing[:5]}", flush=True)
    _summary(run.figures, "operator_failure_to_decision", run.latencies)
    slow = sorted(run.latencies)[-3:]
    print(
        f"     {len(run.latencies)} decisions ({run.early} before the failing PATCH returned, counted 0); "
        f"slowest {', '.join(f'{s:.4f}' for s in slow)} s; {run.lag.take()}",
        flush=True,
    )


def _commit(name: str, step: int, generation: str) -> dict[str, Any]:
    from tests.k8s.test_crds import report

    item = report(step, job=name, attempt=1, generation=generation)

    def mine(key: str) -> str:
        return key.replace("/recsys/", f"/{name}/").replace("/a3/", "/a1/")

    item["commit_key"], item["location"] = mine(item["commit_key"]), mine(item["location"])
    for rank in item["ranks"]:
        rank["manifest_key"] = mine(rank["manifest_key"])
    return item


async def _reports(run: _Run, per_job: int, rate: float, key: str, first_step: int = 100) -> None:
    """Commit reports, ``per_job`` for every job, arriving at ``rate`` a second (open loop); each
    timed from its POST until a GET shows the Checkpoint Ready."""
    import aiohttp

    from sidecar.operator.names import REPORT_AUDIENCE
    from tests.k8s.emulator import Token

    op = run.op
    assert op.report_url is not None
    pods = run.cluster.by_job()
    tokens: dict[str, str] = {}
    generations: dict[str, str] = {}
    for name in run.worlds:
        pod = run.first_pod(name, pods)
        tokens[name] = f"bench-token-{name}"
        run.k8s.api.tokens[tokens[name]] = Token(
            namespace="default",
            service_account="trainer",
            pod_name=pod["metadata"]["name"],
            pod_uid=pod["metadata"]["uid"],
            audiences=[REPORT_AUDIENCE],
        )
        generations[name] = _generation(pod) or "run/0"
    calls0 = op.api.calls
    registry = op.metrics.registry
    sum0 = registry.get_sample_value("strata_operator_report_to_cr_seconds_sum") or 0.0
    n0 = registry.get_sample_value("strata_operator_report_to_cr_seconds_count") or 0.0
    timed: list[tuple[int, float]] = []  # (schedule index, latency)
    errors: list[str] = []

    async def send(session: aiohttp.ClientSession, i: int, name: str, step: int) -> None:
        start = time.monotonic()
        body = {"reports": [_commit(name, step, generations[name])]}
        headers = {"Authorization": f"Bearer {tokens[name]}"}
        async with session.post(f"{op.report_url}/v1/reports", json=body, headers=headers) as resp:
            answer = await resp.json(content_type=None)
        done = time.monotonic()
        if resp.status != 200 or answer.get("accepted") != 1:
            errors.append(f"{name}@{step}: {resp.status} {answer}")
            return
        while True:  # Ready no later than the answer when the first GET shows it
            async with session.get(f"{run.k8s.url}{CHECKPOINTS}/{name}-{step:012d}") as got:
                stored = await got.json(content_type=None) if got.status == 200 else {}
            if (stored.get("status") or {}).get("ready") is True:
                break
            if time.monotonic() - start > 30:
                errors.append(f"{name}@{step}: not Ready after 30 s")
                return
            await asyncio.sleep(0.01)
            done = time.monotonic()
        timed.append((i, done - start))

    schedule = [(name, first_step + 100 * r) for r in range(per_job) for name in run.worlds]
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        tasks = []
        for i, (name, step) in enumerate(schedule):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(send(session, i, name, step)))
        await asyncio.gather(*tasks)
    values = [v for _, v in timed]
    _summary(run.figures, key, values)
    f = run.figures
    f[f"{key}_rate_per_s"] = rate
    calls = f[f"{key}_api_calls_per_report"] = (op.api.calls - calls0) / max(1, len(schedule))
    hist_sum = (registry.get_sample_value("strata_operator_report_to_cr_seconds_sum") or 0.0) - sum0
    hist_n = (registry.get_sample_value("strata_operator_report_to_cr_seconds_count") or 0.0) - n0
    cold = [v for i, v in timed if i < len(run.worlds)]
    quarter = max(1, len(timed) // 4)
    ordered = [v for _, v in sorted(timed)]
    print(
        f"     {len(values)} reports at {rate:g}/s: p99 of the first round {_quantile(cold, 0.99):.3f} s; "
        f"mean {statistics.fmean(values) if values else math.nan:.3f} s (first quarter "
        f"{statistics.fmean(ordered[:quarter]):.3f}, last {statistics.fmean(ordered[-quarter:]):.3f}); "
        f"writer's report_to_cr mean {hist_sum / hist_n if hist_n else math.nan:.3f} s; "
        f"{calls:.1f} API calls per report; {run.lag.take()}",
        flush=True,
    )
    if errors:
        print(f"     {len(errors)} reports failed: {errors[:3]}", flush=True)


async def _scenario(opts: Options, figures: dict[str, Any], phases: Phases) -> None:
    import kmock

    from sidecar.operator.run import OperatorConfig, serve
    from tests.k8s.cluster import Cluster
    from tests.k8s.conftest import K8s, write_kubeconfig
    from tests.k8s.emulator import Emulator
    from tests.k8s.test_crds import install_crds

    worlds = _worlds(opts.quick)
    quiet = _QuietEvents()
    logging.getLogger("strata.operator").addFilter(quiet)
    lag = _Lag()
    try:
        async with Emulator(keep_requests=False) as api, kmock.Server(api) as server:
            url = str(server.url).rstrip("/")
            k8s = K8s(api=api, url=url, kubeconfig=write_kubeconfig(opts.tmp / "kubeconfig", url))
            await install_crds(k8s)
            async with Cluster(k8s, termination_s=TERMINATION_S).running() as cluster:
                await asyncio.sleep(0.2)
                rss_before = _rss()
                config = OperatorConfig(
                    kubeconfig=str(k8s.kubeconfig), report_host="127.0.0.1", report_port=0
                )
                async with serve(config) as op:
                    run = _Run(opts, figures, phases, k8s, cluster, op, worlds, lag)
                    with phases(f"{len(worlds)} jobs created, generation 0 runs"):
                        await _start_jobs(run)
                    await asyncio.sleep(1.0)  # the last status writes land
                    figures["operator_rss_bytes"] = rss_after = _rss()
                    figures["operator_rss_delta_bytes"] = rss_after - rss_before
                    figures["operator_watched_jobs"] = len(op.controller.jobs)
                    print(
                        f"     {len(op.controller.jobs)} jobs, {sum(worlds.values())} pods running in "
                        f"{figures['operator_setup_s']:.1f} s; {op.api.calls} API calls; {lag.take()}",
                        flush=True,
                    )
                    with phases(f"{worlds['big']}-pod gang restart"):
                        await _big_restart(run)
                    failures = 20 if opts.quick else 120
                    with phases(f"{failures} failures -> decisions"):
                        await _small_failures(run, failures)
                    per_job = 1 if opts.quick else 2
                    with phases(f"{per_job * len(worlds)} reports -> Checkpoints at {REPORT_RATE:g}/s"):
                        await _reports(run, per_job, REPORT_RATE, "operator_report_to_cr")
                    with phases(f"{len(worlds)} reports at {STRESS_RATE:g}/s (stress)"):
                        await _reports(run, 1, STRESS_RATE, "operator_report_to_cr_stress", 1000)
                    if quiet.passed:
                        print(f"     operator log records shown: {dict(quiet.passed)}", flush=True)
    finally:
        lag.close()
        logging.getLogger("strata.operator").removeFilter(quiet)


#: The section's further scenarios, each on a fresh emulated cluster: module -> what its phase is.
SCENARIOS = {
    "operator_failover": "operator killed mid-restart, a new one takes over",
    "operator_stuck": "stuck pods and gangs, each cause -> the Stuck condition",
    "operator_resilience": "gang restarts meeting a 410 re-list and connection resets",
    "operator_preemption": "Kueue suspend/resume cycles: disruptions, not crashes",
}


def run(opts: Options, figures: dict[str, Any], phases: Phases) -> list[Row]:
    import importlib

    asyncio.run(_scenario(opts, figures, phases))
    rows = _rows(figures)
    for module, what in SCENARIOS.items():
        scenario = importlib.import_module(f"tests.bench.{module}")
        with phases(what):
            rows += asyncio.run(scenario.measure(opts, figures))
    return rows


def _latency_row(f: dict[str, Any], key: str, q: str, target_s: float | None) -> Row:
    value = f.get(f"{key}_{q}_s")
    lo, hi = f.get(f"{key}_{q}_ci_lo_s"), f.get(f"{key}_{q}_ci_hi_s")
    ci = f"95% CI {lo:.3f}-{hi:.3f}, " if lo is not None and hi is not None else ""
    rate = f.get(f"{key}_rate_per_s")
    ci += f"{rate:g}/s, " if rate else ""
    return Row(
        f"{key}_{q}_s",
        value,
        f"s ({ci}n={f.get(f'{key}_n', 0)})",
        target="" if target_s is None else f"<= {target_s:g} s",
        passed=None if value is None or target_s is None else value <= target_s,
    )


def _rows(f: dict[str, Any]) -> list[Row]:
    per_pod = f.get("operator_api_calls_per_restart")
    rss, delta = f.get("operator_rss_bytes"), f.get("operator_rss_delta_bytes")
    return [
        _latency_row(f, "operator_failure_to_decision", "p50", None),
        _latency_row(f, "operator_failure_to_decision", "p99", 1.0),
        Row(
            "operator_api_calls_per_restart",
            per_pod,
            f"calls per pod (one {BIG_WORLD}-pod gang restart, failure -> new generation runs)",
            target="<= 4 per pod",
            passed=None if per_pod is None else per_pod <= 4,
        ),
        Row(
            "operator_api_calls_per_restart_total",
            f.get("operator_api_calls_per_restart_total"),
            "calls for the whole gang restart",
        ),
        _latency_row(f, "operator_report_to_cr", "p50", None),
        _latency_row(f, "operator_report_to_cr", "p99", 1.0),
        _latency_row(f, "operator_report_to_cr_stress", "p99", None),
        Row(
            "operator_rss_bytes",
            rss,
            "bytes (whole process: operator + emulated API + cluster sim + bench imports incl. torch)",
            None if rss is None else rss / MiB,
            "MiB",
        ),
        Row(
            "operator_rss_delta_bytes",
            delta,
            f"bytes (after {f.get('operator_watched_jobs', '?')} jobs watched minus before the operator: "
            "operator + emulator's objects/log)",
            None if delta is None else delta / MiB,
            "MiB",
        ),
    ]
