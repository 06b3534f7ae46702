"""Shipped weights by name: the index, the files, the resolution order and ``capsctl
weights``; every shipped file reproduces its recorded accuracy with ``capsctl eval NAME``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import run_cli

from capsctl.checkpoint.shipped import (
    SHIPPED_DIR,
    ShippedWeights,
    is_shipped_name,
    list_weights,
    shipped_or_path,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS = {
    "name",
    "model",
    "router",
    "dataset",
    "test_set",
    "accuracy",
    "params",
    "bytes",
    "command",
    "commit",
    "source",
}
MAX_BYTES = 20 * 1024 * 1024  # every shipped file together
EMBEDDED = {"fashion-mnist-quickstart"}  # datasets inside the package: no CAPSCTL_DATA needed


def test_the_index_lists_real_files_within_the_size_budget() -> None:
    weights = list_weights()
    assert any(w.name == "quickstart.idpa" for w in weights)
    assert sum(w.path.stat().st_size for w in weights) <= MAX_BYTES
    on_disk = {p.stem for p in SHIPPED_DIR.glob("*.safetensors")}
    assert on_disk == {w.name for w in weights}  # no file without an entry, nor the reverse
    for w in weights:
        assert is_shipped_name(w.name) and w.bytes == w.path.stat().st_size
        assert (ROOT / w.source / "results.json").exists(), w.source
        assert w.command.startswith("capsctl ") and re.match(r"^[0-9a-f]{40}", w.commit)


@pytest.mark.parametrize("w", list_weights(), ids=lambda w: w.name)
def test_eval_of_a_shipped_name_gives_its_recorded_accuracy(
    w: ShippedWeights, capsys: pytest.CaptureFixture[str]
) -> None:
    if not any(w.dataset.startswith(d) for d in EMBEDDED) and not os.environ.get("CAPSCTL_DATA"):
        pytest.skip(f"{w.dataset} needs CAPSCTL_DATA")
    code, out, err = run_cli(capsys, ["eval", w.name, "--json", "--device", "cpu"])
    assert code == 0, err
    assert json.loads(out)["accuracy"] == pytest.approx(w.accuracy, abs=1e-6)


def test_an_existing_path_wins_over_a_shipped_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert shipped_or_path("quickstart.idpa") == SHIPPED_DIR / "quickstart.idpa.safetensors"
    Path("quickstart.idpa").write_bytes(b"x")  # a file of that name in the working folder
    assert shipped_or_path("quickstart.idpa") == Path("quickstart.idpa")
    for other in ("cifar10-caps", "org/model", "missing.name", "runs/x/best.safetensors"):
        assert shipped_or_path(other) == Path(other)  # left to the caller to report


def test_shipped_names_cannot_be_model_or_preset_names() -> None:
    from capsctl.config import list_presets
    from capsctl.registry import list_models

    names = [*list_models(), *(n for n, _ in list_presets())]
    assert names and not any(is_shipped_name(n) for n in names)


def test_the_weights_command_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["weights", "--json"])
    assert code == 0, err
    rows = json.loads(out)["weights"]
    assert rows and all(set(r) == KEYS for r in rows)
    code, out, _ = run_cli(capsys, ["weights"])
    assert code == 0 and "quickstart.idpa" in out


@pytest.mark.parametrize(
    "args",
    [
        ["inspect-routing", "quickstart.idpa", "--indices", "0", "--json"],
        ["compare", "quickstart.idpa", "--json"],
        ["robustness", "quickstart.idpa", "--attack", "fgsm", "--eps", "1/255", "--limit", "8"],
        ["export", "quickstart.idpa", "--format", "safetensors", "--out", "q.safetensors"],
    ],
    ids=lambda a: a[0],
)
def test_every_command_that_reads_a_checkpoint_takes_a_shipped_name(
    args: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, args)
    assert code == 0, err


def test_from_pretrained_takes_a_shipped_name() -> None:
    import capsctl

    model = capsctl.from_pretrained("quickstart.idpa")
    assert sum(p.numel() for p in model.parameters()) == 163_185


def test_the_readmes_lines_on_the_shipped_samples_run_from_the_repository_root(
    tmp_path: Path,
) -> None:
    """The README's `Trying the shipped weights` block, run as written from the repository root
    without CAPSCTL_DATA (its --png folder redirected into tmp_path: tests never write into the
    working folder)."""
    import shlex
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Trying the shipped weights", 1)[1].split("```bash", 1)[1]
    lines = [x.split("#")[0].strip() for x in block.split("```", 1)[0].splitlines()]
    lines = [x for x in lines if x.startswith("capsctl ")]
    assert len(lines) >= 3 and any(" predict " in f" {x} " for x in lines)
    env = {k: v for k, v in os.environ.items() if k != "CAPSCTL_DATA"}
    for line in lines:
        words = shlex.split(line.replace("--png routing/", f"--png {tmp_path / 'routing'}"))
        globbed = [sorted(map(str, ROOT.glob(w))) if "*" in w else [w] for w in words]
        expanded = [w for group in globbed for w in group]
        cmd = [sys.executable, "-m", "capsctl", *expanded[1:]]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (line, res.stderr[-2000:])


def test_the_index_lists_the_quickstart_then_each_suite_in_its_members_order() -> None:
    from conftest import load_script

    order = load_script("ship_weights").listing_order
    assert order("quickstart.idpa") < order("cifar10-fast.idpa") < order("cifar10-fast.dynamic")
    assert order("cifar10-fast.em") < order("cifar10-fast.self") < order("cifar10-fast.cnn")
    assert order("cifar10-fast.cnn") < order("multimnist.caps") < order("multimnist.cnn")
    names = [w.name for w in list_weights()]
    assert names == sorted(names, key=order)
