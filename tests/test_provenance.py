"""capsctl/provenance.py: what a result records about where it was produced."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from capsctl.provenance import git_commit, provenance

ROOT = Path(__file__).resolve().parents[1]


def test_the_commit_is_the_checkouts_head() -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("capsctl does not run from a git checkout here")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert git_commit() in (head, f"{head}+dirty")


def test_provenance_names_the_machine_and_versions() -> None:
    import torch

    p = provenance()
    assert p["torch_version"] == torch.__version__ and p["cores"] == os.cpu_count()
    assert p["cpu"] and p["device"]
