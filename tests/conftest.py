"""Fixtures shared by every test directory: one SeaweedFS per session, a fresh
bucket per test, and short temporary directories for unix sockets."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.local.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A real S3 server for the whole session, started lazily by the first test that asks."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    # Test data is disposable: do not wait out weed's slow graceful shutdown.
    server.stop(timeout=1.0)


@pytest.fixture
def s3_store_url(seaweed: SeaweedServer) -> tuple[str, str]:
    """(url, endpoint): `s3://<fresh bucket>/<prefix>` on the session's SeaweedFS."""
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    seaweed.create_bucket(bucket)
    return f"s3://{bucket}/strata", seaweed.endpoint


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: unix socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
