"""``strata operator``: run the operator (kopf watches, restart protocol, report endpoint, metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
from typing import Any

EPILOG = """\
The operator watches Jobs and JobSets whose pod template carries the label
strata.dev/checkpoint=enabled, restarts their gangs on failure and writes Checkpoint
and StrataJob objects from the sidecars' reports. It is a start and restart
dependency of gated Jobs: their pods wait (Pending, scheduling gate strata.dev/gang)
until it releases them.

examples:
  strata operator --kubeconfig ~/.kube/config --report-port 8443 --metrics-port 9090
  strata operator --tls-secret strata-tls --tls-service strata-operator \\
    --webhook-configuration strata   # in a pod: the operator manages the CA
  strata operator --tls-cert-file /tls/tls.crt --tls-key-file /tls/tls.key \\
    --tls-ca-file /tls/ca.crt        # in a pod: cert-manager's Secret, mounted
  kubectl get stratajobs; kubectl describe checkpoint recsys-000000001200

injection (the mutating webhook POST /mutate-pods and the validating webhook
POST /validate-workloads share the report endpoint's HTTPS port): with
--sidecar-image and --storage-uri, opted-in pods get the sidecar; without them the
mutating webhook adds only the gang gate.
  strata operator --tls-secret strata-tls --tls-service strata-operator \\
    --webhook-configuration strata --own-namespace strata-system \\
    --sidecar-image ghcr.io/strata-ckpt/strata:0.1.0 --storage-uri s3://ckpt/jobs \\
    --storage-endpoint http://seaweedfs.storage:8333 \\
    --sidecar-report-url https://strata-operator.strata-system.svc:8443
The TLS CA reaches injected sidecars in their pod's annotation strata.dev/report-ca
(read through the downward API), so no object is created in the jobs' namespaces.
"""

log = logging.getLogger("strata.operator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig to use (default: the pod's service account, else $KUBECONFIG or ~/.kube/config)",
    )
    parser.add_argument(
        "--trainer-container",
        help="only this container's exit counts as a training failure (default: any container)",
    )
    parser.add_argument(
        "--fence-margin-seconds",
        type=float,
        default=30.0,
        help="force-delete a pod still Terminating this long past its grace period (default: 30)",
    )
    parser.add_argument(
        "--stuck-grace-seconds",
        type=float,
        default=30.0,
        help="report a pod as stuck (ImagePullBackOff, CreateContainerConfigError, Unschedulable, a "
        "crash-looping sidecar, a gang the Job controller cannot complete) once it has shown that this "
        "long: StrataJob condition Stuck, an Event, strata_operator_stuck_* (default: 30; negative: off)",
    )
    parser.add_argument(
        "--in-place-restart",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("STRATA_IN_PLACE_RESTART", "").lower() in ("1", "true", "yes", "on"),
        help="answer a trainer's crash, error exit or hang by restarting the trainer containers in place "
        "(pods, sidecars and their memory stay): the webhook adds a container restart rule to the "
        "trainers of Job pods (Kubernetes 1.34+ with the ContainerRestartRules feature gate; none where "
        "the API server is older, which would refuse the pod), the "
        "sidecars learn the new generation in the answer to their heartbeat. Falls back to new pods "
        "where it cannot (default: $STRATA_IN_PLACE_RESTART, else off)",
    )
    parser.add_argument(
        "--in-place-timeout-seconds",
        type=float,
        default=60.0,
        help="fall back to new pods when not every rank's sidecar acknowledged an in-place restart "
        "within this many seconds (default: 60, six heartbeats)",
    )
    parser.add_argument(
        "--pod-resync-seconds",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="check the operator's view of the opted-in pods against one LIST of them (per watched "
        "namespace, else cluster-wide) this often, and soon after a watch that expired lists again: "
        "a pod deleted while the watch was down sends no DELETED event, and a gang restart would "
        "wait for it (0: off, the watch only; default: 60)",
    )
    parser.add_argument(
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        metavar="NAMESPACE",
        help="watch only this namespace (repeat for more; default: the whole cluster). With Roles "
        "only, --lift-gates then also stays within them",
    )
    parser.add_argument(
        "--peering",
        help="kopf peering name, needed to run more than one replica (default: standalone)",
    )
    parser.add_argument("--report-host", default="0.0.0.0", help="address of the report endpoint")
    parser.add_argument(
        "--report-port", type=int, default=8443, help="port of the report endpoint (-1: off; default 8443)"
    )
    tls = parser.add_argument_group(
        "TLS of the webhooks and the report endpoint (one of: --tls-secret, or --tls-cert-file with "
        "--tls-key-file; neither: plain HTTP, for tests)"
    )
    tls.add_argument(
        "--tls-secret",
        metavar="NAME",
        help="manage a CA in this Secret of --own-namespace: generate it, rotate it, serve its certificate "
        "and patch the caBundle of --webhook-configuration (the chart's default)",
    )
    tls.add_argument(
        "--tls-service",
        metavar="NAME",
        help="the Service the webhooks and sidecars reach the operator by (the certificate's DNS names)",
    )
    tls.add_argument(
        "--webhook-configuration",
        dest="webhook_configurations",
        action="append",
        default=[],
        metavar="NAME",
        help="Mutating- and ValidatingWebhookConfiguration whose caBundle follows the managed CA "
        "(repeatable)",
    )
    tls.add_argument(
        "--tls-ca-days",
        type=float,
        default=1825,
        help="lifetime of a managed CA in days; a successor joins the bundle with a third of it left and "
        "signs with a sixth left (default 1825)",
    )
    tls.add_argument(
        "--tls-cert-days",
        type=float,
        default=365,
        help="lifetime of the managed serving certificate in days; renewed with a third left (default 365)",
    )
    tls.add_argument(
        "--tls-check-seconds",
        type=float,
        default=300.0,
        help="how often the managed CA, the caBundles and the certificate files are checked (default 300)",
    )
    tls.add_argument(
        "--tls-cert-file",
        help="serve this certificate instead (e.g. cert-manager's tls.crt; reloaded on change)",
    )
    tls.add_argument("--tls-key-file", help="its private key")
    tls.add_argument(
        "--tls-ca-file",
        help="the CA injected sidecars verify the report endpoint with (cert-manager's ca.crt)",
    )
    parser.add_argument(
        "--lift-gates",
        action="store_true",
        help="remove the strata.dev/gang scheduling gate from every pod and exit "
        "(the chart's pre-delete hook: no pod waits for a removed operator); with "
        "--webhook-configuration, first delete that MutatingWebhookConfiguration so no new pod is "
        "gated, and wait for admissions under way",
    )
    inject = parser.add_argument_group("injection (the mutating webhook)")
    inject.add_argument("--sidecar-image", help="image of the injected sidecar (enables the injection)")
    inject.add_argument(
        "--storage-uri",
        "--storage",
        dest="storage",
        help="STRATA_STORAGE of every injected sidecar: s3://bucket/prefix",
    )
    inject.add_argument("--storage-endpoint", default="", help="STRATA_S3_ENDPOINT (default: AWS)")
    inject.add_argument(
        "--sidecar-report-url",
        default="",
        help="the report endpoint as sidecars reach it, https://SERVICE.NAMESPACE.svc:8443 "
        "(default: no reports)",
    )
    inject.add_argument(
        "--shm-size",
        default="2Gi",
        help="sizeLimit of the shared-memory emptyDir; the trainer's memory limit must cover two "
        "segments per rank (default 2Gi)",
    )
    inject.add_argument(
        "--sidecar-resources",
        default=None,
        metavar="JSON",
        help='the sidecar container\'s resources as JSON, e.g. \'{"requests": {"cpu": "250m", "memory": '
        '"512Mi"}, "limits": {"memory": "2Gi"}}\' (default: that)',
    )
    inject.add_argument(
        "--sidecar-user",
        type=_user,
        default=65532,
        metavar="UID|none",
        help="the sidecar's runAsUser (default 65532); none leaves it out, for a platform that assigns "
        "the user (OpenShift's restricted-v2 SCC); runAsNonRoot stays true",
    )
    inject.add_argument(
        "--sidecar-pull-policy",
        default="IfNotPresent",
        choices=("Always", "IfNotPresent", "Never"),
        help="imagePullPolicy of the injected sidecar (default IfNotPresent)",
    )
    inject.add_argument(
        "--own-namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="never inject pods of this namespace, the operator's own (default: $POD_NAMESPACE)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics")
    parser.add_argument(
        "--metrics-port", type=int, default=9090, help="port of /metrics (strata_operator_*; -1: off)"
    )


def _user(text: str) -> int | None:
    if text.strip().lower() in ("none", ""):
        return None
    try:
        uid = int(text)
    except ValueError:
        uid = -1
    if not 0 < uid < 2**31:
        raise argparse.ArgumentTypeError(
            f"expected a non-root user id (1 to 2147483647) or none, got {text!r}"
        )
    return uid


def main(args: argparse.Namespace) -> int:
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if args.tls_secret and args.tls_cert_file:
        raise ValueError("--tls-secret (a CA the operator manages) and --tls-cert-file exclude each other")
    if args.tls_secret and not (args.tls_service and args.own_namespace):
        raise ValueError("--tls-secret needs --tls-service and --own-namespace (or $POD_NAMESPACE)")
    if not (args.tls_ca_days > 0 and args.tls_cert_days > 0):
        raise ValueError(
            f"--tls-ca-days and --tls-cert-days must be > 0, got {args.tls_ca_days:g} and "
            f"{args.tls_cert_days:g}"
        )
    if not args.tls_check_seconds > 0:
        raise ValueError(f"--tls-check-seconds must be > 0, got {args.tls_check_seconds:g}")
    if args.tls_ca_file and not args.tls_cert_file:
        raise ValueError("--tls-ca-file goes with --tls-cert-file")
    if not args.in_place_timeout_seconds > 0:
        raise ValueError(f"--in-place-timeout-seconds must be > 0, got {args.in_place_timeout_seconds:g}")
    if args.fence_margin_seconds < 0:
        raise ValueError(f"--fence-margin-seconds must be >= 0, got {args.fence_margin_seconds}")
    if args.pod_resync_seconds < 0:
        raise ValueError(f"--pod-resync-seconds must be >= 0 (0: off), got {args.pod_resync_seconds:g}")
    if args.lift_gates:
        return _lift_gates(args.kubeconfig, tuple(args.namespaces), tuple(args.webhook_configurations))
    from sidecar.operator.certs import TlsPolicy
    from sidecar.operator.run import OperatorConfig, serve

    inject = _inject_config(args)

    config = OperatorConfig(
        kubeconfig=args.kubeconfig,
        trainer_container=args.trainer_container,
        fence_margin_s=args.fence_margin_seconds,
        stuck_grace_s=args.stuck_grace_seconds,
        in_place_restart=args.in_place_restart,
        in_place_timeout_s=args.in_place_timeout_seconds,
        pod_resync_s=args.pod_resync_seconds,
        peering=args.peering,
        namespaces=tuple(args.namespaces),
        report_host=args.report_host,
        report_port=None if args.report_port < 0 else args.report_port,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_ca_file=args.tls_ca_file,
        tls_secret=args.tls_secret,
        tls_namespace=args.own_namespace,
        tls_service=args.tls_service or "",
        webhook_configurations=tuple(args.webhook_configurations),
        tls_check_s=args.tls_check_seconds,
        tls_policy=TlsPolicy(
            ca_validity=datetime.timedelta(days=args.tls_ca_days),
            cert_validity=datetime.timedelta(days=args.tls_cert_days),
        ),
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        inject=inject,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        async with serve(config) as operator:
            # kopf installs its own SIGINT/SIGTERM handlers when it starts (replacing those above):
            # take them back, or a SIGTERM stops kopf but never this process.
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            log.info("watching; reports at %s", operator.report_url)
            await stop.wait()
        log.info("stopped")

    asyncio.run(run())
    return 0


def _inject_config(args: argparse.Namespace) -> Any:
    from sidecar.operator.inject import InjectConfig

    if bool(args.sidecar_image) != bool(args.storage):
        raise ValueError("--sidecar-image and --storage-uri go together (both enable the injection)")
    if not args.sidecar_image:
        return None
    extra: dict[str, Any] = {}
    if args.sidecar_resources:
        try:
            resources = json.loads(args.sidecar_resources)
        except ValueError as exc:
            raise ValueError(f"--sidecar-resources is not JSON: {exc}") from None
        if not isinstance(resources, dict) or set(resources) - {"requests", "limits"}:
            raise ValueError("--sidecar-resources must be an object with requests and/or limits")
        extra["resources"] = resources
    return InjectConfig(
        image=args.sidecar_image,
        storage_uri=args.storage,
        storage_endpoint=args.storage_endpoint,
        report_url=args.sidecar_report_url,
        shm_size=args.shm_size,
        own_namespace=args.own_namespace,
        run_as_user=args.sidecar_user,
        image_pull_policy=args.sidecar_pull_policy,
        in_place_restart=args.in_place_restart,
        trainer_container=args.trainer_container or None,
        **extra,
    )


def _lift_gates(
    kubeconfig: str | None, namespaces: tuple[str, ...] = (), webhook_configurations: tuple[str, ...] = ()
) -> int:
    from sidecar.operator.kube import Api
    from sidecar.operator.uninstall import uninstall

    async def run() -> list[str]:
        api = Api.from_config(kubeconfig)
        try:
            return await uninstall(api, namespaces, webhook_configurations)
        finally:
            await api.close()

    released = asyncio.run(run())
    for name in released:
        print(f"released {name}")
    print(f"lifted the strata.dev/gang gate from {len(released)} pod(s)")
    return 0
