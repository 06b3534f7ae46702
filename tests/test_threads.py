"""capsctl/threads.py: GNU OpenMP's idle threads told to spin briefly, before torch loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_OWN = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "CAPSCTL_OMP_SPIN")


def _run(code: str, **env: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (no torch yet) and return the JSON it prints last."""
    base = {k: v for k, v in os.environ.items() if k not in _OWN}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


_APPLY = """
import json, os, sys
from capsctl.threads import short_omp_spin
{before}
applied = short_omp_spin()
import torch
torch.zeros(1)
print(json.dumps({{"applied": applied, "spin": os.environ.get("GOMP_SPINCOUNT"),
                   "policy": os.environ.get("OMP_WAIT_POLICY")}}))
"""


def test_sets_a_short_spin_before_torch_is_imported() -> None:
    got = _run(_APPLY.format(before=""))
    assert got == {"applied": True, "spin": "10000", "policy": None}


def test_too_late_once_torch_is_imported() -> None:
    got = _run(_APPLY.format(before="import torch"))
    assert got == {"applied": False, "spin": None, "policy": None}


@pytest.mark.parametrize(
    ("env", "spin", "policy"),
    [
        ({"GOMP_SPINCOUNT": "123"}, "123", None),
        ({"OMP_WAIT_POLICY": "passive"}, None, "passive"),
        ({"CAPSCTL_OMP_SPIN": "0"}, None, None),
    ],
)
def test_the_users_settings_win(env: dict[str, str], spin: str | None, policy: str | None) -> None:
    got = _run(_APPLY.format(before=""), **env)
    assert got == {"applied": False, "spin": spin, "policy": policy}


def test_the_command_applies_it_before_importing_torch() -> None:
    # the setting is refused once torch is imported, so "10000" at the end means it came first
    code = (
        "import contextlib, io, json, os\n"
        "from capsctl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['bench', 'mnist-caps', '--batch-size', '2', '--iters', '1', '--warmup', '0',"
        " '--train'])\n"
        "import sys\n"
        "print(json.dumps({'spin': os.environ.get('GOMP_SPINCOUNT'),"
        " 'torch': 'torch' in sys.modules}))\n"
    )
    assert _run(code) == {"spin": "10000", "torch": True}
