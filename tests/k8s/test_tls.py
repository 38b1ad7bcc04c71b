"""The operator-managed CA against the emulated API, over real HTTPS: the Secret is created once and
shared by replicas, both webhook configurations get its caBundle (and get it back after an upgrade
blanks it), injected pods carry it, a rotation reaches new handshakes without a restart, and two
replicas racing on a rotation converge on one Secret."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import json
import os
import ssl
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509

from sidecar.operator import certs
from sidecar.operator.inject import InjectConfig
from sidecar.operator.kube import Api
from sidecar.operator.names import (
    JOB_INDEX_LABEL,
    JOB_NAME_LABEL,
    OPT_IN_LABEL,
    OPT_IN_VALUE,
    REPORT_CA_ANNOTATION,
)
from sidecar.operator.run import OperatorConfig, serve
from tests.k8s.conftest import K8s, call

pytestmark = [pytest.mark.timeout(60)]

NS = "strata-system"
SECRET = f"/api/v1/namespaces/{NS}/secrets/strata-tls"
#: The certificate is for Service "localhost" so a client on this machine verifies the real name.
SERVICE = "localhost"
CONFIGURATIONS = {
    "mutatingwebhookconfigurations": ["inject.strata.dev"],
    "validatingwebhookconfigurations": ["validate-jobs.strata.dev", "validate-jobsets.strata.dev"],
}


async def seed_webhook_configurations(k8s: K8s) -> None:
    """As the chart installs them on a first install: no caBundle yet."""
    for plural, hooks in CONFIGURATIONS.items():
        kind = (
            "MutatingWebhookConfiguration"
            if plural.startswith("mutating")
            else "ValidatingWebhookConfiguration"
        )
        body = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": "strata"},
            "webhooks": [
                {
                    "name": name,
                    "clientConfig": {
                        "service": {"name": SERVICE, "namespace": NS, "path": "/x", "port": 8443}
                    },
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                }
                for name in hooks
            ],
        }
        status, answer = await call(k8s, "POST", f"/apis/admissionregistration.k8s.io/v1/{plural}", body)
        assert status in (200, 201), answer


async def ca_bundles(k8s: K8s) -> list[str | None]:
    out = []
    for plural in CONFIGURATIONS:
        _, found = await call(k8s, "GET", f"/apis/admissionregistration.k8s.io/v1/{plural}/strata")
        out += [h["clientConfig"].get("caBundle") for h in found["webhooks"]]
    return out


async def secret_data(k8s: K8s) -> dict[str, bytes]:
    status, found = await call(k8s, "GET", SECRET)
    assert status == 200, found
    return {k: base64.b64decode(v) for k, v in found["data"].items()}


def client_context(bundle: bytes) -> ssl.SSLContext:
    """What a sidecar builds from its CA file (sidecar/reporting.py), or the apiserver from caBundle."""
    return ssl.create_default_context(cadata=bundle.decode())


async def served_certificate(url: str, bundle: bytes) -> bytes:
    """The PEM certificate a fresh handshake presents, verified against ``bundle`` (raises if not)."""
    host, port = url.removeprefix("https://").split(":")
    _, writer = await asyncio.open_connection(
        host, int(port), ssl=client_context(bundle), server_hostname=SERVICE
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        await writer.wait_closed()
    return x509.load_der_x509_certificate(der).public_bytes(certs.serialization.Encoding.PEM)


def config(k8s: K8s, **overrides: Any) -> OperatorConfig:
    base: dict[str, Any] = {
        "kubeconfig": str(k8s.kubeconfig),
        "report_host": "127.0.0.1",
        "report_port": 0,
        "tls_secret": "strata-tls",
        "tls_namespace": NS,
        "tls_service": SERVICE,
        "webhook_configurations": ("strata",),
        "inject": InjectConfig(image="strata:1", storage_uri="s3://ckpt/jobs", own_namespace=NS),
    }
    return OperatorConfig(**{**base, **overrides})


def job_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "recsys-0-",
            "namespace": "ml",
            "labels": {OPT_IN_LABEL: OPT_IN_VALUE, JOB_NAME_LABEL: "recsys", JOB_INDEX_LABEL: "0"},
        },
        "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": "t:1"}]},
    }


@pytest.mark.asyncio
async def test_the_operator_creates_serves_and_publishes_its_ca(k8s: K8s, tmp_path: Path) -> None:
    await seed_webhook_configurations(k8s)
    async with serve(config(k8s, metrics_port=0)) as operator:
        assert operator.report_url is not None and operator.report_url.startswith("https://")
        url = operator.report_url.replace("127.0.0.1", SERVICE)
        data = await secret_data(k8s)
        assert set(data) == {"tls.crt", "tls.key", "ca.crt", "ca.key", "signing-ca.crt"}
        # every webhook of both configurations trusts the Secret's bundle
        assert await ca_bundles(k8s) == [base64.b64encode(data["ca.crt"]).decode()] * 3
        # the served certificate is the Secret's, verified by its bundle for the Service's name
        assert await served_certificate(url, data["ca.crt"]) == data["tls.crt"]
        with pytest.raises(ssl.SSLCertVerificationError):
            await served_certificate(
                url, certs.plan(None, names=["x"], now=dt.datetime.now(dt.UTC))[0].bundle
            )
        # an injected pod carries the bundle, and its sidecar's CA file (the downward-API projection of
        # that annotation) verifies the endpoint, as sidecar/reporting.py does
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "namespace": "ml",
                "operation": "CREATE",
                "object": job_pod(),
            },
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{url}/mutate-pods", json=review, ssl=client_context(data["ca.crt"])
            ) as response:
                answer = await response.json()
            ops = json.loads(base64.b64decode(answer["response"]["patch"]))
            [annotation] = [op for op in ops if op["path"] == "/metadata/annotations"]
            ca_file = tmp_path / "report-ca"
            ca_file.write_text(annotation["value"][REPORT_CA_ANNOTATION])
            async with session.get(
                f"{url}/healthz", ssl=ssl.create_default_context(cafile=str(ca_file))
            ) as response:
                assert response.status == 200
        expiry = operator.metrics.registry.get_sample_value(
            "strata_operator_tls_certificate_expiry_timestamp_seconds"
        )
        leaf = x509.load_pem_x509_certificate(data["tls.crt"])
        assert expiry == leaf.not_valid_after_utc.timestamp()
        created = operator.metrics.registry.get_sample_value(
            "strata_operator_tls_changes_total", {"kind": "created"}
        )
        assert created == 1
    # a second start (a new replica, a restarted pod) serves the same Secret and writes nothing
    version = (await call(k8s, "GET", SECRET))[1]["metadata"]["resourceVersion"]
    async with serve(config(k8s)) as operator:
        assert operator.report_url is not None
        url = operator.report_url.replace("127.0.0.1", SERVICE)
        assert await served_certificate(url, data["ca.crt"]) == data["tls.crt"]
    assert (await call(k8s, "GET", SECRET))[1]["metadata"]["resourceVersion"] == version


@pytest.mark.asyncio
async def test_a_rotation_reaches_new_handshakes_and_a_blanked_ca_bundle_comes_back(k8s: K8s) -> None:
    await seed_webhook_configurations(k8s)
    # A Secret written 200 days ago: its 365-day certificate still has 45% of its life (renewal: 33%)
    aged, _ = certs.plan(
        None, names=certs.dns_names(SERVICE, NS), now=dt.datetime.now(dt.UTC) - dt.timedelta(days=200)
    )
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "strata-tls"}, "data": aged.to_data()}
    assert (await call(k8s, "POST", f"/api/v1/namespaces/{NS}/secrets", body))[0] in (200, 201)
    async with serve(config(k8s)) as operator:
        assert operator.report_url is not None and isinstance(operator.tls, certs.SecretTls)
        url = operator.report_url.replace("127.0.0.1", SERVICE)
        assert await served_certificate(url, aged.bundle) == aged.serving.cert  # adopted, not replaced
        # `helm upgrade` rendering without lookup (or a hand edit) blanks a caBundle
        status, answer = await call(
            k8s,
            "PATCH",
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/strata",
            [{"op": "remove", "path": "/webhooks/1/clientConfig/caBundle"}],
            headers={"Content-Type": "application/json-patch+json"},
        )
        assert status == 200, answer
        # renewal due (as it will be in 67 days): the next reconcile renews, the CA stays
        operator.tls.policy = dataclasses.replace(operator.tls.policy, renew_fraction=0.5)
        changes = await operator.tls.reconcile()
        assert [c.kind for c in changes] == ["renewed"]
        after = await secret_data(k8s)
        assert after["tls.crt"] != aged.serving.cert and after["ca.crt"] == aged.bundle
        # no restart: the next handshake presents the new certificate, verified by the old bundle
        assert await served_certificate(url, aged.bundle) == after["tls.crt"]
        assert await ca_bundles(k8s) == [base64.b64encode(after["ca.crt"]).decode()] * 3


@pytest.mark.asyncio
async def test_replicas_racing_on_a_rotation_converge_on_one_secret(k8s: K8s) -> None:
    """Replica B read the Secret before replica A rotated it; B's write is refused (409, stale
    resourceVersion), it reads again and adopts A's certificate instead of writing its own."""
    await seed_webhook_configurations(k8s)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=300)
    api_a, api_b = Api.from_config(str(k8s.kubeconfig)), Api.from_config(str(k8s.kubeconfig))
    try:
        first = certs.SecretTls(api_a, namespace=NS, secret="strata-tls", service=SERVICE)
        await first.reconcile()
        a = certs.SecretTls(api_a, namespace=NS, secret="strata-tls", service=SERVICE, clock=lambda: later)
        b = certs.SecretTls(api_b, namespace=NS, secret="strata-tls", service=SERVICE, clock=lambda: later)
        stale = await api_b.get(SECRET)
        real_get = api_b.get
        reads = []

        async def get_once_stale(url: str) -> dict[str, Any] | None:
            reads.append(url)
            return stale if url == SECRET and len(reads) == 1 else await real_get(url)

        api_b.get = get_once_stale  # type: ignore[method-assign]
        assert [c.kind for c in await a.reconcile()] == ["renewed"]
        assert await b.reconcile() == []  # refused, re-read, nothing left to do
        assert a.state is not None and b.state == a.state
        held = await secret_data(k8s)
        assert held["tls.crt"] == a.state.serving.cert
        assert reads.count(SECRET) == 2
    finally:
        await api_a.close()
        await api_b.close()


