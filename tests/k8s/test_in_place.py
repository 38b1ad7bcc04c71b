"""In-place gang restart and peer redundancy on Kubernetes: what the webhook injects (the trainer's
container restart rule with --in-place-restart, the sidecar's peer port and members with
strata.dev/redundancy), and the controller's in-place restart through heartbeat answers, its
acknowledgements and its fallbacks to new pods."""

from __future__ import annotations

import copy
import json
import logging
import ssl
import time
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from sidecar.api import EXIT_RESTART_IN_PLACE
from sidecar.operator import admission, names
from sidecar.operator import inject as injection
from sidecar.operator.kube import Api, parse_version
from sidecar.operator.reports import CheckpointWriter
from sidecar.reporting import Reporter
from tests.k8s.cluster import Cluster, indexed_job
from tests.k8s.conftest import K8s, call
from tests.k8s.test_operator import (
    assert_valid,
    cluster,  # noqa: F401  (fixture)
    heartbeat,
    operator,
    running,
    start_job,
    status_of,
    until,
)
from tests.k8s.test_webhook import CONFIG, Webhook, job_pod, jobset_pod

IN_PLACE = injection.InjectConfig(**{**CONFIG.__dict__, "in_place_restart": True})


def patched(pod: dict[str, Any], config: injection.InjectConfig, shape: injection.Shape | None = None) -> Any:
    ops = injection.inject(pod, namespace="ml", config=config, shape=shape)
    return jsonpatch.apply_patch(pod, ops), ops


# ---- the webhook ---------------------------------------------------------------------------------


def test_the_restart_rule_is_injected_only_with_the_switch_on() -> None:
    plain, _ = patched(job_pod(), CONFIG)
    assert "restartPolicyRules" not in plain["spec"]["containers"][0]
    pod, _ = patched(job_pod(), IN_PLACE)
    trainer = pod["spec"]["containers"][0]
    assert trainer["restartPolicy"] == "Never"
    assert trainer["restartPolicyRules"] == [
        {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0, 75, 76]}}
    ]
    assert EXIT_RESTART_IN_PLACE not in trainer["restartPolicyRules"][0]["exitCodes"]["values"]
    for version in ("1.34", "1.35"):  # the fields exist from 1.34 (alpha, ContainerRestartRules)
        kubernetes_validate.validate(pod, version, strict=True)
    # An older apiserver refuses the pod: the operator's webhook adds the rule only from 1.34 (below).
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, "1.33", strict=True)
    assert injection.inject(pod, namespace="ml", config=IN_PLACE) == []  # idempotent


def test_the_restart_rule_skips_jobset_pods_other_containers_and_user_rules() -> None:
    pod, _ = patched(jobset_pod(), IN_PLACE)  # JobSet restarts its gang itself
    assert "restartPolicyRules" not in pod["spec"]["containers"][0]
    two = job_pod()
    two["spec"]["containers"].append({"name": "logs", "image": "fluent:1"})
    only = injection.InjectConfig(**{**IN_PLACE.__dict__, "trainer_container": "trainer"})
    pod, _ = patched(two, only)
    assert "restartPolicyRules" in pod["spec"]["containers"][0]
    assert "restartPolicyRules" not in pod["spec"]["containers"][1]
    own = job_pod()
    own["spec"]["containers"][0]["restartPolicy"] = "Never"
    own["spec"]["containers"][0]["restartPolicyRules"] = [
        {"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}
    ]
    pod, _ = patched(own, IN_PLACE)
    assert pod["spec"]["containers"][0]["restartPolicyRules"][0]["exitCodes"]["values"] == [42]


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "need container restart rules" in r.getMessage()]


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_the_operators_webhook_adds_the_restart_rule_only_from_kubernetes_1_34(
    k8s: K8s, caplog: pytest.LogCaptureFixture
) -> None:
    """Before 1.34 the apiserver refuses a regular container's restartPolicy, and the Job controller
    would retry the pod forever: the webhook reads the server's version and adds no rule there,
    says so once, and adds it after an upgrade of the control plane."""
    caplog.set_level(logging.INFO, logger="strata.operator")
    k8s.api.server_version, k8s.api.validate_pods = "1.33", True
    refused, _ = patched(job_pod(), IN_PLACE)  # what the webhook added before
    status, body = await call(k8s, "POST", "/api/v1/namespaces/ml/pods", refused)
    assert status == 422 and "restartPolicyRules" in json.dumps(body), body
    async with operator(k8s, in_place_restart=True, inject=IN_PLACE, version_check_s=0.1) as op:
        hook = Webhook(op.report_url, ssl.create_default_context())
        pod = job_pod()
        _, patch = await hook.mutate(pod)
        out = jsonpatch.apply_patch(pod, patch)
        assert out["spec"]["initContainers"][0]["name"] == "strata-sidecar"  # the rest is injected
        assert all(
            "restartPolicy" not in c and "restartPolicyRules" not in c for c in out["spec"]["containers"]
        )
        kubernetes_validate.validate(out, "1.33", strict=True)
        status, body = await call(k8s, "POST", "/api/v1/namespaces/ml/pods", out)
        assert status in (200, 201), body
        await _settle()  # several refreshes: said once
        assert len(_said(caplog)) == 1 and "1.33" in _said(caplog)[0]
        k8s.api.server_version = "1.34"  # the control plane is upgraded

        async def with_rule() -> dict[str, Any] | None:
            out = jsonpatch.apply_patch(job_pod(), (await hook.mutate(job_pod()))[1])
            return out if "restartPolicyRules" in out["spec"]["containers"][0] else None

        out = await until(with_rule, message="the rule after the upgrade")
        assert out["spec"]["containers"][0]["restartPolicyRules"] == [injection.restart_rule()]
        kubernetes_validate.validate(out, "1.34", strict=True)
    assert len(_said(caplog)) == 1


