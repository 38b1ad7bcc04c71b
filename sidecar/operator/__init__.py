"""The Kubernetes half of Strata: a kopf operator that watches opted-in training Jobs, restarts
their whole gang on failure, and reflects committed checkpoints as ``Checkpoint`` objects.

Needs the ``operator`` extra (kopf, kubernetes). Never on the commit path: storage and the
sidecars commit; the operator decides restarts and reports state.
"""
