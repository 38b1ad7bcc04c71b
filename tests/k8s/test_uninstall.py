"""`helm uninstall`'s pre-delete hook, as the chart renders it, against the emulated API.

The emulator has no admission chain, so :func:`create_pod` plays the apiserver's part: a pod whose
labels a stored MutatingWebhookConfiguration selects goes through the operator's real mutating webhook
(gate only: no injection settings) before it is created. That is what left pods gated forever: the
hook lifted the gates, and until Helm deleted the configuration after it, new pods were still gated
for an operator that was going away.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonpatch
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from sidecar.operator import reports, uninstall, webhook
from sidecar.operator.kube import Api
from sidecar.operator.names import GANG_GATE, OPT_IN_LABEL, OPT_IN_VALUE
from tests.k8s.cluster import create
from tests.k8s.conftest import K8s, call
from tests.k8s.test_webhook import Webhook, job_pod, tls_files

pytestmark = [pytest.mark.timeout(60)]

CHART = Path(__file__).resolve().parents[2] / "charts" / "strata"
RELEASE, NAMESPACE = "strata", "strata-system"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
PODS = "/api/v1/namespaces/ml/pods"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest_asyncio.fixture
async def hook(tmp_path: Path) -> AsyncIterator[Webhook]:
    """The operator's webhooks without injection settings: the mutating one adds the gang gate only."""
    cert, key, client = tls_files(tmp_path)
    app = web.Application()
    webhook.add_routes(app, None)
    server = await reports.start_server(app, "127.0.0.1", 0, reports.server_ssl_context(str(cert), str(key)))
    try:
        yield Webhook(f"https://localhost:{server.port}", client)
    finally:
        await server.close()


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the chart's objectSelector uses
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


async def create_pod(k8s: K8s, hook: Webhook, name: str) -> dict[str, Any]:
    """Create an opted-in Job pod as the apiserver would: through every stored mutating webhook that
    selects it (CREATE of pods), then stored."""
    pod = job_pod()
    pod["metadata"]["name"] = name
    status, listing = await call(k8s, "GET", f"{ADMISSION}/mutatingwebhookconfigurations")
    assert status == 200, listing
    for config in listing.get("items") or []:
        for entry in config["webhooks"]:
            operations = {
                op for rule in entry["rules"] if "pods" in rule["resources"] for op in rule["operations"]
            }
            if "CREATE" in operations and _selects(
                entry.get("objectSelector") or {}, pod["metadata"]["labels"]
            ):
                assert entry["clientConfig"]["service"]["path"] == webhook.MUTATE_PATH
                _, patch = await hook.mutate(pod)
                pod = jsonpatch.apply_patch(pod, patch)
    created: dict[str, Any] = await create(k8s, PODS, pod)
    return created


async def gates(k8s: K8s, name: str) -> list[str]:
    status, body = await call(k8s, "GET", f"{PODS}/{name}")
    assert status == 200, body
    return [g["name"] for g in body["spec"].get("schedulingGates") or []]


async def install(k8s: K8s, objects: list[dict[str, Any]]) -> None:
    """The release's webhook configurations, as Helm creates them."""
    for kind, plural in (
        ("MutatingWebhookConfiguration", "mutatingwebhookconfigurations"),
        ("ValidatingWebhookConfiguration", "validatingwebhookconfigurations"),
    ):
        [config] = [o for o in objects if o["kind"] == kind]
        await create(k8s, f"{ADMISSION}/{plural}", config)


@pytest.mark.asyncio
async def test_the_pre_delete_hook_stops_the_gating_before_it_lifts_the_gates(
    k8s: K8s, hook: Webhook
) -> None:
    """The chart's hook command, run as the hook Job runs it: afterwards the gated pods are released,
    the mutating webhook configuration is gone, and a pod the Job controller creates after the hook
    (before Helm has deleted the rest of the release) is not gated. The validating configuration,
    which gates nothing, is left to Helm."""
    objects = render({"webhook": {"timeoutSeconds": 1}})
    await install(k8s, objects)
    [job] = [
        o
        for o in objects
        if o["kind"] == "Job" and o["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    ]
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["strata", "operator"]

    await create_pod(k8s, hook, "before")
    assert await gates(k8s, "before") == [GANG_GATE]  # the emulated admission path gates, as a cluster's

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.cli",
        "operator",
        *container["args"],
        "--kubeconfig",
        str(k8s.kubeconfig),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert "lifted the strata.dev/gang gate from 1 pod(s)" in out.decode()

    assert await gates(k8s, "before") == []
    status, _ = await call(k8s, "GET", f"{ADMISSION}/mutatingwebhookconfigurations/strata")
    assert status == 404
    status, _ = await call(k8s, "GET", f"{ADMISSION}/validatingwebhookconfigurations/strata")
    assert status == 200
    await create_pod(k8s, hook, "after")
    assert await gates(k8s, "after") == []


@pytest.mark.asyncio
async def test_a_pod_admitted_while_the_deletion_settles_is_released_too(k8s: K8s, hook: Webhook) -> None:
    """An admission already under way when the configuration goes still gates its pod: the gates are
    lifted only after the webhooks' timeout has passed, so that pod is released as well."""
    await install(k8s, render({}))
    api = Api.from_config(str(k8s.kubeconfig))
    try:
        lifting = asyncio.create_task(
            uninstall.uninstall(api, webhook_configurations=("strata",), settle_s=0.5)
        )
        await asyncio.sleep(0.2)  # deleted by now; an admission that began before lands only now
        status, _ = await call(k8s, "GET", f"{ADMISSION}/mutatingwebhookconfigurations/strata")
        assert status == 404 and not lifting.done()
        late = job_pod()
        late["metadata"]["name"] = "late"
        late["spec"]["schedulingGates"] = [{"name": GANG_GATE}]
        await create(k8s, PODS, late)
        released = await asyncio.wait_for(lifting, 10)
    finally:
        await api.close()
    assert released == ["ml/late"]
    assert await gates(k8s, "late") == []
    # nothing to delete (already gone, or never named): no wait
    api = Api.from_config(str(k8s.kubeconfig))
    try:
        assert await asyncio.wait_for(uninstall.uninstall(api, webhook_configurations=("strata",)), 2) == []
    finally:
        await api.close()


def test_the_hook_pods_opt_in_label_is_what_the_webhook_selects() -> None:
    """The emulated admission above selects by the chart's objectSelector: it must be the opt-in label."""
    [config] = [o for o in render({}) if o["kind"] == "MutatingWebhookConfiguration"]
    [entry] = [w for w in config["webhooks"] if (w.get("rules") or [{}])[0].get("resources") == ["pods"]]
    assert entry["objectSelector"] == {"matchLabels": {OPT_IN_LABEL: OPT_IN_VALUE}}
