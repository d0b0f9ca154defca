"""Shared fixtures: short temporary folders and a running 3-worker cluster."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Cluster, running_cluster


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