@pytest.mark.parametrize(
    ("body", "version"),
    [
        ({"major": "1", "minor": "33+", "gitVersion": "v1.33.5-eks-1"}, (1, 33)),
        ({"major": "", "minor": "", "gitVersion": "v1.34.1+k3s1"}, (1, 34)),
        ({"message": "forbidden"}, None),
    ],
)
def test_the_servers_version_is_read_as_managed_clusters_write_it(
    body: dict[str, Any], version: tuple[int, int] | None
) -> None:
    assert parse_version(body) == version


def test_a_host_network_pod_gets_a_sidecar_that_declares_its_ports_as_host_ports() -> None:
    """Declared ports of a hostNetwork pod are hostPorts: declared (they were not, until two ranks of
    one job on one node showed why), the scheduler keeps pods with the same ports off one node. On
    the node, a job that chose no ports gets its own pair (not 9464, a node exporter's), so the
    sidecars of two jobs sharing a node do not take the same ports by default."""
    host_ports: list[list[int]] = []
    for job in ("recsys", "ranker"):
        for host_network in (True, False):
            pod = job_pod({"strata.dev/redundancy": "buddy"})
            pod["metadata"]["labels"][names.JOB_NAME_LABEL] = job
            pod["spec"]["subdomain"] = "recsys-peers"
            pod["spec"]["hostNetwork"] = host_network
            out, _ = patched(pod, CONFIG, injection.Shape(world_size=4))
            sidecar = out["spec"]["initContainers"][0]
            declared = [p["containerPort"] for p in sidecar["ports"]]
            env = {e["name"]: e.get("value") for e in sidecar["env"]}
            assert [int(env["STRATA_METRICS_PORT"]), int(env["STRATA_PEER_PORT"])] == declared
            assert sidecar["startupProbe"]["httpGet"]["port"] == declared[0]
            assert env["STRATA_MEMBERS"].endswith(f":{declared[1]}")
            if host_network:
                assert [p.get("hostPort") for p in sidecar["ports"]] == declared
                top = injection.HOST_PORT_BASE + 2 * injection.HOST_PORT_PAIRS
                assert injection.HOST_PORT_BASE <= declared[0] < top and declared[1] == declared[0] + 1
                assert declared[1] < 29400  # below torchrun's rendezvous and master ports
                host_ports.append(declared)
            else:
                assert declared == [9464, 9411]
                assert [p.get("hostPort") for p in sidecar["ports"]] == [None, None]
            kubernetes_validate.validate(out, "1.33", strict=True)
    assert host_ports[0] != host_ports[1], "two jobs' sidecars take the same node ports by default"


