"""The admission webhooks, as aiohttp routes on the operator's HTTPS server (the report endpoint's):

    POST /mutate-pods          AdmissionReview v1: the gang gate and the injection (:mod:`inject`)
    POST /mutate-workloads     AdmissionReview v1: the sidecar's stand-in in Job and JobSet pod
                               templates, so quota counts it (:func:`inject.template_patch`)
    POST /validate-workloads   AdmissionReview v1: :func:`admission.validate_workload`

Why aiohttp and not kopf's admission support: the operator already serves its report endpoint over
HTTPS with aiohttp in the same process, from the chart's certificate, so the webhooks share that
server, port, certificate and NetworkPolicy, where kopf's webhook server would run a second server
with its own certificate handling and (for its auto-configuration) write the webhook configurations
itself, which the chart owns.

A malformed AdmissionReview gets a readable 400 (the API server then applies the webhook's
failurePolicy); a well-formed one always gets 200 with the verdict inside.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from sidecar.operator import admission
from sidecar.operator.inject import (
    Denied,
    InjectConfig,
    Shape,
    inject,
    template_patch,
    warnings,
    workload_problems,
)

__all__ = [
    "MUTATE_PATH",
    "MUTATE_WORKLOADS_PATH",
    "VALIDATE_PATH",
    "Malformed",
    "add_routes",
    "mutate",
    "mutate_workload",
    "read_review",
    "validate",
]

log = logging.getLogger("strata.operator.webhook")

MUTATE_PATH = "/mutate-pods"
VALIDATE_PATH = "/validate-workloads"
MUTATE_WORKLOADS_PATH = "/mutate-workloads"
API_VERSION = "admission.k8s.io/v1"


class Malformed(ValueError):
    """Not an AdmissionReview v1 request."""


def read_review(body: Any) -> Mapping[str, Any]:
    """The ``request`` of an AdmissionReview v1, or :class:`Malformed` saying what is wrong."""
    if not isinstance(body, Mapping):
        raise Malformed("body must be a JSON object (an AdmissionReview)")
    if body.get("apiVersion") != API_VERSION or body.get("kind") != "AdmissionReview":
        raise Malformed(
            f"expected apiVersion {API_VERSION}, kind AdmissionReview; got apiVersion "
            f"{body.get('apiVersion')!r}, kind {body.get('kind')!r}"
        )
    request = body.get("request")
    if not isinstance(request, Mapping):
        raise Malformed('an AdmissionReview request needs a "request" object')
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise Malformed("request.uid must be a non-empty string (the response echoes it)")
    obj = request.get("object")
    if obj is not None and not isinstance(obj, Mapping):
        raise Malformed("request.object must be an object or null")
    return request


def mutate(
    request: Mapping[str, Any], config: InjectConfig | None, shape: Shape | None = None
) -> dict[str, Any]:
    """The AdmissionReview answering a pod request: allowed with a patch, or denied naming why.
    Without ``config`` only the gang gate is added (no injection). ``shape``: the pod's world size
    and rank as its workload says (:func:`inject.workload_shape`)."""
    uid = str(request["uid"])
    pod = request.get("object")
    if request.get("operation", "CREATE") != "CREATE" or not isinstance(pod, Mapping):
        return admission.mutation_response(uid, [])
    if pod.get("kind", "Pod") != "Pod":
        return admission.mutation_response(uid, [])
    namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
    if config is None:
        return admission.mutation_response(uid, admission.mutate_pod(pod))
    try:
        patch = inject(pod, namespace=namespace, config=config, shape=shape)
    except Denied as exc:
        log.info("pod %s/%s denied: %s", namespace, _name(pod), exc)
        return admission.Verdict(False, str(exc)).to_admission_response(uid)
    if patch:
        log.info("pod %s/%s: %d patch operation(s)", namespace, _name(pod), len(patch))
    review = admission.mutation_response(uid, patch)
    found = warnings(pod, namespace=namespace, config=config) if patch else []
    if found:
        review["response"]["warnings"] = found
    return review


def mutate_workload(request: Mapping[str, Any], config: InjectConfig | None) -> dict[str, Any]:
    """The AdmissionReview answering a Job or JobSet CREATE: the sidecar's stand-in in each opted-in
    pod template (none without injection, or on any other operation: a template is immutable)."""
    uid = str(request["uid"])
    obj = request.get("object")
    if config is None or request.get("operation", "CREATE") != "CREATE" or not isinstance(obj, Mapping):
        return admission.mutation_response(uid, [])
    namespace = str(request.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "")
    return admission.mutation_response(uid, template_patch(obj, namespace=namespace, config=config))


#: The kind of the watched opted-in workload holding a name, when it is not ``kind``:
#: (namespace, name, kind) -> "Job", "JobSet" or None.
NameTaken = Callable[[str, str, str], str | None]


def validate(
    request: Mapping[str, Any], config: InjectConfig | None = None, name_taken: NameTaken | None = None
) -> dict[str, Any]:
    """The AdmissionReview answering a Job or JobSet request (denials and warnings). With
    ``config`` (the injection on) a Kueue-managed workload created without the sidecar's stand-in
    in its templates is warned about (:func:`admission.quota_warnings`), and one whose every pod the
    pod webhook would deny for the operator's settings is denied (:func:`inject.workload_problems`).
    With ``name_taken`` an opted-in Job (JobSet) named like a watched opted-in JobSet (Job) is
    denied: the StrataJob and the Checkpoints are keyed by name, the two would share them."""
    obj = request.get("object")
    operation = request.get("operation", "CREATE")
    if operation == "DELETE" or not isinstance(obj, Mapping):
        return admission.Verdict().to_admission_response(str(request["uid"]))
    old = request.get("oldObject") if operation == "UPDATE" else None
    verdict = admission.validate_workload(obj, old if isinstance(old, Mapping) else None)
    namespace = str(request.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "")
    if (
        config is not None
        and operation == "CREATE"
        and not (config.own_namespace and namespace == config.own_namespace)
    ):
        verdict.warnings += admission.quota_warnings(obj)
        denied = workload_problems(obj, config)
        if denied:
            said = [] if verdict.allowed else [verdict.message.removeprefix("Strata: ")]
            verdict.allowed, verdict.message = False, "Strata: " + "; ".join([*said, *denied])
    meta = obj.get("metadata") or {}
    kind = str(obj.get("kind"))
    if (
        name_taken is not None
        and operation == "CREATE"
        and kind in ("Job", "JobSet")
        and meta.get("name")
        and admission.workload_opted_in(obj)
    ):
        other = name_taken(namespace, str(meta["name"]), kind)
        if other is not None:
            said = [] if verdict.allowed else [verdict.message.removeprefix("Strata: ")]
            clash = (
                f"metadata.name: a {other} named {meta['name']!r} is checkpointed in this namespace; "
                f"its StrataJob and Checkpoints are keyed by name, which this {kind} would share: "
                "choose another name"
            )
            verdict.allowed, verdict.message = False, "Strata: " + "; ".join([*said, clash])
    return verdict.to_admission_response(str(request["uid"]))


def _name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("name") or (meta.get("generateName") or "") + "*")


async def _review(request: web.Request) -> Mapping[str, Any] | web.Response:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return web.json_response({"error": f"body is not JSON: {exc}"}, status=400)
    try:
        return read_review(body)
    except Malformed as exc:
        return web.json_response({"error": str(exc)}, status=400)


#: Looks up a pod's :class:`Shape` from its workload: (namespace, pod) -> Shape
ShapeOf = Callable[[str, Mapping[str, Any]], Awaitable[Shape]]


def add_routes(
    app: web.Application,
    config: InjectConfig | None,
    *,
    report_ca: Callable[[], str] | None = None,
    shape_of: ShapeOf | None = None,
    restart_rules: Callable[[], bool] | None = None,
    name_taken: NameTaken | None = None,
) -> None:
    """Serve both webhooks on ``app`` (the report endpoint's application). ``report_ca`` gives the
    CA bundle injected sidecars are told to trust, read at each request: it follows a rotation.
    ``shape_of`` gives a pod's world size and rank from its workload (the operator's controller).
    ``restart_rules`` says whether the API server accepts container restart rules (1.34+, read at
    each request): where it does not, no rule is added, as one would get the pod refused.
    ``name_taken`` denies an opted-in workload whose name a watched one of the other kind holds."""

    async def mutate_pods(request: web.Request) -> web.Response:
        review = await _review(request)
        if isinstance(review, web.Response):
            return review
        current = config
        if config is not None and report_ca is not None:
            current = dataclasses.replace(config, report_ca=report_ca())
        if (
            current is not None
            and current.in_place_restart
            and restart_rules is not None
            and not restart_rules()
        ):
            current = dataclasses.replace(current, in_place_restart=False)
        shape = None
        pod = review.get("object")
        if current is not None and shape_of is not None and isinstance(pod, Mapping):
            namespace = str(review.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
            shape = await shape_of(namespace, pod)
        return web.json_response(mutate(review, current, shape))

    async def mutate_workloads(request: web.Request) -> web.Response:
        review = await _review(request)
        if isinstance(review, web.Response):
            return review
        return web.json_response(mutate_workload(review, config))

    async def validate_workloads(request: web.Request) -> web.Response:
        review = await _review(request)
        if isinstance(review, web.Response):
            return review
        return web.json_response(validate(review, config, name_taken))

    app.router.add_post(MUTATE_PATH, mutate_pods)
    app.router.add_post(MUTATE_WORKLOADS_PATH, mutate_workloads)
    app.router.add_post(VALIDATE_PATH, validate_workloads)
