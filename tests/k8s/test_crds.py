"""The Checkpoint and StrataJob CRDs: structural schemas, the operator's object builders validate against
them, and the real kubectl shows them (columns, short names, describe with Events) through the emulated API.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from sidecar.operator import objects
from sidecar.operator.names import JOB_LABEL, LATEST_LABEL
from tests.k8s.conftest import K8s, call, kubectl, post_event

CRDS = Path(__file__).resolve().parents[2] / "charts" / "strata" / "crds"
CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
CHECKPOINTS = "/apis/strata.dev/v1alpha1/namespaces/default/checkpoints"
STRATAJOBS = "/apis/strata.dev/v1alpha1/namespaces/default/stratajobs"
SHA = "ab" * 32


def load_crd(name: str) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((CRDS / f"{name}.yaml").read_text())
    return crd


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    [version] = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def report(step: int = 1200, **changes: Any) -> dict[str, Any]:
    """A commit report as the sidecar sends it."""
    body: dict[str, Any] = {
        "kind": "commit",
        "namespace": "default",
        "job": "recsys",
        "step": step,
        "attempt": 3,
        "generation": "r7k2/1",
        "world_size": 2,
        "commit_key": f"prefix/default/recsys/steps/{step:012d}/a3/COMMIT",
        "commit_sha256": SHA,
        "location": f"s3://bucket/prefix/default/recsys/steps/{step:012d}/a3/COMMIT",
        "type": "diff",
        "base_step": 1000,
        "requires": [1000],
        "bits": 4,
        "bytes": 3 * 1024**2,
        "committed_at": 1_780_000_000.5,
        "ranks": [
            {
                "rank": rank,
                "manifest_key": f"prefix/default/recsys/steps/{step:012d}/a3/rank-{rank}.manifest",
                "sha256": SHA,
                "bytes": 1536 * 1024,
                "encodings": {"raw": 3, "rows-diff": 2, "q4": 5},
            }
            for rank in range(2)
        ],
    }
    body.update(changes)
    return body


# ---- structural schemas ------------------------------------------------------------------------------


def schema_nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from schema_nodes(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def structural_problems(crd: dict[str, Any]) -> list[str]:
    """What makes a CRD non-structural (or under-documented), as the apiserver would see it."""
    problems = []
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{version['name']}: preserve-unknown-fields at top level")
        if "status" not in version.get("subresources", {}):
            problems.append(f"{version['name']}: no status subresource")
        for path, node in schema_nodes(schema, ""):
            if "type" not in node and not node.get("x-kubernetes-int-or-string"):
                problems.append(f"{path or '<root>'}: no type")
            for banned in ("oneOf", "anyOf", "allOf", "not", "$ref"):
                if banned in node and path.count(".") <= 1:
                    problems.append(f"{path}: {banned} is not allowed here")
            if path and not path.endswith(("[]", "}")) and not node.get("description"):
                problems.append(f"{path}: no description")
    return problems


@pytest.mark.parametrize("name", ["checkpoints.strata.dev", "stratajobs.strata.dev"])
def test_crds_are_structural_and_documented(name: str) -> None:
    crd = load_crd(name)
    assert crd["metadata"]["name"] == name
    spec = crd["spec"]
    assert spec["group"] == "strata.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["strata"]
    [version] = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert structural_problems(crd) == []


def test_structural_checker_catches_untyped_nodes_and_missing_status() -> None:
    crd = load_crd("checkpoints.strata.dev")
    broken = copy.deepcopy(crd)
    del broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["job"][
        "type"
    ]
    del broken["spec"]["versions"][0]["subresources"]
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-preserve-unknown-fields"] = True
    problems = structural_problems(broken)
    assert ".spec.job: no type" in problems
    assert any("status subresource" in p for p in problems)
    assert any("preserve-unknown-fields" in p for p in problems)


def test_crd_names_and_printer_columns() -> None:
    checkpoints = load_crd("checkpoints.strata.dev")["spec"]
    assert checkpoints["names"]["kind"] == "Checkpoint" and checkpoints["names"]["shortNames"] == ["ckpt"]
    [version] = checkpoints["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Job",
        "Step",
        "Type",
        "Base",
        "Ranks",
        "Bytes",
        "Bits",
        "Ready",
        "Restored",
        "Class",
        "Age",
    ]
    stratajobs = load_crd("stratajobs.strata.dev")["spec"]
    assert stratajobs["names"]["kind"] == "StrataJob" and stratajobs["names"]["shortNames"] == ["sjob"]
    [version] = stratajobs["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Workload",
        "Phase",
        "Step",
        "Attempt",
        "Restarts",
        "Limit",
        "Disruptions",
        "Last-Failure",
        "Age",
    ]


# ---- builders against the schemas --------------------------------------------------------------------


def to_json_schema(node: dict[str, Any], *, root: bool = True) -> dict[str, Any]:
    """An OpenAPI v3 (Kubernetes) schema as JSON Schema: `nullable: true` adds "null" to the type (and
    to an enum); objects with properties reject unknown keys (the apiserver would prune them, which
    for a builder is a bug) except metadata, which the CRD leaves open."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if "properties" in node:
        out["properties"] = {
            key: to_json_schema(child, root=False) if not (root and key == "metadata") else child
            for key, child in node["properties"].items()
        }
        out.setdefault("additionalProperties", False)
    if isinstance(node.get("items"), dict):
        out["items"] = to_json_schema(node["items"], root=False)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"], root=False)
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def validator(name: str) -> jsonschema.protocols.Validator:
    schema = to_json_schema(schema_of(load_crd(name)))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_nullable_translation_accepts_null_only_where_nullable() -> None:
    check = validator("checkpoints.strata.dev")
    body = objects.checkpoint_body(report(type="full", base_step=None, requires=[], bits=None))
    assert body["spec"]["baseStep"] is None and body["spec"]["bits"] is None
    check.validate(body)
    body["spec"]["step"] = None
    with pytest.raises(jsonschema.ValidationError):
        check.validate(body)


