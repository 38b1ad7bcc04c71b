"""The Helm chart charts/strata, rendered by Helm's own engine (helm-python-sdk, no helm binary, no cluster).

Every rendered built-in object is checked against the Kubernetes 1.29 and 1.33 schemas (strict: unknown
fields fail); custom resources (Prometheus Operator, cert-manager, kopf peering) are checked for
apiVersion and kind only. The RBAC rules are compared with the least-privilege list below: a new verb
fails this test until it is justified here and in charts/strata/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.images import IMAGE

CHART = Path(__file__).resolve().parents[2] / "charts" / "strata"
NAMESPACE = "strata-system"
RELEASE = "strata"
KUBE_VERSIONS = ("1.29.0", "1.33.0")

#: Custom resources the chart may render (not validated against the built-in schemas).
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}
#: kopf's peering objects (operator.peering; their CRDs are in charts/strata/crds).
PEERING_KINDS = {("kopf.dev/v1", "ClusterKopfPeering"), ("kopf.dev/v1", "KopfPeering")}

ALL_ON: dict[str, Any] = {
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    }
}
MATRIX: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cert-manager": {"tls": {"certManager": {"enabled": True}}},
    "cert-manager-issuer": {
        "tls": {"certManager": {"enabled": True, "issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}
    },
    "monitors-on": ALL_ON,
    "cert-manager-and-monitors": {**ALL_ON, "tls": {"certManager": {"enabled": True}}},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"], **ALL_ON},
    "peering": {"operator": {"peering": "strata"}},
    "namespaced-peering": {"watchNamespaces": ["team-a"], "operator": {"peering": "strata"}},
    "no-networkpolicy": {"networkPolicy": {"enabled": False}},
    "in-place-and-peers": {
        "operator": {"inPlaceRestart": True, "inPlaceTimeoutSeconds": 90},
        "networkPolicy": {"peers": {"enabled": True, "namespaces": ["ml"]}},
    },
    "namespaced-peers": {
        "watchNamespaces": ["team-a", "team-b"],
        "networkPolicy": {"peers": {"enabled": True}},
    },
    # OpenShift's restricted-v2 SCC assigns the user (and fsGroup) from the namespace's range
    "openshift": {
        "storage": {"uri": "s3://ckpt/jobs"},
        "operator": {"runAsUser": None},
        "sidecar": {"runAsUser": None},
    },
    "restricted-metrics": {
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        "storage": {"uri": "s3://ckpt/jobs", "endpoint": "http://seaweedfs.storage:8333"},
        "operator": {"trainerContainer": "trainer", "fenceMarginSeconds": 60},
        "imagePullSecrets": ["regcred"],
    },
}

# The least-privilege rules, each with its reason (charts/strata/README.md, "RBAC", says the same).
WORKLOAD_RULES = {
    # watch opted-in pods; get: a report's pod must exist; patch: lift the gate, write the generation;
    # delete: fallback when an eviction is refused (PDB), and fencing of pods stuck Terminating
    ("", "pods"): {"get", "list", "watch", "patch", "delete"},
    # DisruptionTarget before a fallback delete, so podFailurePolicy ignores that pod
    ("", "pods/status"): {"patch"},
    # stop the old gang at a gang restart
    ("", "pods/eviction"): {"create"},
    # GangRestart, GangReleased, PodFenced, ... and kopf's handler events
    ("", "events"): {"create"},
    # watch opted-in workloads, never change them
    ("batch", "jobs"): {"get", "list", "watch"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch"},
    # one StrataJob per workload; list and delete: the retention sweep
    ("strata.dev", "stratajobs"): {"get", "list", "create", "patch", "delete"},
    ("strata.dev", "stratajobs/status"): {"patch"},
    # Checkpoint objects from commit and retention reports
    ("strata.dev", "checkpoints"): {"get", "list", "create", "patch", "delete"},
    ("strata.dev", "checkpoints/status"): {"patch"},
}
CLUSTER_RULES = {
    # verify the projected token of every sidecar report
    ("authentication.k8s.io", "tokenreviews"): {"create"},
    # kopf: runtime observation of CRDs
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
# No namespaces rule in either mode: cluster-wide kopf never lists namespaces; namespaced, it tries (for
# namespace patterns), and on 403 warns and serves the names given, exact names here.
#: Without cert-manager: keep caBundle of this release's webhook configurations (and no others) current.
TLS_CLUSTER_RULES = {
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "strata"): {"get", "patch"},
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "strata"): {"get", "patch"},
}
#: ...and read and write the CA Secret (created by the chart), in the release namespace only.
#: get/patch its own Secret by name; create where it is missing (RBAC cannot limit create by name)
TLS_SECRET_RULES = {("", "secrets", "strata-tls"): {"get", "patch"}, ("", "secrets"): {"create"}}
#: kopf peering: watch every peering object (no field selector, so no resourceNames), patch its own
#: (keep-alives, dead peers' entries removed); never get. Namespaced mode: in every watched namespace.
CLUSTER_PEERING_RULES = {
    ("kopf.dev", "clusterkopfpeerings"): {"list", "watch"},
    ("kopf.dev", "clusterkopfpeerings", "strata"): {"patch"},
}
NAMESPACED_PEERING_RULES = {
    ("kopf.dev", "kopfpeerings"): {"list", "watch"},
    ("kopf.dev", "kopfpeerings", "strata"): {"patch"},
}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


_RENDERED: dict[str, list[dict[str, Any]]] = {}
_VALIDATED: set[str] = set()


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Render like `helm install` would, and parse every manifest (NOTES.txt excluded). Cached per
    values; callers do not modify the objects."""
    key = json.dumps(values or {}, sort_keys=True)
    if key not in _RENDERED:
        _RENDERED[key] = _render(chart, values)
    return _RENDERED[key]


