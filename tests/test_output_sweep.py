"""Every option that names a path a command writes, found by walking the Typer app (the options
in the ``Outputs`` help panel, :data:`capsctl.cli.app.OUTPUTS`), refuses a path in a run folder
or a suite folder and an existing file of another kind, even with ``--overwrite``: the command
fails with one line on stderr and every file is left as it was. A new command's output option is
swept once it is in the panel and its command has a row in :data:`INVOCATIONS`; a new path
option that is in neither the panel nor :data:`INPUTS` fails
:func:`test_every_path_option_is_an_input_or_an_output`."""

from __future__ import annotations

import os
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import fake_finished_run, run_cli
from tiny import tiny_args

from capsctl.cli import app
from capsctl.cli.app import OUTPUTS
from capsctl.outputs import RUN_MARKERS

# Tiny, so that a regression that lets suite run start costs seconds, not a real training.
SUITE = (
    "name: s\nrecipe: quickstart\nseeds: [0]\ntests: [t1]\nmembers:\n  - name: caps\nset:\n"
    '  - "model.primary_types=4"\n'
    '  - "model.layers=[{kind: conv, types: 4, pose_dim: 16, kernel: 3, stride: 2}]"\n'
    '  - "train.steps_per_epoch=1"\n  - "train.epochs=1"\n  - "train.batch_size=8"\n'
    '  - "train.device=cpu"\n  - "data.val_size=0"\n  - "log.curves=false"\n'
)
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(32)

#: The path options that name what a command reads: (command, parameter).
INPUTS = {
    ("train", "resume"),
    ("eval", "ckpt"),
    ("predict", "ckpt"),
    ("export", "ckpt"),
    ("inspect-routing", "ckpt"),
    ("inspect-routing", "image"),
    ("plot", "runs"),
    ("robustness", "ckpts"),
    ("suite report", "folders"),
    ("suite archive", "folders"),
}


@dataclass(frozen=True)
class World:
    """A checkpoint, a run folder, a suite folder (its suite file too) and a folder of files no
    command writes."""

    ckpt: Path
    run: Path
    suite: Path
    suite_file: Path
    elsewhere: Path


#: A valid invocation of each command that writes, without its output option: the sweep adds
#: ``OPTION TARGET`` (and ``--overwrite`` where the command has it). Several rows sweep several
#: kinds of output behind one option (export's formats).
INVOCATIONS: dict[str, Callable[[World], list[list[str]]]] = {
    "train": lambda w: [["train", "--preset", "quickstart", *tiny_args(1), "--epochs", "1"]],
    "export": lambda w: [
        ["export", str(w.ckpt), "--format", f, "--check-images", "2"]
        for f in ("safetensors", "hf", "onnx", "pt2")
    ],
    "inspect-routing": lambda w: [["inspect-routing", str(w.ckpt), "--random", "2"]],
    "plot": lambda w: [["plot", str(w.run)]],
    "robustness": lambda w: [
        [
            "robustness",
            str(w.ckpt),
            "--attack",
            "fgsm",
            "--eps",
            "8/255",
            "--limit",
            "2",
            "--device",
            "cpu",
        ]  # fmt: skip
    ],
    "suite run": lambda w: [["suite", "run", str(w.suite_file)]],
    "suite tune": lambda w: [["suite", "tune", str(w.suite_file)]],
    "suite report": lambda w: [["suite", "report", str(w.suite), "--no-score"]],
    "suite archive": lambda w: [["suite", "archive", str(w.suite)]],
}