def test_checkpoint_body_validates_against_crd() -> None:
    body = objects.checkpoint_body(report())
    validator("checkpoints.strata.dev").validate(body)
    assert body["apiVersion"] == "strata.dev/v1alpha1" and body["kind"] == "Checkpoint"
    assert body["metadata"] == {
        "name": "recsys-000000001200",
        "namespace": "default",
        "labels": {JOB_LABEL: "recsys", LATEST_LABEL: "false"},
    }
    spec = body["spec"]
    assert spec["step"] == 1200 and spec["baseStep"] == 1000 and spec["requires"] == [1000]
    assert spec["committedAt"] == "2026-05-28T20:26:40Z"
    assert spec["ranks"][1]["manifestKey"].endswith("rank-1.manifest")
    assert spec["ranks"][0]["encodings"] == {"raw": 3, "rows-diff": 2, "q4": 5}
    assert body["status"]["ranks"] == "2/2" and body["status"]["ready"] is True
    [ready] = body["status"]["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True" and ready["reason"] == "AllRanksCommitted"


def test_checkpoint_says_whether_it_is_reshardable() -> None:
    """A commit report of a step saved through DCP carries ``reshardable``; older sidecars' reports
    lack it (not reshardable)."""
    check = validator("checkpoints.strata.dev")
    body = objects.checkpoint_body(report(reshardable=True))
    check.validate(body)
    assert body["spec"]["reshardable"] is True
    assert objects.checkpoint_body(report())["spec"]["reshardable"] is False
    with pytest.raises(ValueError, match="'reshardable' must be a boolean"):
        objects.checkpoint_body(report(reshardable="yes"))


def test_checkpoint_status_not_ready_until_every_rank_committed() -> None:
    body = objects.checkpoint_body(report(world_size=4))
    validator("checkpoints.strata.dev").validate(body)
    assert body["status"]["ranks"] == "2/4" and body["status"]["ranksCommitted"] == 2
    assert body["status"]["ready"] is False
    assert body["status"]["conditions"][0]["status"] == "False"


def test_set_condition_keeps_transition_time_when_status_unchanged() -> None:
    old = [
        {"type": "Other", "status": "True", "reason": "R", "message": "m", "lastTransitionTime": "x"},
        {
            "type": "Ready",
            "status": "False",
            "reason": "A",
            "message": "a",
            "lastTransitionTime": "2020-01-01T00:00:00Z",
        },
    ]
    same = objects.set_condition(old, "Ready", "False", "B", "b", observed_generation=2)
    assert [c["type"] for c in same] == ["Other", "Ready"]
    assert same[1]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    assert same[1]["reason"] == "B" and same[1]["observedGeneration"] == 2
    assert old[1]["reason"] == "A"  # not mutated
    flipped = objects.set_condition(old, "Ready", "True", "C", "c")
    assert flipped[1]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    added = objects.set_condition([], "Hung", "Unknown", "NoHeartbeat", "")
    assert added[0]["type"] == "Hung" and "observedGeneration" not in added[0]
    with pytest.raises(ValueError, match="status"):
        objects.set_condition([], "Ready", "yes", "R", "m")


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"step": "1200"}, "'step'"),
        ({"step": True}, "'step'"),
        ({"job": None}, "'job'"),
        ({"world_size": 0}, "'world_size'"),
        ({"type": "partial"}, "'type'"),
        ({"base_step": None}, "'base_step'"),  # a diff needs its base
        ({"bits": "4"}, "'bits'"),
        ({"requires": [1000, "x"]}, "'requires[1]'"),
        ({"commit_sha256": "nothex"}, "'commit_sha256'"),
        ({"committed_at": "yesterday"}, "'committed_at'"),
        ({"location": "s3://key:secret@bucket/p/COMMIT"}, "'location'"),
        ({"ranks": [{"rank": 0, "sha256": SHA, "bytes": 1, "encodings": {}}]}, "'ranks[0].manifest_key'"),
        (
            {
                "ranks": [
                    {"rank": 0, "manifest_key": "k", "sha256": SHA, "bytes": 1, "encodings": {"raw": -1}}
                ]
            },
            "'ranks[0].encodings'",
        ),
        ({"kind": "heartbeat"}, "'kind'"),
    ],
)
def test_bad_commit_report_raises_naming_the_key(changes: dict[str, Any], key: str) -> None:
    body = {**report(), **changes}
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        objects.checkpoint_body(body)