def _render(chart: Any, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    chart.validate_schema(values or {})
    manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__path__", path)
                objects.append(doc)
    return objects


def strip(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != "__path__"}


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def installed(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The release's objects without its hooks (which Helm creates only for their moment)."""
    return [o for o in objects if "helm.sh/hook" not in (o["metadata"].get("annotations") or {})]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def rules_of(role: dict[str, Any]) -> dict[tuple[str, ...], set[str]]:
    """(group, resource) -> verbs; a rule limited to resourceNames is keyed (group, resource, names)."""
    rules: dict[tuple[str, ...], set[str]] = {}
    for rule in role.get("rules") or []:
        named = tuple(rule.get("resourceNames") or ())
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in rule["verbs"] and "*" not in resource and group != "*", rule
                rules.setdefault((group, resource, *named), set()).update(rule["verbs"])
    return rules


# --- rendering and lint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_every_built_in_object_is_valid_for_1_29_and_1_33(chart: Any, case: str) -> None:
    objects = render(chart, MATRIX[case])
    assert objects
    for obj in objects:
        api_kind = (obj["apiVersion"], obj["kind"])
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/instance") == RELEASE, (obj["__path__"], api_kind)
        assert labels.get("app.kubernetes.io/name") == "strata"
        assert labels.get("app.kubernetes.io/managed-by") == "Helm"
        assert labels.get("helm.sh/chart") == "strata-0.1.0"
        if api_kind in CUSTOM_KINDS | PEERING_KINDS:
            continue
        body = strip(obj)
        key = json.dumps(body, sort_keys=True)
        if key in _VALIDATED:  # the same object rendered by an earlier case
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(
                    f"{case}: {obj['__path__']} {obj['kind']}/{obj['metadata']['name']} for {version}: {err}"
                )
        _VALIDATED.add(key)


def test_custom_resources_only_when_enabled(chart: Any) -> None:
    kinds = {(o["apiVersion"], o["kind"]) for o in render(chart)}
    assert not kinds & CUSTOM_KINDS
    kinds = {(o["apiVersion"], o["kind"]) for o in render(chart, MATRIX["cert-manager-and-monitors"])}
    assert kinds >= CUSTOM_KINDS
    assert ("v1", "ConfigMap") in kinds  # the dashboard
    [dashboard] = [c for c in by_kind(render(chart, ALL_ON), "ConfigMap") if "strata.json" in c["data"]]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["strata.json"])["uid"] == "strata-checkpoints"


def _metric_names_defined() -> set[str]:
    root = Path(__file__).resolve().parents[2] / "sidecar"
    sources = (root / "metrics.py").read_text() + (root / "operator" / "metrics.py").read_text()
    names = set(re.findall(r'"(strata_[a-z0-9_]+)"', sources))
    return names | {f"{n}_total" for n in names}  # prometheus_client adds a counter's suffix


def test_the_pod_monitor_scrapes_what_the_injection_exposes(chart: Any) -> None:
    """The PodMonitor selects opted-in pods by the opt-in label and scrapes the port name the injected
    sidecar declares: a renamed port or label would silently stop every sidecar scrape."""
    from sidecar.operator import admission, inject
    from sidecar.operator.names import OPT_IN_LABEL, OPT_IN_VALUE

    [monitor] = by_kind(render(chart, ALL_ON), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchLabels": {OPT_IN_LABEL: OPT_IN_VALUE}}
    pod = {
        "metadata": {"name": "p", "labels": {OPT_IN_LABEL: OPT_IN_VALUE}, "annotations": {}},
        "spec": {"containers": [{"name": "trainer", "image": "t"}]},
    }
    assert admission.opted_in(pod)
    config = inject.InjectConfig(image="strata:1", storage_uri="s3://b/p")
    ops = inject.inject(pod, namespace="ml", config=config)
    [sidecar] = [op["value"][0] for op in ops if op["path"] == "/spec/initContainers"]
    declared = {p["name"] for p in sidecar["ports"]}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["strata-metrics"]
    assert "strata-metrics" in declared
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def test_the_dashboard_queries_real_metrics(chart: Any) -> None:
    [dashboard] = [c for c in by_kind(render(chart, ALL_ON), "ConfigMap") if "strata.json" in c["data"]]
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                exprs.append(value) if key == "expr" else walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(dashboard["data"]["strata.json"]))
    assert exprs
    defined = _metric_names_defined()
    for expr in exprs:
        used = set(re.findall(r"\b(strata_[a-z0-9_]+?)(?:_bucket|_sum|_count|_created)?\b", expr))
        assert used, expr
        assert used <= defined, (expr, used - defined)


def test_crds_are_valid(chart: Any) -> None:
    crds = chart.crds
    assert {c["name"] for c in crds} >= {
        "crds/checkpoints.strata.dev.yaml",
        "crds/stratajobs.strata.dev.yaml",
        "crds/clusterkopfpeerings.kopf.dev.yaml",
        "crds/kopfpeerings.kopf.dev.yaml",
    }
    for crd in crds:
        body = yaml.safe_load(crd["data"])
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(body, version, strict=True)


@pytest.mark.parametrize(
    ("case", "kube_version"),
    [
        ("defaults", None),
        ("defaults", "v1.29.0"),
        ("cert-manager-and-monitors", "v1.33.0"),
        ("namespaced", None),
        ("namespaced-peers", "v1.29.0"),
        ("peering", None),
        ("openshift", None),
        ("restricted-metrics", None),
    ],
)
def test_lint_strict_is_clean(case: str, kube_version: str | None) -> None:
    report = helm.lint(CHART, MATRIX[case], strict=True, namespace=NAMESPACE, kube_version=kube_version)
    assert not report["errors"], report
    # severity 1 is info ("icon is recommended"); warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# --- values.schema.json ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicas": "two"}}, "at '/operator/replicas': got string, want integer"),
        ({"bogus": 1}, "additional properties 'bogus' not allowed"),
        (
            {"monitoring": {"serviceMonitor": {"enabeld": True}}},
            "additional properties 'enabeld' not allowed",
        ),
        (
            {"webhook": {"injectFailurePolicy": "Maybe"}},
            "at '/webhook/injectFailurePolicy': value must be one of",
        ),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
        (
            {"tls": {"certManager": {"issuerRef": {"name": "x", "kind": "Vault"}}}},
            "/tls/certManager/issuerRef/kind",
        ),
        ({"webhook": {"timeoutSeconds": 60}}, "at '/webhook/timeoutSeconds'"),
        ({"storage": {"endpoint": "seaweedfs:8333"}}, "at '/storage/endpoint'"),
        ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0'"),
        # one replica only: a second would take reports and acknowledgements while paused
        ({"operator": {"replicas": 2}}, "at '/operator/replicas'"),
        ({"operator": {"replicas": 2, "peering": "strata"}}, "at '/operator/replicas'"),
        ({"operator": {"runAsUser": 0}}, "at '/operator/runAsUser'"),
        ({"sidecar": {"runAsUser": "nobody"}}, "at '/sidecar/runAsUser'"),
        # removed: it re-opened the other ports with endPort ranges, which CNIs without endPort cut
        (
            {"networkPolicy": {"peers": {"otherPorts": True}}},
            "additional properties 'otherPorts' not allowed",
        ),
    ],
)
def test_schema_rejects_readably(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)