def _commands(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, command in group.commands.items():
        path = f"{prefix} {name}".strip()
        if hasattr(command, "commands"):
            yield from _commands(command, path)
        else:
            yield path, command


def _names_a_path(param: Any) -> bool:
    """Whether the parameter's annotation is a Path (or an optional or list of them)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return annotation is Path or Path in typing.get_args(annotation)


def output_options() -> list[tuple[str, str]]:
    """(command, option) of every parameter in the Outputs help panel."""
    found = []
    for path, command in _commands(typer.main.get_command(app)):
        for param in command.params:
            if getattr(param, "rich_help_panel", None) == OUTPUTS:
                found.append((path, param.opts[0]))
    return found


def test_the_output_options_are_found() -> None:
    found = set(output_options())
    assert {
        ("train", "--out"),
        ("export", "--out"),
        ("inspect-routing", "--dump"),
        ("inspect-routing", "--png"),
        ("plot", "--out"),
        ("robustness", "--png"),
        ("robustness", "--resume-file"),
        ("suite run", "--out"),
        ("suite tune", "--out"),
        ("suite report", "--results"),
        ("suite report", "--png"),
        ("suite archive", "--to"),
    } <= found
    assert {command for command, _ in found} == set(INVOCATIONS)


def test_every_path_option_is_an_input_or_an_output() -> None:
    unknown, seen = [], set()
    for path, command in _commands(typer.main.get_command(app)):
        for param in command.params:
            output = getattr(param, "rich_help_panel", None) == OUTPUTS
            if _names_a_path(param):
                seen.add((path, param.name))
                if not output and (path, param.name) not in INPUTS:
                    unknown.append(f"{path} {param.opts[0]}")
    assert not unknown, f"put these in the {OUTPUTS!r} help panel or in INPUTS: {unknown}"
    assert seen >= INPUTS and ("suite report", "results") in seen  # the annotations were read


def _resumable(path: Path) -> Path:
    """A capsctl checkpoint with training state (what only capsctl train writes)."""
    import torch
    from safetensors.torch import save_file

    tensors = {"model.w": torch.zeros(2), "optim.state.0": torch.ones(2)}
    save_file(tensors, str(path), metadata={"format": "capsctl", "training_state": "{}"})
    return path


@pytest.fixture
def world(tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> World:
    run = fake_finished_run(tmp_path / "run", 10.0, {"t1": (0.75, 200)})
    (run / "preset.yaml").write_text("name: quickstart\n")
    suite = tmp_path / "suite"
    fake_finished_run(suite / "caps" / "seed-0", 10.0, {"t1": (0.75, 200)})
    (suite / "suite.yaml").write_text(SUITE)
    (tmp_path / "s.yaml").write_text(SUITE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "noise.png").write_bytes(os.urandom(256))
    _resumable(elsewhere / "resumable.png")
    (elsewhere / "notes.png").write_text("my notes\n")
    (elsewhere / "picture.csv").write_bytes(PNG)
    (elsewhere / "config.json").write_text('{"architecture": "mine"}')  # not a model folder
    ckpt = tiny_checkpoint(tmp_path / "ckpt" / "tiny.safetensors")
    return World(ckpt, run, suite, tmp_path / "s.yaml", elsewhere)


def targets(w: World, command: str) -> list[Path]:
    """Paths in the run folder and the suite folder (new and existing) and foreign files."""
    inside = [w.run / "new.png", w.run / "plots" / "new.png", *(w.run / m for m in RUN_MARKERS)]
    if command != "train":  # the run folder itself is train --out's own (resume, --overwrite)
        inside.append(w.run)
    inside += [w.suite / p for p in ("new.png", "suite.yaml", "caps/new.png")]
    inside.append(w.suite / "caps" / "seed-0" / "results.json")
    return [*inside, *sorted(w.elsewhere.iterdir())]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in folder.rglob("*")}  # fmt: skip


@pytest.mark.parametrize(("command", "option"), output_options())
def test_an_output_never_lands_in_a_run_and_never_replaces_another_kind(
    command: str,
    option: str,
    world: World,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = typer.main.get_command(app)
    for word in command.split():
        found = found.commands[word]
    overwrite = ["--overwrite"] if "overwrite" in {p.name for p in found.params} else []
    before = snapshot(tmp_path)
    for base in INVOCATIONS[command](world):
        # A model folder replaces a whole folder: one that is not a model folder is foreign.
        folders = [world.elsewhere] if "hf" in base else []
        for target in [*targets(world, command), *folders]:
            code, _, err = run_cli(capsys, [*base, option, str(target), *overwrite])
            said = f"{' '.join(base[:1])} {option} {target}: exit {code}, {err!r}"
            assert code != 0, said
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in err, said
            assert str(target) in lines[0] or str(target.parent) in lines[0], said
            assert snapshot(tmp_path) == before, said
