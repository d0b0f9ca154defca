"""Shared fixtures: short temporary folders and a running 3-worker cluster."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Cluster, running_cluster


@pytest.fixture(autouse=True)
def no_api_key_from_the_developer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A $GGML_CLUSTER_API_KEY in the shell that runs the tests would lock their APIs; tests set their own."""
    monkeypatch.delenv("GGML_CLUSTER_API_KEY", raising=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary folder (Unix socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gct-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster3() -> Iterator[Cluster]:
    """A running 3-worker local cluster on the demo model, shared by a module's tests."""
    yield from running_cluster("gc3-", 3)