def test_schema_rejects_at_render_and_lint_too(chart: Any) -> None:
    """What `helm install --set operator.replica=2` and `helm lint` hit: the engine validates first."""
    with pytest.raises(
        helm.HelmValuesError, match="at '/operator': additional properties 'replica' not allowed"
    ):
        chart.render({"operator": {"replica": 2}}, name=RELEASE, namespace=NAMESPACE)
    report = helm.lint(CHART, {"operator": {"replica": 2}}, strict=True)
    assert any("additional properties 'replica' not allowed" in e for e in report["errors"]), report


def test_values_the_schema_cannot_express_fail_the_render(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match="must not contain the release namespace"):
        chart.render({"watchNamespaces": [NAMESPACE]}, name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(
        helm.HelmRenderError, match=r"networkPolicy\.peers\.enabled needs networkPolicy\.peers\.namespaces"
    ):
        chart.render({"networkPolicy": {"peers": {"enabled": True}}}, name=RELEASE, namespace=NAMESPACE)


def test_every_value_is_in_the_schema(chart: Any) -> None:
    """The defaults themselves pass, and every default key is declared (additionalProperties false)."""
    chart.validate_schema({})
    schema = chart.schema

    def walk(values: dict[str, Any], node: dict[str, Any], where: str) -> None:
        if node.get("additionalProperties") is False:
            for key, value in values.items():
                assert key in node["properties"], f"{where}.{key} is not in values.schema.json"
                assert "description" in node["properties"][key] or "properties" in node["properties"][key], (
                    key
                )
                if isinstance(value, dict) and "properties" in node["properties"][key]:
                    walk(value, node["properties"][key], f"{where}.{key}")

    walk(chart.values, schema, "")


# --- RBAC -----------------------------------------------------------------------------------------------


def tls_role(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [role] = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == "strata-tls"]
    assert role["metadata"]["namespace"] == NAMESPACE
    [binding] = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == "strata-tls"]
    assert binding["roleRef"]["name"] == "strata-tls"
    return role


def workload_roles(objects: list[dict[str, Any]], kind: str = "Role") -> list[dict[str, Any]]:
    return [r for r in by_kind(objects, kind) if r["metadata"]["name"] == "strata"]


