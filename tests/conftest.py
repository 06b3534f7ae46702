"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The folder of real datasets from ``$CAPSCTL_DATA`` (CI: ``../shared/data``), or skip."""
    value = os.environ.get("CAPSCTL_DATA", "")
    if not value or not Path(value).is_dir():
        pytest.skip("CAPSCTL_DATA not set or its folder is missing")
    return Path(value)