def test_redundancy_wires_the_peer_port_and_the_members_of_an_indexed_job() -> None:
    pod = job_pod({"strata.dev/redundancy": "buddy"})
    pod["spec"]["subdomain"] = "recsys-peers"
    out, _ = patched(pod, CONFIG, injection.Shape(world_size=4))
    sidecar = out["spec"]["initContainers"][0]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["STRATA_PEER_PORT"] == "9411" and env["STRATA_PEER_HOST"] == "0.0.0.0"
    assert env["STRATA_MEMBERS"] == "recsys-{index}.recsys-peers:9411"
    assert env["STRATA_MEMBER_COUNT"] == "4" and env["STRATA_REDUNDANCY"] == "buddy"
    assert {"name": "strata-peer", "containerPort": 9411, "protocol": "TCP"} in sidecar["ports"]
    kubernetes_validate.validate(out, "1.33", strict=True)
    without = job_pod({"strata.dev/redundancy": "parity"})
    with pytest.raises(injection.Denied, match="subdomain"):
        injection.inject(without, namespace="ml", config=CONFIG, shape=injection.Shape(world_size=4))
    plain, _ = patched(job_pod(), CONFIG, injection.Shape(world_size=4))
    assert "STRATA_PEER_PORT" not in {e["name"] for e in plain["spec"]["initContainers"][0]["env"]}


