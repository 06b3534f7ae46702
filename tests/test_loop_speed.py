"""scripts/loop_speed.py: its dry run trains through the real loop, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "loop_speed.py"


def test_dry_run_reports_speed_ratio_and_phase_shares(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "resnet18",
            "cifar10-caps-simple",
            "--dry-run",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2
    assert report["omp_spincount"] == "10000"  # set before torch is imported (capsctl/threads.py)
    ref, caps = report["summary"]
    assert ref["model"] == "resnet18" and ref["vs_ref"] == [1.0, 1.0]
    assert caps["model"] == "cifar10-caps-simple" and caps["steps"] == 2
    for run in report["runs"]:  # the ratio is taken within a repeat
        r = run["cifar10-caps-simple"]["images_per_s"] / run["resnet18"]["images_per_s"]
        assert caps["vs_ref"][0] <= r + 1e-9 and r <= caps["vs_ref"][1] + 1e-9
    for row in report["summary"]:
        assert sum(row["shares"].values()) == pytest.approx(1.0, abs=0.05)
        outside = 1 - row["shares"]["forward"] - row["shares"]["backward"]
        assert row["outside_forward_backward"] == pytest.approx(outside)
    assert "vs resnet18" in res.stdout and "outside f/b" in res.stdout
    assert list(tmp_path.iterdir()) == [out]  # nothing left behind
