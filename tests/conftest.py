"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The folder of real datasets from ``$CAPSCTL_DATA`` (CI: ``../shared/data``), or skip."""
    value = os.environ.get("CAPSCTL_DATA", "")
    if not value or not Path(value).is_dir():
        pytest.skip("CAPSCTL_DATA not set or its folder is missing")
    return Path(value)


@pytest.fixture(autouse=True)
def _run_in_an_empty_folder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test runs in a fresh empty working folder: nothing a test writes by default (such
    as ``runs/<preset>``) lands in the checkout, and nothing left there can change a result."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def eager_routing() -> Iterator[None]:
    """Run the routed and weighted passes as torch code (not the compiled loops of
    capsctl/layers/native.py), for tests of the chunked passes' own tiles and threads."""
    from capsctl.layers.native import native_disabled

    with native_disabled():
        yield
