"""``helm uninstall``'s pre-delete hook: lift the gang gate from every opted-in pod, so none waits
for an operator that is going away."""

from __future__ import annotations

import logging
from typing import Any

from sidecar.operator import names
from sidecar.operator.gang import meta_of
from sidecar.operator.kube import Api, ApiError, path

log = logging.getLogger("strata.operator")

__all__ = ["lift_gates"]


async def lift_gates(api: Api, namespaces: tuple[str, ...] = ()) -> list[str]:
    """Remove the ``strata.dev/gang`` gate from every pod that has it (``helm uninstall``'s pre-delete
    hook runs this, so no pod waits for an operator that is going away). Other gates stay. Returns
    the pods released, as namespace/name."""
    selector = {"labelSelector": f"{names.OPT_IN_LABEL}={names.OPT_IN_VALUE}"}
    items: list[dict[str, Any]] = []
    for namespace in namespaces or (None,):  # None: every namespace (a ClusterRole)
        listing = await api.request("GET", path("", "v1", "pods", namespace), params=selector)
        items.extend((listing or {}).get("items") or [])
    released = []
    for pod in items:
        gates = (pod.get("spec") or {}).get("schedulingGates") or []
        positions = [i for i, g in enumerate(gates) if g.get("name") == names.GANG_GATE]
        if not positions:
            continue
        meta = meta_of(pod)
        ops: list[dict[str, Any]] = []
        for i in reversed(positions):  # a test op first: never remove someone else's gate
            ops.append({"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": names.GANG_GATE})
            ops.append({"op": "remove", "path": f"/spec/schedulingGates/{i}"})
        try:
            await api.json_patch(path("", "v1", "pods", str(meta.get("namespace")), str(meta["name"])), ops)
        except ApiError as exc:
            if exc.status in (404, 409, 422):  # gone, or changed meanwhile: the next run sees it
                log.warning("could not lift the gate of %s/%s: %s", meta.get("namespace"), meta["name"], exc)
                continue
            raise
        released.append(f"{meta.get('namespace')}/{meta['name']}")
    return released
