"""Fixtures for unit tests of the engine's components: one Shared state over an in-memory store,
its own metrics registry, no shared-memory directory, and a fixed memory budget."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sidecar.config import SidecarSettings
from sidecar.engine.state import Shared
from sidecar.metrics import Metrics
from sidecar.store import open_store
from sidecar.store.base import Store


@pytest.fixture
def make_shared() -> Iterator[Callable[..., Shared]]:
    """``make_shared(store=None, **settings)``: a Shared state (closed at the end of the test);
    pass another's ``store`` for a second sidecar of the same storage."""
    made: list[Shared] = []

    def make(store: Store | None = None, **options: Any) -> Shared:
        options.setdefault("memory_budget", 1 << 30)
        options.setdefault("commit_timeout_s", 5.0)
        settings = SidecarSettings(storage="memory://unit", shm_dir="", **options)
        store = store or open_store(f"memory://engine-{uuid.uuid4().hex}")
        shared = Shared(settings, store, Metrics())
        made.append(shared)
        return shared

    yield make
    for shared in made:
        shared.uploads.shutdown(wait=True)
        shared.segments.close()