@pytest.mark.parametrize("key", ["namespace", "attempt", "generation", "commit_key", "bytes", "ranks"])
def test_missing_commit_report_key_raises_naming_it(key: str) -> None:
    body = report()
    del body[key]
    with pytest.raises(ValueError, match=f"'{key}'"):
        objects.checkpoint_body(body)


def test_checkpoint_name_is_dns1123_and_refuses_long_jobs() -> None:
    assert objects.checkpoint_name("recsys", 1200) == "recsys-000000001200"
    assert objects.checkpoint_name("a" * 240, 0) == "a" * 240 + "-000000000000"
    with pytest.raises(ValueError, match="a" * 241):
        objects.checkpoint_name("a" * 241, 0)
    for bad in ("Recsys", "-x", "x_y", ""):
        with pytest.raises(ValueError, match="DNS-1123"):
            objects.checkpoint_name(bad, 1)
    with pytest.raises(ValueError, match="step"):
        objects.checkpoint_name("recsys", -1)


def test_stratajob_body_validates_against_crd() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "recsys", "uid": "u-1"}}
    body = objects.stratajob_body("default", "recsys", job, max_restarts=5, hang_timeout_seconds=300.0)
    check = validator("stratajobs.strata.dev")
    check.validate(body)
    assert body["metadata"]["name"] == "recsys" and body["metadata"]["namespace"] == "default"
    assert body["spec"] == {
        "workload": {"apiVersion": "batch/v1", "kind": "Job", "name": "recsys", "uid": "u-1"},
        "maxRestarts": 5,
        "hangTimeoutSeconds": 300.0,
    }
    # The full status the operator writes later fits the schema too.
    body["status"] = full_stratajob_status()
    check.validate(body)
    with pytest.raises(ValueError, match="kind"):
        objects.stratajob_body("default", "recsys", {**job, "kind": "Deployment"})
    with pytest.raises(ValueError, match="named after"):
        objects.stratajob_body("default", "other", job)


def full_stratajob_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "run": "r7k2",
        "runMode": "resumed",
        "generation": "r7k2/1",
        "restarts": 1,
        "restartLimit": 5,
        "disruptions": 2,
        "attempt": 3,
        "restoreStep": 1000,
        "latestStep": 1200,
        "latestCheckpoint": "recsys-000000001200",
        "lastFailure": {
            "reason": "PodFailed",
            "message": "rank 1 exited 137 (OOMKilled)",
            "pod": "recsys-1-abcde",
            "time": "2026-05-28T20:20:00Z",
        },
        "pendingRestart": None,
        "resumeFromApplied": None,
        "lastHeartbeat": "2026-05-28T20:26:40Z",
        "conditions": objects.set_condition([], "Ready", "True", "GangRunning", "2/2 ranks running"),
    }


# ---- through the emulated API with the real kubectl --------------------------------------------------


