"""What produced a result: the capsctl commit (when run from a git checkout), the machine and
the library versions, as results files and robustness measurements record them, and how
loaded the machine was (:func:`machine_load`)."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "git_commit", "machine_load", "provenance"]


@cache
def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@cache
def git_commit() -> str | None:
    """The commit of the checkout capsctl runs from (``+dirty`` when files differ), or None for
    an installed wheel or a machine without git."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "capsctl"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def provenance() -> dict[str, Any]:
    """``{"commit", "capsctl_version", "torch_version", "cpu", "cores", "device"}`` of this
    process."""
    import torch

    from capsctl.version import __version__

    device = "cpu"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {
        "commit": git_commit(),
        "capsctl_version": __version__,
        "torch_version": torch.__version__,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "device": device,
    }


def machine_load() -> dict[str, float]:
    """The machine's load average over the last minute and its CPU count now (``load_1m``,
    ``cpus``), as a training epoch or a benchmarked model ends: a load above the CPUs means
    the work shared the machine, so its seconds are an upper bound. Empty where the system has
    no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return {}
    return {"load_1m": round(load, 2), "cpus": os.cpu_count() or 1}
