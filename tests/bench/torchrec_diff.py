"""TorchRec diffs (part of the ``torchrec`` section): bytes a diff stores over a full checkpoint's,
for the seeded DLRM of ``tests/fixtures/dlrm.py`` with a ``FusedEmbeddingBagCollection`` (fbgemm's
TBE, its SGD inside backward), through a real sidecar (in this process, file storage).

- ``torchrec_diff_bytes_ratio``: the mean stored bytes of a diff (``--policy consecutive``, one
  interval of training each) over the full checkpoint's, with ``client.track()`` on the model;
  ``torchrec_diff_bytes_ratio_values``: the same training with no tracking (the sidecar compares
  every row by value). Both should be about the fraction of rows changed per interval
  (``torchrec_rows_changed_fraction``, measured from the diffs) plus the row indices: tracking
  finds the same rows, without reading the others (spot checks aside).
- ``torchrec_diff_bytes_ratio_after_4bit_restore``: ``--quantize 4 --policy one-shot``: the
  diff written after a restore from memory (the tables come back dequantized) over the full
  checkpoint; the rows changed since the full one are ``..._rows_changed_fraction_after_...``.
  Comparing with the exact bytes held instead of what was restored stored every row (~1.0).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from tests.bench.common import Options, Phases, Row

KEYS = (
    "torchrec_diff_bytes_ratio",
    "torchrec_diff_bytes_ratio_values",
    "torchrec_rows_changed_fraction",
    "torchrec_diff_bytes_ratio_after_4bit_restore",
    "torchrec_rows_changed_fraction_after_4bit_restore",
)


def measure(opts: Options, phases: Phases) -> tuple[dict[str, float], list[Row]]:
    """Figures (``KEYS``) and their table rows."""
    import warnings

    with warnings.catch_warnings():  # fbgemm-gpu-cpu warns on import of GPU-only lookups it lacks
        warnings.simplefilter("ignore", DeprecationWarning)
        from tests.fixtures import dlrm

    if opts.quick:
        shape = dlrm.Shape(tables=2, rows=20_000, dim=16, batch=256)
    else:
        shape = dlrm.Shape(tables=4, rows=100_000, dim=32, batch=1024)
    steps = 4  # training steps per interval between saves
    figures: dict[str, float] = {}
    with phases("torchrec diffs: tracked and by value"):
        for tracked in (True, False):
            ratio, changed = _consecutive(opts.tmp, dlrm, shape, steps, tracked)
            figures["torchrec_diff_bytes_ratio" if tracked else "torchrec_diff_bytes_ratio_values"] = ratio
            if tracked:
                figures["torchrec_rows_changed_fraction"] = changed
    with phases("torchrec diff after a 4-bit restore"):
        ratio, changed = _after_restore(opts.tmp, dlrm, shape, steps)
        figures["torchrec_diff_bytes_ratio_after_4bit_restore"] = ratio
        figures["torchrec_rows_changed_fraction_after_4bit_restore"] = changed
    return figures, rows(figures)


def rows(f: dict[str, Any]) -> list[Row]:
    def get(key: str) -> float | None:
        v = f.get(key)
        return float(v) if isinstance(v, int | float) else None

    tracked, values = get("torchrec_diff_bytes_ratio"), get("torchrec_diff_bytes_ratio_values")
    after = get("torchrec_diff_bytes_ratio_after_4bit_restore")
    since = get("torchrec_rows_changed_fraction_after_4bit_restore")
    return [
        Row("torchrec_rows_changed_fraction", get("torchrec_rows_changed_fraction"), ""),
        Row(
            "torchrec_diff_bytes_ratio",
            tracked,
            "",
            None if tracked is None or not values else tracked / values,
            "by value",
            "~ rows changed",
        ),
        Row("torchrec_diff_bytes_ratio_values", values, ""),
        Row("torchrec_rows_changed_fraction_after_4bit_restore", since, ""),
        Row(
            "torchrec_diff_bytes_ratio_after_4bit_restore",
            after,
            "",
            None,
            "",
            "< 0.5",
            None if after is None else after < 0.5,
        ),
    ]


def _sidecar(tmp: Path, **settings: Any) -> Any:
    from sidecar.config import SidecarSettings
    from sidecar.server import SidecarServer

    sock = str(tmp / f"trec-{uuid.uuid4().hex[:8]}.sock")
    options = {"storage": f"file://{tmp}/store", "socket": sock, "metrics_port": 0, "keep": 0, **settings}
    return SidecarServer(SidecarSettings(**options)).start()


def _manifest(server: Any, job: str, step: int) -> Any:
    from sidecar import manifest as mf

    return mf.load_manifest(server.store, mf.read_commit(server.store, "default", job, step), 0)


def _stored(m: Any) -> int:
    return sum(o.size for o in m.objects)


def _changed_fraction(m: Any, shape: Any) -> float:
    tables = [t for t in m.tensors if ".embedding_bags." in t.name and t.name.startswith("model.")]
    return sum(t.changed_rows for t in tables) / (shape.tables * shape.rows)


def _consecutive(tmp: Path, dlrm: Any, shape: Any, steps: int, tracked: bool) -> tuple[float, float]:
    """(mean diff bytes / full bytes, mean fraction of table rows changed per interval)."""
    from trainer_client import CheckpointClient

    server = _sidecar(tmp, policy="consecutive")
    job = f"trec-{'tracked' if tracked else 'values'}"
    client = CheckpointClient(job=job, socket=server.socket_path, capture_rng=False, resume="never")
    try:
        model, opt = dlrm.build("fused", shape)
        if tracked and len(client.track(model, optimizer=opt)) != shape.tables:
            raise RuntimeError("the tables of the fused DLRM were not tracked")
        state = dlrm.state_of(model, opt)
        client.save(0, state).durable.result(300)
        saves = 3
        for i in range(1, saves + 1):
            for s in range(steps):
                dlrm.train_step(model, opt, dlrm.batch(shape, 0, i * steps + s))
            client.save(i, state).durable.result(300)
        full = _stored(_manifest(server, job, 0))
        diffs = [_manifest(server, job, i) for i in range(1, saves + 1)]
        if any(m.checkpoint != "diff" for m in diffs):
            raise RuntimeError(f"{job}: expected diffs, got {[m.checkpoint for m in diffs]}")
        if tracked:
            tables = [t for m in diffs for t in m.tensors if ".embedding_bags." in t.name]
            how = {t.tracking.split(" (")[0] for t in tables}
            if how != {"lookups"}:
                raise RuntimeError(f"{job}: tables diffed by {how}, not by lookups")
        ratio = sum(_stored(m) for m in diffs) / len(diffs) / full
        changed = sum(_changed_fraction(m, shape) for m in diffs) / len(diffs)
        print(f"     {job}: full {full} B, diffs {[_stored(m) for m in diffs]} B", flush=True)
        return ratio, changed
    finally:
        client.close()
        server.stop(grace=5)


def _after_restore(tmp: Path, dlrm: Any, shape: Any, steps: int) -> tuple[float, float]:
    from trainer_client import CheckpointClient

    server = _sidecar(tmp, policy="one-shot", quantize="4", restore_class="stored")  # comes back decoded
    job = "trec-restored"
    client = CheckpointClient(job=job, socket=server.socket_path, capture_rng=False, resume="never")
    try:
        model, opt = dlrm.build("fused", shape)
        state = dlrm.state_of(model, opt)
        client.save(0, state).durable.result(300)
        for step in (1, 2):
            for s in range(steps):
                dlrm.train_step(model, opt, dlrm.batch(shape, 0, step * steps + s))
            client.save(step, state).durable.result(300)
            if step == 1:
                client.restore(state)
                if client.last_restore["source"] != "memory":
                    logging.warning("torchrec bench: the restore came from %s", client.last_restore["source"])
        m = _manifest(server, job, 2)
        if m.checkpoint != "diff":
            raise RuntimeError(f"{job}: step 2 is {m.checkpoint}, not a diff")
        return _stored(m) / _stored(_manifest(server, job, 0)), _changed_fraction(m, shape)
    finally:
        client.close()
        server.stop(grace=5)