async def create(k8s: K8s, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, created = await call(k8s, "POST", path, body)
    assert status in (200, 201), created
    if "status" in body and created.get("status") != body["status"]:
        # A real apiserver ignores status on create when the status subresource is on.
        status, created = await call(
            k8s, "PATCH", f"{path}/{body['metadata']['name']}/status", {"status": body["status"]}
        )
        assert status == 200, created
    return created


async def install_crds(k8s: K8s) -> None:
    for name in ("checkpoints.strata.dev", "stratajobs.strata.dev"):
        status, body = await call(k8s, "POST", CRD_API, load_crd(name))
        assert status in (200, 201), body


async def make_checkpoints(k8s: K8s) -> dict[str, Any]:
    await install_crds(k8s)
    full = objects.checkpoint_body(
        report(1000, type="full", base_step=None, requires=[], bits=None, bytes=12 * 1024**2)
    )
    diff = objects.checkpoint_body(report(1200))
    diff["metadata"]["labels"][LATEST_LABEL] = "true"
    partial = objects.checkpoint_body(report(1400, world_size=4, requires=[1000]))
    for body in (full, diff, partial):
        await create(k8s, CHECKPOINTS, body)
    status, created = await call(k8s, "GET", f"{CHECKPOINTS}/recsys-000000001200")
    assert status == 200
    await post_event(k8s, created, "CheckpointCommitted", "step 1200 committed by 2/2 ranks (diff on 1000)")
    return created


def rows(listing: str) -> list[list[str]]:
    """kubectl's table as cells, cut at the header's column starts (an empty cell stays "")."""
    header, *lines = listing.rstrip().splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    ends = [*starts[1:], None]
    return [header.split()] + [
        [line[a:b].strip() for a, b in zip(starts, ends, strict=True)] for line in lines
    ]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kubectl_get_checkpoints_prints_columns(k8s: K8s) -> None:
    await make_checkpoints(k8s)
    listing = rows(await kubectl(k8s, "get", "checkpoints"))
    assert listing[0] == [
        "NAME",
        "JOB",
        "STEP",
        "TYPE",
        "BASE",
        "RANKS",
        "BYTES",
        "BITS",
        "READY",
        "RESTORED",
        "AGE",
    ]
    by_name = {row[0]: row for row in listing[1:]}
    assert set(by_name) == {"recsys-000000001000", "recsys-000000001200", "recsys-000000001400"}
    assert by_name["recsys-000000001000"][1:9] == [
        "recsys",
        "1000",
        "full",
        "",
        "2/2",
        str(12 * 1024**2),
        "",
        "True",
    ]
    assert by_name["recsys-000000001200"][1:9] == [
        "recsys",
        "1200",
        "diff",
        "1000",
        "2/2",
        "3145728",
        "4",
        "True",
    ]
    assert by_name["recsys-000000001400"][5] == "2/4" and by_name["recsys-000000001400"][8] == "False"


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kubectl_short_name_category_and_latest_label_select_checkpoints(k8s: K8s) -> None:
    await make_checkpoints(k8s)
    short = rows(await kubectl(k8s, "get", "ckpt"))
    assert [row[0] for row in short[1:]] == [
        "recsys-000000001000",
        "recsys-000000001200",
        "recsys-000000001400",
    ]
    latest = rows(await kubectl(k8s, "get", "ckpt", "-l", f"{JOB_LABEL}=recsys,{LATEST_LABEL}=true"))
    assert [row[0] for row in latest[1:]] == ["recsys-000000001200"]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kubectl_describe_checkpoint_shows_step_manifests_conditions_and_events(k8s: K8s) -> None:
    await make_checkpoints(k8s)
    text = await kubectl(k8s, "describe", "checkpoint", "recsys-000000001200")
    assert "Name:" in text and "recsys-000000001200" in text
    assert "Step:" in text and "1200" in text
    for rank in range(2):
        assert f"prefix/default/recsys/steps/000000001200/a3/rank-{rank}.manifest" in text
    assert "Conditions:" in text and "AllRanksCommitted" in text
    assert "Events:" in text
    assert "CheckpointCommitted" in text and "step 1200 committed by 2/2 ranks" in text


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_kubectl_get_stratajobs_prints_columns(k8s: K8s) -> None:
    await install_crds(k8s)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "recsys", "uid": "u-1"}}
    body = objects.stratajob_body("default", "recsys", job, max_restarts=5)
    body["status"] = full_stratajob_status()
    await create(k8s, STRATAJOBS, body)
    fresh = objects.stratajob_body("default", "ranker", {**job, "metadata": {"name": "ranker"}})
    await create(k8s, STRATAJOBS, fresh)
    listing = rows(await kubectl(k8s, "get", "stratajobs"))
    assert listing[0] == [
        "NAME",
        "WORKLOAD",
        "PHASE",
        "STEP",
        "ATTEMPT",
        "RESTARTS",
        "LIMIT",
        "DISRUPTIONS",
        "LAST-FAILURE",
        "AGE",
    ]
    by_name = {row[0]: row for row in listing[1:]}
    assert by_name["recsys"][1:9] == ["Job", "Running", "1200", "3", "1", "5", "2", "PodFailed"]
    assert by_name["ranker"][1:9] == ["Job", "Pending", "", "", "0", "", "0", ""]
    short = rows(await kubectl(k8s, "get", "sjob"))
    assert {row[0] for row in short[1:]} == {"recsys", "ranker"}
    text = await kubectl(k8s, "describe", "stratajob", "recsys")
    assert "Phase:" in text and "Running" in text and "OOMKilled" in text