def test_redundancy_members_of_a_jobset_are_its_pods_hostnames_in_rank_order() -> None:
    workload = {
        "kind": "JobSet",
        "metadata": {"name": "ranker"},
        "spec": {
            "replicatedJobs": [
                {"name": "driver", "replicas": 1, "template": {"spec": {"completions": 1}}},
                {"name": "workers", "replicas": 2, "template": {"spec": {"completions": 2}}},
            ]
        },
    }
    pod = jobset_pod()
    pod["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] = "1"
    pod["metadata"]["annotations"]["strata.dev/redundancy"] = "buddy"
    pod["spec"]["subdomain"] = "ranker"  # JobSet's default with DNS hostnames enabled
    shape = injection.workload_shape(workload, pod)
    assert shape.rank == 4
    out, _ = patched(pod, CONFIG, shape)
    env = {e["name"]: e.get("value") for e in out["spec"]["initContainers"][0]["env"]}
    members = env["STRATA_MEMBERS"].split(",")
    assert members == [
        "ranker-driver-0-0.ranker:9411",
        "ranker-workers-0-0.ranker:9411",
        "ranker-workers-0-1.ranker:9411",
        "ranker-workers-1-0.ranker:9411",
        "ranker-workers-1-1.ranker:9411",
    ]
    assert members[shape.rank] == "ranker-workers-1-1.ranker:9411" and env["STRATA_MEMBER_COUNT"] == "5"


def test_the_validating_webhook_warns_without_a_subdomain_and_the_memory_warning_counts_the_copy() -> None:
    job = indexed_job("recsys", 2, annotations={"strata.dev/redundancy": "buddy"})
    verdict = admission.validate_workload(job)
    assert verdict.allowed and any("subdomain" in w for w in verdict.warnings)
    job["spec"]["template"]["spec"]["subdomain"] = "recsys"
    assert not any("subdomain" in w for w in admission.validate_workload(job).warnings)
    pod = job_pod({"strata.dev/redundancy": "buddy", names.SIDECAR_MEMORY_ANNOTATION: "512Mi"})
    pod["spec"]["subdomain"] = "recsys"
    said = injection.warnings(pod, namespace="ml", config=CONFIG)
    assert any("redundancy=buddy" in w and names.SIDECAR_MEMORY_ANNOTATION in w for w in said)
    pod["metadata"]["annotations"][names.SIDECAR_MEMORY_ANNOTATION] = "8Gi"
    assert not any("redundancy" in w for w in injection.warnings(pod, namespace="ml", config=CONFIG))


# ---- the controller -----------------------------------------------------------------------------


def in_place_job(name: str, world: int) -> dict[str, Any]:
    """A Job whose pods carry the restart rule, as the webhook injects it with --in-place-restart."""
    job = indexed_job(name, world, annotations={"strata.dev/backoff-seconds": "0"})
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer.update(restartPolicy="Never", restartPolicyRules=[injection.restart_rule()])
    return job


async def crash_in_place(k8s: K8s, pod: dict[str, Any], code: int = 1) -> None:
    """The trainer exits ``code`` and its restart rule restarts it: the pod stays Running."""
    meta = pod["metadata"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    statuses = [
        {
            "name": "trainer",
            "ready": True,
            "restartCount": 1,
            "state": {"running": {"startedAt": now}},
            "lastState": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": now}},
        }
    ]
    status, body = await call(
        k8s,
        "PATCH",
        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
        {"status": {"phase": "Running", "containerStatuses": statuses}},
    )
    assert status == 200, body


def beat(job: str, generation: str, rank: int, restart: str | None = None) -> dict[str, Any]:
    item = heartbeat(job, generation, rank, 100, 1)
    if restart is not None:
        item["restart_generation"] = restart
    return item


async def instructed(k8s: K8s, name: str) -> dict[str, Any] | None:
    pending = (await status_of(k8s, name)).get("pendingRestart") or {}
    return pending if pending.get("instructedAt") else None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_trainer_crash_restarts_the_gang_in_place_through_heartbeat_answers(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, in_place_restart=True, in_place_timeout_s=30.0) as op:
        run, pods = await start_job(k8s, cluster, in_place_job("inplace", 2))
        names_before = sorted(p["metadata"]["name"] for p in pods)
        await crash_in_place(k8s, pods[1])
        pending = await until(lambda: instructed(k8s, "inplace"), message="the in-place instruction")
        assert pending["mode"] == "in-place" and pending["generation"] == f"{run}/1"
        answer = await op.controller.on_heartbeat(beat("inplace", f"{run}/0", 0), pods[0]["metadata"]["name"])
        assert answer == {
            "namespace": "default",
            "job": "inplace",
            "restart": {"generation": f"{run}/1", "reason": "exit-error"},
        }
        for rank in (0, 1):  # the sidecars adopted it: their heartbeats say so
            got = await op.controller.on_heartbeat(
                beat("inplace", f"{run}/0", rank, f"{run}/1"), pods[rank]["metadata"]["name"]
            )
            assert got is None
        status = await until(
            lambda: _generation(k8s, "inplace", f"{run}/1"), message="the in-place generation"
        )
        assert status["restartMode"] == "in-place" and status["restarts"] == 1
        assert status["phase"] == "Running"
        assert status["lastFailure"]["reason"] == "ExitError" and status.get("pendingRestart") is None
        assert k8s.api.evictions == []  # no pod was stopped
        now = await until(lambda: running(cluster, "inplace", f"{run}/1", 2), message="annotations follow")
        assert sorted(p["metadata"]["name"] for p in now) == names_before
        assert all(names.RESTORE_REQUEST_ANNOTATION not in p["metadata"]["annotations"] for p in now)
        await assert_valid(k8s, "inplace")
        # The crash it answered (still the trainer's lastState) and the exits with 77 are no new failure.
        await crash_in_place(k8s, pods[0], EXIT_RESTART_IN_PLACE)
        await op.controller.on_heartbeat(beat("inplace", f"{run}/1", 0), pods[0]["metadata"]["name"])
        await _settle()
        assert (await status_of(k8s, "inplace"))["generation"] == f"{run}/1"


async def _generation(k8s: K8s, name: str, generation: str) -> dict[str, Any] | None:
    status = await status_of(k8s, name)
    return status if status.get("generation") == generation else None


async def _settle() -> None:
    import asyncio

    await asyncio.sleep(1.0)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_an_evicted_pod_restarts_the_gang_with_new_pods_and_no_instruction(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, in_place_restart=True) as op:
        run, pods = await start_job(k8s, cluster, in_place_job("evicted", 2))
        await cluster.kubelet_evict(pods[1])
        await until(lambda: running(cluster, "evicted", f"{run}/1", 2), message="generation 1 with new pods")
        status = await status_of(k8s, "evicted")
        assert status["restartMode"] == "pod" and status["lastFailure"]["reason"] == "Evicted"
        answer = await op.controller.on_heartbeat(beat("evicted", f"{run}/0", 0), pods[0]["metadata"]["name"])
        assert answer is None


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_without_acknowledgements_the_in_place_restart_falls_back_to_new_pods(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, in_place_restart=True, in_place_timeout_s=1.5):
        run, pods = await start_job(k8s, cluster, in_place_job("silent", 2))
        await crash_in_place(k8s, pods[1])
        await until(lambda: instructed(k8s, "silent"), message="the in-place instruction")
        # No sidecar answers: the next generation number, as new pods (the in-place one is fenced off).
        await until(lambda: running(cluster, "silent", f"{run}/2", 2), message="the fallback generation")
        status = await status_of(k8s, "silent")
        assert status["restartMode"] == "pod" and status["restarts"] == 1
        assert set(k8s.api.evictions) == {p["metadata"]["name"] for p in pods}
        await assert_valid(k8s, "silent")


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_before_kubernetes_1_34_the_gang_of_injected_pods_restarts_with_new_pods(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    """With --in-place-restart on a 1.33 server the Job's pods are created (the webhook added no
    rule) and a trainer crash restarts the gang with new pods, the Event naming why."""
    k8s.api.server_version, k8s.api.validate_pods = "1.33", True
    async with operator(k8s, in_place_restart=True, inject=IN_PLACE) as op:
        hook = Webhook(op.report_url, ssl.create_default_context())

        async def admit(pod: dict[str, Any]) -> list[dict[str, Any]]:
            return (await hook.mutate(pod))[1]

        cluster.admit = admit
        job = indexed_job("old", 2, annotations={"strata.dev/backoff-seconds": "0"})
        run, pods = await start_job(k8s, cluster, job)
        assert all(p["spec"]["initContainers"][0]["name"] == "strata-sidecar" for p in pods)
        assert all("restartPolicyRules" not in c for p in pods for c in p["spec"]["containers"])
        await crash_in_place(k8s, pods[1])
        await until(lambda: running(cluster, "old", f"{run}/2", 2), message="new pods")
        status = await status_of(k8s, "old")
        assert status["restartMode"] == "pod" and status["restarts"] == 1
        _, events = await call(k8s, "GET", "/api/v1/namespaces/default/events")
        fallback = [e["message"] for e in events["items"] if e["reason"] == "InPlaceRestartFallback"]
        assert len(fallback) == 1 and "before 1.34" in fallback[0], fallback


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_switch_off_or_no_restart_rule_means_new_pods(
    k8s: K8s,
    cluster: Cluster,  # noqa: F811
) -> None:
    async with operator(k8s, in_place_restart=True):
        job = indexed_job("norule", 2, annotations={"strata.dev/backoff-seconds": "0"})  # gate off: no rule
        run, pods = await start_job(k8s, cluster, job)
        await crash_in_place(k8s, pods[1])
        await until(lambda: running(cluster, "norule", f"{run}/2", 2), message="new pods")
        status = await status_of(k8s, "norule")
        assert status["restartMode"] == "pod" and status["restarts"] == 1


# ---- the report endpoint and the sidecar's reporter ----------------------------------------------


@pytest.mark.asyncio
async def test_the_writer_returns_the_heartbeats_instruction_and_records_the_restore_source(k8s: K8s) -> None:
    from tests.k8s.test_crds import install_crds

    await install_crds(k8s)
    api = Api.from_config(str(k8s.kubeconfig))
    told = {"namespace": "default", "job": "j", "restart": {"generation": "r/1", "reason": "hang"}}
    try:
        writer = CheckpointWriter(api, on_heartbeat=lambda item, pod: copy.deepcopy(told))
        item = {**heartbeat("j", "r/0", 0, 5, 1), "restore_source": "peer", "restored_step": 5}
        assert await writer.write(item, "j-0") == told
        bad = {**item, "restore_source": "tape"}
        with pytest.raises(Exception, match="restore_source"):
            await writer.write(bad, "j-0")
    finally:
        await api.close()


def test_the_reporter_hands_the_answers_instructions_to_its_callback() -> None:
    from prometheus_client import CollectorRegistry

    got: list[dict[str, Any]] = []
    reporter = Reporter("", CollectorRegistry(), on_instruction=got.append)
    told = {"namespace": "default", "job": "j", "restart": {"generation": "r/1", "reason": "hang"}}
    answer = {"accepted": 1, "rejected": [], "instructions": [told, "junk"]}
    reporter._accepted([{"kind": "heartbeat"}], json.dumps(answer).encode())
    assert got == [told]
    reporter._accepted([{"kind": "heartbeat"}], json.dumps({"accepted": 1, "rejected": []}).encode())
    assert got == [told]


def test_the_memory_warning_reads_a_memory_budget_written_with_units() -> None:
    pod = job_pod({"strata.dev/redundancy": "buddy", names.SIDECAR_MEMORY_ANNOTATION: "8Gi"})
    pod["spec"]["subdomain"] = "recsys"
    assert not any("redundancy" in w for w in injection.warnings(pod, namespace="ml", config=CONFIG))
    pod["metadata"]["annotations"]["strata.dev/memory-budget"] = "64Mi"  # below the copy it holds
    said = injection.warnings(pod, namespace="ml", config=CONFIG)
    assert any("redundancy=buddy" in w and "budget" in w for w in said), said