def test_rbac_cluster_wide_is_the_least_privilege_list(chart: Any) -> None:
    objects = render(chart)
    assert not workload_roles(objects)
    assert rules_of(tls_role(objects)) == TLS_SECRET_RULES
    role = one(installed(objects), "ClusterRole")
    assert rules_of(role) == {
        **CLUSTER_RULES,
        **TLS_CLUSTER_RULES,
        **WORKLOAD_RULES,
    }
    binding = one(installed(objects), "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "strata", "namespace": NAMESPACE}]
    # with cert-manager the operator reads its mounted Secret: no Secret or webhook rights at all
    objects = render(chart, MATRIX["cert-manager"])
    assert rules_of(one(installed(objects), "ClusterRole")) == {
        **CLUSTER_RULES,
        **WORKLOAD_RULES,
    }
    assert not by_kind(objects, "Role")


def test_rbac_table_in_the_chart_readme_lists_the_same_verbs() -> None:
    """charts/strata/README.md justifies every verb: its table names exactly the rules rendered (plain rows;
    the rows naming resourceNames are the TLS and peering rules, checked by the tests above)."""
    table: dict[tuple[str, str], set[str]] = {}
    for line in (CHART / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`") or "(" in cells[1] or "the same" in cells[1]:
            continue
        group = cells[0].strip("`").strip('"')
        verbs = {v.strip() for v in cells[2].split(",")}
        table.setdefault((group, cells[1]), set()).update(verbs)
    assert table == {**WORKLOAD_RULES, **CLUSTER_RULES}


def test_rbac_namespaced_mode_uses_roles_per_namespace(chart: Any) -> None:
    objects = render(chart, MATRIX["namespaced"])
    # TokenReview, CRDs and the two webhook configurations are cluster-scoped: no Role can grant them
    assert rules_of(one(installed(objects), "ClusterRole")) == {**CLUSTER_RULES, **TLS_CLUSTER_RULES}
    roles = workload_roles(objects)
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert rules_of(role) == WORKLOAD_RULES
    assert rules_of(tls_role(objects)) == TLS_SECRET_RULES
    bindings = workload_roles(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "strata"}
        assert b["subjects"][0]["namespace"] == NAMESPACE
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_rbac_peering(chart: Any) -> None:
    objects = render(chart, MATRIX["peering"])
    assert rules_of(one(installed(objects), "ClusterRole")) == {
        **CLUSTER_RULES,
        **TLS_CLUSTER_RULES,
        **CLUSTER_PEERING_RULES,
        **WORKLOAD_RULES,
    }
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # standalone: never two acting operators, not even during an upgrade
    assert one(render(chart), "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert "--peering=strata" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    # kopf never creates the peering object, and with --peering it stays paused until it exists
    [peering] = by_kind(objects, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "strata" and "namespace" not in peering["metadata"]
    assert not by_kind(objects, "KopfPeering")
    assert not [o for o in render(chart) if (o["apiVersion"], o["kind"]) in PEERING_KINDS]
    # namespaced mode: kopf peers in every watched namespace (none in the release namespace)
    two = {"watchNamespaces": ["team-a", "team-b"], "operator": {"peering": "p"}}
    objects = render(chart, two)
    assert not by_kind(objects, "ClusterKopfPeering")
    peerings = by_kind(objects, "KopfPeering")
    assert sorted((p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings) == [
        ("team-a", "p"),
        ("team-b", "p"),
    ]
    roles = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == "strata-peering"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert rules_of(role) == {
            ("kopf.dev", "kopfpeerings"): {"list", "watch"},
            ("kopf.dev", "kopfpeerings", "p"): {"patch"},
        }
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == "strata-peering"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"]["name"] == "strata-peering" and b["subjects"][0]["namespace"] == NAMESPACE
    assert rules_of(one(installed(objects), "ClusterRole")) == {**CLUSTER_RULES, **TLS_CLUSTER_RULES}
    objects = render(chart, MATRIX["namespaced-peering"])
    peering_roles = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == "strata-peering"]
    assert [(r["metadata"]["namespace"], rules_of(r)) for r in peering_roles] == [
        ("team-a", NAMESPACED_PEERING_RULES)
    ]


# --- webhooks and TLS -----------------------------------------------------------------------------------


def test_mutating_webhook(chart: Any) -> None:
    config = one(render(chart), "MutatingWebhookConfiguration")
    hooks = {h["name"]: h for h in config["webhooks"]}
    assert set(hooks) == {"inject.strata.dev", "inject-jobs.strata.dev", "inject-jobsets.strata.dev"}
    for name, group in (("jobs", "batch"), ("jobsets", "jobset.x-k8s.io")):
        # the sidecar's stand-in in workload templates (quota counts it): at creation only, never blocking
        workload = hooks[f"inject-{name}.strata.dev"]
        assert workload["rules"][0]["apiGroups"] == [group] and workload["rules"][0]["resources"] == [name]
        assert workload["rules"][0]["operations"] == ["CREATE"] and workload["failurePolicy"] == "Ignore"
        assert workload["clientConfig"]["service"]["path"] == "/mutate-workloads"
        [condition] = workload["matchConditions"]
        assert "template.metadata.labels['strata.dev/checkpoint'] == 'enabled'" in condition["expression"]
        assert workload["namespaceSelector"] == hooks["inject.strata.dev"]["namespaceSelector"]
    hook = hooks["inject.strata.dev"]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert hook["objectSelector"] == {"matchLabels": {"strata.dev/checkpoint": "enabled"}}
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]} in hook[
        "namespaceSelector"
    ]["matchExpressions"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "None"
    assert hook["timeoutSeconds"] == 5
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["clientConfig"]["service"] == {
        "name": "strata",
        "namespace": NAMESPACE,
        "path": "/mutate-pods",
        "port": 8443,
    }


def test_validating_webhook(chart: Any) -> None:
    config = one(render(chart), "ValidatingWebhookConfiguration")
    hooks = {h["name"]: h for h in config["webhooks"]}
    assert set(hooks) == {
        "validate-jobs.strata.dev",
        "validate-jobsets.strata.dev",
        "validate-trainingruntimes.strata.dev",
    }
    assert hooks["validate-jobs.strata.dev"]["rules"][0]["apiGroups"] == ["batch"]
    assert hooks["validate-jobs.strata.dev"]["rules"][0]["resources"] == ["jobs"]
    assert hooks["validate-jobsets.strata.dev"]["rules"][0]["apiGroups"] == ["jobset.x-k8s.io"]
    assert hooks["validate-jobsets.strata.dev"]["rules"][0]["resources"] == ["jobsets"]
    runtimes = hooks["validate-trainingruntimes.strata.dev"]["rules"][0]
    assert runtimes["apiGroups"] == ["trainer.kubeflow.org"] and runtimes["scope"] == "*"
    assert runtimes["resources"] == ["trainingruntimes", "clustertrainingruntimes"]
    for hook in hooks.values():
        assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
        assert hook["failurePolicy"] == "Ignore"
        assert hook["sideEffects"] == "None"
        assert hook["clientConfig"]["service"]["path"] == "/validate-workloads"
        [condition] = hook["matchConditions"]
        assert "'strata.dev/checkpoint'" in condition["expression"]
        assert "template.metadata.labels" in condition["expression"]
        assert "== 'enabled'" in condition["expression"]
        # and UPDATEs of what was opted in: removing the label from a template that keeps the stand-in
        assert "oldObject != null && has(oldObject.spec" in condition["expression"]
        assert condition["expression"].count("labels['strata.dev/checkpoint'] == 'enabled'") == 2
        assert "objectSelector" not in hook  # the Job's own labels never reach pods: select the template


def test_namespaced_mode_webhooks_select_watched_namespaces(chart: Any) -> None:
    objects = render(chart, MATRIX["namespaced"])
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in one(objects, kind)["webhooks"]:
            expressions = hook["namespaceSelector"]["matchExpressions"]
            assert {
                "key": "kubernetes.io/metadata.name",
                "operator": "In",
                "values": ["team-a", "team-b"],
            } in expressions


def test_operator_managed_tls(chart: Any) -> None:
    """The chart creates the Secret empty (the operator fills it) and tells the operator to manage it
    and both webhook configurations; a first install has no caBundle yet (the operator patches it)."""
    objects = render(chart)
    secret = one(objects, "Secret")
    assert secret["metadata"]["name"] == "strata-tls"
    assert secret["type"] == "Opaque" and "data" not in secret
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = one(objects, kind)
        assert config["metadata"]["name"] == "strata"
        assert "annotations" not in config["metadata"]
        assert all("caBundle" not in h["clientConfig"] for h in config["webhooks"])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    for flag in (
        "--tls-secret=strata-tls",
        "--tls-service=strata",
        "--webhook-configuration=strata",
        "--tls-ca-days=1825",
        "--tls-cert-days=365",
    ):
        assert flag in args
    assert not [a for a in args if a.startswith("--tls-cert-file")]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]  # the Secret is read through the API


def test_cert_manager_tls(chart: Any) -> None:
    objects = render(chart, MATRIX["cert-manager"])
    assert not by_kind(objects, "Secret")
    certificates = {c["metadata"]["name"]: c for c in by_kind(objects, "Certificate")}
    issuers = {i["metadata"]["name"]: i for i in by_kind(objects, "Issuer")}
    # a CA of its own (self-signed root -> CA Issuer -> serving certificate): ca.crt, what sidecars
    # and caBundle trust, is the CA and survives the serving certificate's renewals
    assert issuers["strata-selfsigned"]["spec"] == {"selfSigned": {}}
    ca = certificates["strata-ca"]
    assert ca["spec"]["isCA"] is True and ca["spec"]["issuerRef"]["name"] == "strata-selfsigned"
    assert issuers["strata-ca"]["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    certificate = certificates["strata-serving"]
    assert certificate["spec"]["secretName"] == "strata-tls"
    assert certificate["spec"]["issuerRef"] == {"name": "strata-ca", "kind": "Issuer"}
    assert f"strata.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = one(objects, kind)
        assert config["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": f"{NAMESPACE}/strata-serving"
        }
        assert all("caBundle" not in h["clientConfig"] for h in config["webhooks"])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "strata-tls"}} in pod["volumes"]
    args = pod["containers"][0]["args"]
    assert {
        "--tls-cert-file=/tls/tls.crt",
        "--tls-key-file=/tls/tls.key",
        "--tls-ca-file=/tls/ca.crt",
    } <= set(args)
    assert not [a for a in args if a.startswith(("--tls-secret", "--webhook-configuration"))]
    objects = render(chart, MATRIX["cert-manager-issuer"])
    assert not by_kind(objects, "Issuer")
    assert one(objects, "Certificate")["spec"]["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer"}


# --- the operator Deployment, Service, NetworkPolicy, hooks ----------------------------------------------


def test_operator_deployment(chart: Any) -> None:
    objects = render(chart, MATRIX["restricted-metrics"])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] == ["strata", "operator"]
    assert container["args"] == [
        "--report-port=8443",
        "--metrics-port=9090",
        "--tls-secret=strata-tls",
        "--tls-service=strata",
        "--webhook-configuration=strata",
        "--tls-ca-days=1825",
        "--tls-cert-days=365",
        "--fence-margin-seconds=60",
        "--trainer-container=trainer",
        f"--sidecar-image={IMAGE}",
        "--storage-uri=s3://ckpt/jobs",
        "--storage-endpoint=http://seaweedfs.storage:8333",
        '--sidecar-resources={"limits":{"memory":"4Gi"},"requests":{"cpu":"500m","memory":"1Gi"}}',
        "--shm-size=2Gi",
        "--sidecar-pull-policy=IfNotPresent",
        "--sidecar-user=65532",
        f"--sidecar-report-url=https://strata.{NAMESPACE}.svc:8443",
        "--own-namespace=$(POD_NAMESPACE)",
    ]
    assert container["env"] == [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # kopf's identity (else it asks for a user name, which the image's uid does not have)
        {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    # without storage.uri no injection flags: --sidecar-image and --storage-uri go together
    default_args = one(render(chart), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in default_args if a.startswith(("--sidecar-", "--storage-", "--shm-size"))]
    cert_manager = one(
        render(chart, {**MATRIX["cert-manager"], "storage": {"uri": "s3://b/p"}}), "Deployment"
    )
    assert f"--sidecar-image={IMAGE}" in cert_manager["spec"]["template"]["spec"]["containers"][0]["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    ports = {p["name"]: p["port"] for p in one(objects, "Service")["spec"]["ports"]}
    assert ports == {"https": 8443, "metrics": 9090}


def test_network_policy(chart: Any) -> None:
    policy = one(render(chart), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert [r["ports"][0]["port"] for r in policy["spec"]["ingress"]] == [8443, 9090]
    assert all("from" not in r for r in policy["spec"]["ingress"])
    policy = one(render(chart, MATRIX["restricted-metrics"]), "NetworkPolicy")
    webhook, metrics = policy["spec"]["ingress"]
    assert "from" not in webhook  # the apiserver's address is not selectable
    assert metrics["from"][0] == {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    assert not by_kind(render(chart, MATRIX["no-networkpolicy"]), "NetworkPolicy")


#: The pre-delete hook's own right, for its moment only: delete this release's mutating webhook
#: configuration (get: read its timeout, to wait for admissions under way), so that no pod created
#: after the hook is gated by a webhook whose operator is going away.
HOOK_RULES = {("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "strata"): {"get", "delete"}}


@pytest.mark.parametrize("case", ["namespaced", "defaults", "cert-manager"])
def test_hooks(chart: Any, case: str) -> None:
    """The pre-delete hook first deletes the mutating webhook configuration (the uninstall deletes it
    anyway; until then it gates every new opted-in pod), then lifts the gates: its command names the
    configuration, and a hook-only ClusterRole, created before the Job, grants exactly that delete."""
    objects = render(chart, MATRIX[case])
    [job] = by_kind(objects, "Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-delete"
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["strata", "operator"]
    namespaces = [f"--namespace={n}" for n in MATRIX[case].get("watchNamespaces", [])]
    assert container["args"] == ["--lift-gates", "--webhook-configuration=strata", *namespaces]
    [mutating] = by_kind(objects, "MutatingWebhookConfiguration")
    assert mutating["metadata"]["name"] == "strata"
    service_account = job["spec"]["template"]["spec"]["serviceAccountName"]
    assert service_account == "strata"
    [role] = [r for r in by_kind(objects, "ClusterRole") if r not in installed(objects)]
    [binding] = [b for b in by_kind(objects, "ClusterRoleBinding") if b not in installed(objects)]
    assert rules_of(role) == HOOK_RULES
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}
    ]
    for obj in (role, binding):
        hook = obj["metadata"]["annotations"]
        assert hook["helm.sh/hook"] == "pre-delete"
        assert int(hook["helm.sh/hook-weight"]) < int(annotations["helm.sh/hook-weight"])  # before the Job
        assert set(hook["helm.sh/hook-delete-policy"].split(",")) == {
            "before-hook-creation",
            "hook-succeeded",
        }
    # the operator itself never holds that delete
    [key] = HOOK_RULES
    assert all(
        "delete" not in rules_of(r).get(key, set()) for r in installed(by_kind(objects, "ClusterRole"))
    )
    tests = [o for o in by_kind(objects, "Pod") if o["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert len(tests) == 1


def test_prometheus_rule_names_real_metrics(chart: Any) -> None:
    rule = one(render(chart, ALL_ON), "PrometheusRule")
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "strata_last_commit_timestamp_seconds" in exprs["StrataNoCommit"]
    assert "> 1800" in exprs["StrataNoCommit"]  # 3 intervals of 600 s
    assert "strata_operator_restarts_total" in exprs["StrataGangRestartsFrequent"]
    assert "strata_storage_errors_total" in exprs["StrataStorageErrors"]
    assert "strata_quantization_relative_error" in exprs["StrataQuantizationErrorHigh"]
    assert "strata_operator_jobs_failed_total" in exprs["StrataRestartsExhausted"]
    assert "strata_operator_stuck_gangs" in exprs["StrataGangStuck"]
    assert (
        "strata_operator_tls_certificate_expiry_timestamp_seconds"
        in exprs["StrataOperatorCertificateExpiring"]
    )
    sources = (Path(__file__).resolve().parents[2] / "sidecar" / "metrics.py").read_text() + (
        Path(__file__).resolve().parents[2] / "sidecar" / "operator" / "metrics.py"
    ).read_text()
    for name in (
        "strata_last_commit_timestamp_seconds",
        "strata_operator_restarts_total",
        "strata_storage_errors_total",
        "strata_quantization_relative_error",
        "strata_operator_report_rejections_total",
        "strata_operator_jobs_failed_total",
        "strata_operator_tls_certificate_expiry_timestamp_seconds",
        "strata_operator_stuck_gangs",
    ):
        assert f'"{name}"' in sources, name


def test_notes(chart: Any) -> None:
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["strata/templates/NOTES.txt"]
    assert "kubectl -n strata-system rollout status deployment/strata" in notes
    assert "kubectl apply --server-side -f charts/strata/crds/" in notes
    assert "storage.uri is empty" in notes


def test_strict_validation_catches_unknown_fields() -> None:
    """The negative control of the schema check above: a misplaced field fails for both versions."""
    container: dict[str, Any] = {"name": "c", "securityContxt": {}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [container]}}
    for version in KUBE_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(pod, version, strict=True)


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: `make setup` installs Debian's prometheus package (deploy/local)")
    return found


def _rules_file(chart: Any, tmp_path: Path) -> Path:
    """The chart's PrometheusRule as a plain rules file. Annotations are dropped: `promtool test rules`
    would compare their rendered text, and `check rules` below checks their templates."""
    rule = one(render(chart, ALL_ON), "PrometheusRule")
    checked = tmp_path / "checked.yaml"
    checked.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    out = subprocess.run([_promtool(), "check", "rules", str(checked)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    groups = copy.deepcopy(rule["spec"]["groups"])
    for group in groups:
        for entry in group["rules"]:
            entry.pop("annotations", None)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_prometheus_rules_pass_promtool_and_fire_on_synthetic_series(chart: Any, tmp_path: Path) -> None:
    rules = _rules_file(chart, tmp_path)
    job = 'namespace="default",training_job="recsys"'
    healthy = 'namespace="default",training_job="ok"'
    never = 'namespace="default",training_job="stuck"'
    severity = {
        r["alert"]: r["labels"]["severity"]
        for g in one(render(chart, ALL_ON), "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
    }
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # A job whose last commit was at t=0, and one that commits every minute.
                    {"series": f"strata_last_commit_timestamp_seconds{{{job}}}", "values": "0x120"},
                    {"series": f"strata_last_commit_timestamp_seconds{{{healthy}}}", "values": "0+60x120"},
                    # a job that saves every minute and has never committed (no last-commit series)
                    {"series": f"strata_save_stall_seconds_count{{{never}}}", "values": "0+1x120"},
                    {"series": f'strata_storage_errors_total{{{job},op="put"}}', "values": "0+1x30"},
                    {"series": f"strata_quantization_relative_error{{{job}}}", "values": "0.05x60"},
                    {"series": 'strata_operator_restarts_total{reason="oom"}', "values": "0+1x60"},
                    # one job gave up at t=10m (restarts exhausted); another was NotRestartable
                    {
                        "series": 'strata_operator_jobs_failed_total{reason="RestartLimitReached"}',
                        "values": "0x10 1x110",
                    },
                    {
                        "series": 'strata_operator_jobs_failed_total{reason="NotRestartable"}',
                        "values": "0x5 1x115",
                    },
                    # reports refused for a bad token from t=30m on; malformed ones never alert
                    {
                        "series": 'strata_operator_report_rejections_total{reason="token"}',
                        "values": "0x30 1+1x90",
                    },
                    {
                        "series": 'strata_operator_report_rejections_total{reason="malformed"}',
                        "values": "0+1x120",
                    },
                    # a certificate that expires 10 days after t=0
                    {
                        "series": "strata_operator_tls_certificate_expiry_timestamp_seconds",
                        "values": f"{10 * 86400}x5000",
                    },
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "60m",
                        "alertname": "StrataNoCommit",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataNoCommit"],
                                    "namespace": "default",
                                    "training_job": "recsys",
                                }
                            },
                            {
                                "exp_labels": {
                                    "severity": severity["StrataNoCommit"],
                                    "namespace": "default",
                                    "training_job": "stuck",
                                }
                            },
                        ],
                    },
                    {"eval_time": "3m", "alertname": "StrataNoCommit", "exp_alerts": []},  # `for: 5m` not yet
                    {"eval_time": "20m", "alertname": "StrataOperatorReportRejections", "exp_alerts": []},
                    {
                        "eval_time": "40m",
                        "alertname": "StrataOperatorReportRejections",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataOperatorReportRejections"],
                                    "reason": "token",
                                }
                            }
                        ],
                    },
                    # the committing job alone: its 1800 s are not over, the stuck one already fires
                    {
                        "eval_time": "20m",
                        "alertname": "StrataNoCommit",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataNoCommit"],
                                    "namespace": "default",
                                    "training_job": "stuck",
                                }
                            }
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "StrataStorageErrors",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataStorageErrors"],
                                    "namespace": "default",
                                    "training_job": "recsys",
                                    "op": "put",
                                }
                            }
                        ],
                    },
                    {
                        "eval_time": "30m",
                        "alertname": "StrataQuantizationErrorHigh",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataQuantizationErrorHigh"],
                                    "namespace": "default",
                                    "training_job": "recsys",
                                }
                            }
                        ],
                    },
                    {
                        "eval_time": "30m",
                        "alertname": "StrataRestartsExhausted",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": severity["StrataRestartsExhausted"],
                                    "reason": "RestartLimitReached",
                                }
                            }
                        ],
                    },
                    {"eval_time": "5m", "alertname": "StrataRestartsExhausted", "exp_alerts": []},
                    # 10 days left at t=0: under 7 days from 72h on, for 1h
                    {"eval_time": "70h", "alertname": "StrataOperatorCertificateExpiring", "exp_alerts": []},
                    {
                        "eval_time": "80h",
                        "alertname": "StrataOperatorCertificateExpiring",
                        "exp_alerts": [
                            {"exp_labels": {"severity": severity["StrataOperatorCertificateExpiring"]}}
                        ],
                    },
                    {
                        "eval_time": "50m",
                        "alertname": "StrataGangRestartsFrequent",
                        "exp_alerts": [{"exp_labels": {"severity": severity["StrataGangRestartsFrequent"]}}],
                    },
                ],
            }
        ],
    }
    spec = tmp_path / "tests.yaml"
    spec.write_text(yaml.safe_dump(tests))
    out = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_in_place_restart_switch(chart: Any) -> None:
    args = one(render(chart), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--in-place") for a in args)
    objects = render(chart, MATRIX["in-place-and-peers"])
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--in-place-restart" in args and "--in-place-timeout-seconds=90" in args


def peer_policies(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in by_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == f"{RELEASE}-peers"]


def test_no_peer_network_policy_unless_asked(chart: Any) -> None:
    """A policy that selects a pod isolates all of its ingress: one rendered by default, in namespaced
    mode, cut c10d rendezvous, NCCL/gloo and scraping wherever the CNI ignored its endPort ranges."""
    for case in ("defaults", "namespaced", "namespaced-peering", "no-networkpolicy", "monitors-on"):
        assert not peer_policies(render(chart, MATRIX[case])), case


def test_no_network_policy_uses_port_ranges(chart: Any) -> None:
    """CNIs without endPort (older Cilium, Azure NPM) apply `port` alone: every rule is one exact port."""
    for case in sorted(MATRIX):
        for policy in by_kind(render(chart, MATRIX[case]), "NetworkPolicy"):
            for rule in policy["spec"].get("ingress") or []:
                assert rule["ports"], (case, policy["metadata"]["name"])  # never every port
                for port in rule["ports"]:
                    assert set(port) == {"port", "protocol"} and isinstance(port["port"], int), (case, port)


def test_the_peer_network_policy_admits_the_peer_port_from_peers_only(chart: Any) -> None:
    """Asked for (networkPolicy.peers.enabled), the policy only adds the peer port between opted-in
    pods of the namespace: meant for namespaces whose pods a default-deny already isolates."""
    from sidecar.operator import names  # PEER_PORT: what the injection declares (tests/k8s/test_in_place.py)

    opted_in = {"matchLabels": {names.OPT_IN_LABEL: names.OPT_IN_VALUE}}
    expected_spec = {
        "podSelector": opted_in,
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": opted_in}], "ports": [{"port": names.PEER_PORT, "protocol": "TCP"}]}
        ],
    }
    [peers] = peer_policies(render(chart, MATRIX["in-place-and-peers"]))
    assert peers["metadata"]["namespace"] == "ml" and peers["spec"] == expected_spec
    # the listed namespaces, else watchNamespaces; independent of the operator's own policy
    namespaced = peer_policies(render(chart, MATRIX["namespaced-peers"]))
    assert sorted(p["metadata"]["namespace"] for p in namespaced) == ["team-a", "team-b"]
    assert all(p["spec"] == expected_spec for p in namespaced)
    alone = render(
        chart, {"networkPolicy": {"enabled": False, "peers": {"enabled": True, "namespaces": ["ml"]}}}
    )
    assert [p["metadata"]["name"] for p in by_kind(alone, "NetworkPolicy")] == [f"{RELEASE}-peers"]