@pytest.mark.asyncio
async def test_an_unreadable_secret_is_replaced_and_the_chart_created_empty_one_filled(k8s: K8s) -> None:
    status, _ = await call(
        k8s,
        "POST",
        f"/api/v1/namespaces/{NS}/secrets",
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": "strata-tls", "namespace": NS},
        },
    )
    assert status in (200, 201)
    api = Api.from_config(str(k8s.kubeconfig))
    try:
        managed = certs.SecretTls(api, namespace=NS, secret="strata-tls", service=SERVICE)
        assert [c.kind for c in await managed.reconcile()] == ["created"]
        assert set(await secret_data(k8s)) >= {"tls.crt", "ca.crt"}
        # a hand edit leaves garbage: a new CA, and the stale keys are removed
        await call(
            k8s,
            "PATCH",
            SECRET,
            {"data": {"ca.key": base64.b64encode(b"junk").decode(), "extra": "eA=="}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert [c.kind for c in await managed.reconcile()] == ["created"]
        data = await secret_data(k8s)
        assert "extra" not in data and certs.TlsState.from_data(
            {k: base64.b64encode(v).decode() for k, v in data.items()}
        )
    finally:
        await api.close()


@pytest.mark.asyncio
async def test_certificate_files_are_reloaded_when_the_kubelet_updates_them(tmp_path: Path) -> None:
    """cert-manager mode: the Secret is mounted; a renewed certificate reaches the next handshake."""
    from aiohttp import web

    from sidecar.operator import reports

    def write(state: certs.TlsState) -> None:
        for name, data in (
            ("tls.crt", state.serving.cert),
            ("tls.key", state.serving.key),
            ("ca.crt", state.bundle),
        ):
            (tmp_path / f"{name}.new").write_bytes(data)
            (tmp_path / f"{name}.new").replace(tmp_path / name)  # atomically, as the kubelet swaps

    now = dt.datetime.now(dt.UTC)
    first, _ = certs.plan(None, names=[SERVICE], now=now)
    write(first)
    files = certs.FileTls(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    assert files.ca_pem == first.bundle.decode() and not files.reload()
    server = await reports.start_server(web.Application(), "127.0.0.1", 0, files.context)
    try:
        url = f"https://127.0.0.1:{server.port}"
        assert await served_certificate(url, first.bundle) == first.serving.cert
        eager = certs.TlsPolicy(renew_fraction=0.9999999)  # renew a certificate minutes old
        renewed, _ = certs.plan(first, names=[SERVICE], now=now, policy=eager)
        assert renewed.serving != first.serving
        write(renewed)
        os.utime(tmp_path / "tls.crt", (1, 1))  # a different mtime, even within the clock's resolution
        assert files.reload()
        assert await served_certificate(url, first.bundle) == renewed.serving.cert
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_running_pods_get_the_rotated_bundle(k8s: K8s) -> None:
    """A pod admitted with an older bundle (before a rotation, a cert-manager renewal, or by an
    earlier operator) gets the current one written into its annotation, which the kubelet projects
    into the sidecar's CA file; pods without the annotation and finished pods are left alone."""
    from tests.k8s.cluster import Cluster, indexed_job
    from tests.k8s.test_crds import install_crds
    from tests.k8s.test_operator import start_job

    await seed_webhook_configurations(k8s)
    await install_crds(k8s)
    async with (
        Cluster(k8s, termination_s=2.0).running() as cluster,
        serve(config(k8s, inject=None, fence_margin_s=1.0, tls_check_s=0.2)) as operator,
    ):
        assert isinstance(operator.tls, certs.SecretTls)
        _, pods = await start_job(k8s, cluster, indexed_job("rotated", 2))
        stale, plain = (p["metadata"]["name"] for p in pods)
        old = "-----BEGIN CERTIFICATE-----\nb2xk\n-----END CERTIFICATE-----\n"
        status, answer = await call(
            k8s,
            "PATCH",
            f"/api/v1/namespaces/default/pods/{stale}",
            {"metadata": {"annotations": {REPORT_CA_ANNOTATION: old}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert status == 200, answer

        async def annotation(name: str) -> str | None:
            _, pod = await call(k8s, "GET", f"/api/v1/namespaces/default/pods/{name}")
            return (pod["metadata"].get("annotations") or {}).get(REPORT_CA_ANNOTATION)

        for _ in range(100):
            if await annotation(stale) == operator.tls.ca_pem:
                break
            await asyncio.sleep(0.1)
        assert await annotation(stale) == operator.tls.ca_pem
        assert await annotation(plain) is None  # never injected with a CA: not ours to add
