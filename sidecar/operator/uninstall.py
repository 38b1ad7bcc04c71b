"""``helm uninstall``'s pre-delete hook (``strata operator --lift-gates --webhook-configuration NAME``):
stop the mutating webhook from gating new pods, then release every gated pod.

Lifting the gates alone left pods gated forever: until Helm deletes the MutatingWebhookConfiguration
(after the hook), the webhook keeps adding the ``strata.dev/gang`` gate to every new opted-in pod, and
no operator is left to lift it. So the configuration goes first (the uninstall deletes it anyway); an
admission that had already begun may still gate its pod, so the gates are lifted only once the
webhooks' timeout (and a margin for every apiserver to see the deletion) has passed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from sidecar.operator.controller import lift_gates
from sidecar.operator.kube import Api, ApiError, path

__all__ = ["SETTLE_MARGIN_S", "stop_gating", "uninstall"]

log = logging.getLogger("strata.operator")

#: Added to the webhooks' timeout: the time an apiserver may take to stop calling a deleted webhook.
SETTLE_MARGIN_S = 2.0
#: timeoutSeconds when a webhook sets none (the API's default).
_DEFAULT_TIMEOUT_S = 10.0


async def stop_gating(api: Api, configurations: Iterable[str]) -> float:
    """Delete the MutatingWebhookConfigurations named. Returns how long an admission one of them began
    may still take (their webhooks' longest timeoutSeconds; 0 when none was there to delete)."""
    pending = 0.0
    for name in configurations:
        url = path("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", None, name)
        try:
            found = await api.get(url)
            if found is None or not await api.delete(url):
                continue
        except ApiError as exc:
            if exc.status != 403:
                raise
            # Helm deletes it moments later anyway: lifting the gates matters more than failing here
            log.warning(
                "may not delete MutatingWebhookConfiguration %s (%s): lifting the gates anyway", name, exc
            )
            continue
        timeouts = [float(w.get("timeoutSeconds", _DEFAULT_TIMEOUT_S)) for w in found.get("webhooks") or []]
        pending = max([pending, *timeouts])
        log.info("deleted MutatingWebhookConfiguration %s: no new pod is gated", name)
    return pending


async def uninstall(
    api: Api,
    namespaces: tuple[str, ...] = (),
    webhook_configurations: Iterable[str] = (),
    *,
    settle_s: float | None = None,
) -> list[str]:
    """Stop the gating (:func:`stop_gating`), wait for admissions under way (``settle_s``, default: the
    webhooks' timeout plus :data:`SETTLE_MARGIN_S`), then lift every ``strata.dev/gang`` gate in
    ``namespaces`` (empty: all). Returns the pods released, as namespace/name."""
    pending = await stop_gating(api, webhook_configurations)
    if pending:
        wait = pending + SETTLE_MARGIN_S if settle_s is None else settle_s
        log.info("waiting %.1f s for admissions under way before lifting the gates", wait)
        await asyncio.sleep(wait)
    return await lift_gates(api, namespaces)