# --- one operator replica and its upgrades --------------------------------------------------------------


def test_more_than_one_replica_is_refused_by_the_helm_engine(chart: Any) -> None:
    """A second replica is broken, not highly available (reports and in-place acknowledgements reach a
    paused replica, latestStep goes stale, two Checkpoints carry latest=true): the schema refuses it,
    peering or not, through `helm install`, `helm template` and `helm lint` alike."""
    replicas = chart.schema["properties"]["operator"]["properties"]["replicas"]
    assert (replicas["minimum"], replicas["maximum"]) == (1, 1)
    assert "paused" in replicas["description"] and "restarts" in replicas["description"]
    for values in ({"operator": {"replicas": 2}}, {"operator": {"replicas": 3, "peering": "strata"}}):
        with pytest.raises(helm.HelmValuesError, match="at '/operator/replicas'"):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
        report = helm.lint(CHART, values, strict=True)
        assert any("/operator/replicas" in e for e in report["errors"]), report
    assert one(render(chart, {"operator": {"replicas": 1}}), "Deployment")["spec"]["replicas"] == 1


def test_an_upgrade_never_runs_two_acting_operators(chart: Any) -> None:
    """Standalone, the old pod goes before the new one starts (Recreate). With peering the new pod
    starts beside the old one (surge 1, unavailable 0: the webhooks keep a ready endpoint) and waits,
    paused, until the old one has exited; meanwhile the Service keeps every sidecar on the pod it
    reached before (ClientIP affinity), so reports keep going to the acting operator. No
    PodDisruptionBudget: for one replica minAvailable 1 would block every node drain, and
    maxUnavailable 1 would budget nothing."""
    standalone = one(render(chart), "Deployment")["spec"]
    assert standalone["replicas"] == 1 and standalone["strategy"] == {"type": "Recreate"}
    peering = one(render(chart, MATRIX["peering"]), "Deployment")["spec"]
    assert peering["replicas"] == 1
    assert peering["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    for case in ("defaults", "peering", "namespaced-peering"):
        assert one(render(chart, MATRIX[case]), "Service")["spec"]["sessionAffinity"] == "ClientIP"
    for case in sorted(MATRIX):
        assert not by_kind(render(chart, MATRIX[case]), "PodDisruptionBudget"), case


# --- GitOps: `helm template` (Argo CD), Flux ------------------------------------------------------------

WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def test_a_render_without_a_cluster_has_no_ca_bundle_at_all(chart: Any) -> None:
    """`helm template` (Argo CD) finds no Secret to look up: the chart cannot know the bundle and
    renders no caBundle field at all (an empty one would be restored over the operator's by every
    self-heal, and failurePolicy Fail would refuse opted-in pods); the operator patches it in. With
    cert-manager its CA injector fills it (cert-manager.io/inject-ca-from)."""
    for case in ("defaults", "namespaced", "cert-manager", "cert-manager-issuer"):
        manifests = chart.render(MATRIX[case], name=RELEASE, namespace=NAMESPACE)
        assert "caBundle" not in manifests["strata/templates/webhook.yaml"], case
        objects = render(chart, MATRIX[case])
        for kind in WEBHOOK_KINDS:
            config = one(objects, kind)
            for hook in config["webhooks"]:
                assert set(hook["clientConfig"]) == {"service"}, (case, kind)
            inject = (config["metadata"].get("annotations") or {}).get("cert-manager.io/inject-ca-from")
            if "cert-manager" in case:
                assert inject == f"{NAMESPACE}/strata-serving"
            else:
                assert inject is None
                args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
                assert f"--webhook-configuration={config['metadata']['name']}" in args


def _yaml_snippets(kind: str) -> list[dict[str, Any]]:
    """The ```yaml blocks of charts/strata/README.md holding an object of ``kind``."""
    found = []
    for block in re.findall(r"```yaml\n(.*?)```", (CHART / "README.md").read_text(), re.S):
        found += [d for d in yaml.safe_load_all(block) if isinstance(d, dict) and d.get("kind") == kind]
    return found


def _webhook_configurations(chart: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (kind, one(render(chart), kind)["metadata"]["name"]): one(render(chart), kind)
        for kind in WEBHOOK_KINDS
    }


def test_the_argo_cd_snippet_leaves_both_bundles_to_the_operator(chart: Any) -> None:
    """The Application in the chart README (copy-paste): ignoreDifferences names exactly the webhook
    configurations the chart renders, on the field the operator writes, and sync respects it."""
    [app] = _yaml_snippets("Application")
    assert app["apiVersion"] == "argoproj.io/v1alpha1"
    spec = app["spec"]
    assert spec["source"]["path"] == "charts/strata" and spec["source"]["helm"]["releaseName"] == RELEASE
    assert spec["destination"]["namespace"] == NAMESPACE
    rendered = _webhook_configurations(chart)
    ignored = {
        (entry["kind"], entry["name"]): entry
        for entry in spec["ignoreDifferences"]
        if entry.get("group") == "admissionregistration.k8s.io"
    }
    assert set(ignored) == set(rendered)
    for key, entry in ignored.items():
        assert entry["jqPathExpressions"] == [".webhooks[]?.clientConfig.caBundle"]
        assert all("clientConfig" in hook for hook in rendered[key]["webhooks"])  # the path's parent exists
    assert "RespectIgnoreDifferences=true" in spec["syncPolicy"]["syncOptions"]


def test_the_flux_snippet_ignores_the_bundle_of_every_webhook(chart: Any) -> None:
    """Flux runs Helm against the cluster (the lookup works, the bundle of the last upgrade is in the
    manifest): drift correction must leave the field to the operator, one JSON pointer per webhook."""
    [release] = _yaml_snippets("HelmRelease")
    assert release["apiVersion"] == "helm.toolkit.fluxcd.io/v2"
    assert release["spec"]["releaseName"] == RELEASE
    drift = release["spec"]["driftDetection"]
    assert drift["mode"] == "enabled"
    ignored = {(rule["target"]["kind"], rule["target"]["name"]): rule["paths"] for rule in drift["ignore"]}
    rendered = _webhook_configurations(chart)
    assert set(ignored) == set(rendered)
    for key, config in rendered.items():
        assert ignored[key] == [
            f"/webhooks/{i}/clientConfig/caBundle" for i in range(len(config["webhooks"]))
        ]


# --- OpenShift: runAsUser -------------------------------------------------------------------------------


def _security(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, securityContext) of every pod and container the chart runs itself."""
    found = []
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            pod = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            pod = obj["spec"]
        else:
            continue
        found.append((f"{obj['kind']}/{obj['metadata']['name']}", pod["securityContext"]))
        found += [(f"{obj['kind']}/{c['name']}", c["securityContext"]) for c in pod["containers"]]
    return found


def test_run_as_user_is_settable_and_omitted_for_openshift(chart: Any) -> None:
    """OpenShift's restricted-v2 SCC refuses a fixed runAsUser (and fsGroup) outside the namespace's
    range: null omits them, for the operator's own pods (operator.runAsUser) and the injected sidecar
    (sidecar.runAsUser, passed to the operator), and runAsNonRoot stays."""
    objects = render(chart, {"storage": {"uri": "s3://b/p"}})
    for where, context in _security(objects):
        assert context["runAsUser"] == 65532 and context["runAsGroup"] == 65532, where
        assert context["runAsNonRoot"] is True
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--sidecar-user=65532" in args
    objects = render(chart, MATRIX["openshift"])
    assert len(_security(objects)) == 6  # operator, hook and test pods and their containers
    for where, context in _security(objects):
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(context), where
        assert context["runAsNonRoot"] is True
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--sidecar-user")] == ["--sidecar-user=none"]
    custom = render(chart, {"storage": {"uri": "s3://b/p"}, "operator": {"runAsUser": 1000700000}})
    assert {c["runAsUser"] for _, c in _security(custom)} == {1000700000}
    pod = one(custom, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 1000700000
    # without injection there is no sidecar to tell about
    args = one(render(chart), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--sidecar-user")]


@pytest.mark.parametrize(
    "case", ["defaults", "restricted-metrics", "openshift", "namespaced", "cert-manager"]
)
def test_the_operator_accepts_every_flag_the_chart_passes(chart: Any, case: str) -> None:
    """The Deployment's and the hook's arguments parse with `strata operator`'s own parser: a renamed or
    removed flag fails here, not in a CrashLoopBackOff."""
    from sidecar.operator import cli

    objects = render(chart, {**MATRIX[case], "storage": {"uri": "s3://b/p"}})
    for kind in ("Deployment", "Job"):
        [container] = one(objects, kind)["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["strata", "operator"]
        args = container["args"]
        parser = argparse.ArgumentParser(prog="strata operator", exit_on_error=False)
        cli.add_arguments(parser)
        parsed, unknown = parser.parse_known_args(args)
        assert unknown == [], (kind, unknown)
        if kind == "Job":
            assert parsed.lift_gates and parsed.webhook_configurations == ["strata"]
