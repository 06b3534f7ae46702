"""The command line end to end on tiny runs: output formats, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from tiny import tiny_args

TINY = [*tiny_args(4), "--epochs", "1"]


def test_help_does_not_import_torch() -> None:
    code = "import sys, capsctl.cli; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
    res = subprocess.run(
        [sys.executable, "-m", "capsctl", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "inspect-routing" in res.stdout


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, ["models", "cifar10-caps*", "--json"])
    assert code == 0
    doc = json.loads(out)
    names = {m["name"]: m for m in doc["models"]}
    assert names["cifar10-caps"]["params"]["total"] == 1_828_817
    assert names["cifar10-caps-simple"]["params"]["total"] == 492_177


def test_models_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, ["models", "resnet18"])
    assert code == 0 and "11,173,962" in out


def test_presets_lists_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, ["presets", "--json"])
    names = {p["name"] for p in json.loads(out)["presets"]}
    assert {
        "cifar10-caps",
        "cifar10-caps-simple",
        "cifar100-caps",
        "cifar10-resnet18",
        "cifar100-resnet18",
        "mnist-caps",
        "fashion-caps",
        "quickstart",
    } <= names


def test_train_json_and_run_folder(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for f in ("best.safetensors", "last.safetensors", "metrics.jsonl", "preset.yaml"):
        assert (tiny_trained_run / f).exists()
    doc = json.loads((tiny_trained_run / "results.json").read_text())
    assert doc["epochs_done"] == 1 and doc["test"]["count"] == 2000


def test_eval_json_is_the_only_stdout(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(
        capsys, ["eval", str(tiny_trained_run / "best.safetensors"), "--json", "--device", "cpu"]
    )
    assert code == 0
    doc = json.loads(out)  # would fail if anything else were printed on stdout
    assert 0 <= doc["accuracy"] <= 1 and doc["count"] == 2000 and len(doc["confusion"]) == 10


def test_eval_table(tiny_trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        ["eval", str(tiny_trained_run / "best.safetensors"), "--split", "val", "--device", "cpu"],
    )
    assert code == 0 and "top-1" in out and "confusion" in out and "Ankle" in out


def test_resume_continues_a_run(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(tiny_trained_run, run_dir)
    code, out, err = run_cli(
        capsys, ["train", "--resume", str(run_dir / "last.safetensors"), "--epochs", "2", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["epochs_done"] == 2
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["train", "--preset", "nope"], 2, "unknown preset 'nope'"),
        (
            ["train", "--preset", "quickstart", "--set", "train.lr=abc"],
            2,
            "train.lr: expected a number",
        ),
        (["train", "--preset", "quickstart", "--set", "train.bogus=1"], 2, "train.bogus"),
        (["train", "--preset", "quickstart", "--set", "noequals"], 2, "noequals"),
        (["train", "--preset", "quickstart", "--lr", "-1"], 2, "--lr -1: expected a number in (0,"),
        (["train"], 2, "missing --preset"),
        (["eval", "missing.safetensors"], 2, "no such file"),
        (["bench", "nope"], 2, "unknown model 'nope'"),
        (["inspect-routing", "missing.safetensors"], 2, "no such file"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], code: int, needle: str
) -> None:
    got, out, err = run_cli(capsys, [*args])
    assert got == code
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["eval", "{ckpt}", "--batch-size", "0"],
        ["predict", "{ckpt}", "nothere.png"],
        ["bench", "nosuchmodel"],
        ["train", "--preset", "quickstart", "--time-limit", "0m"],
    ],
)
def test_an_error_under_a_progress_bar_is_exactly_one_line_when_piped(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """Off a terminal no progress bar is drawn, and none leaves an empty line behind: stderr is
    the error line alone (a script reading it sees one line)."""
    args = [a.format(ckpt=tiny_checkpoint()) for a in args]
    code, out, err = run_cli(capsys, args)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, repr(err)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, b"\x08\x00\x00\x00\x00\x00\x00\x00{}"])
def test_corrupt_checkpoint_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    code, _, err = run_cli(capsys, ["eval", str(bad)])
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "bad.safetensors" in err


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"x")
    res = subprocess.run(
        [sys.executable, "-m", "capsctl", "--debug", "eval", str(bad)],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_refuses_an_existing_run(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capsys, ["train", "--preset", "quickstart", *TINY, "--out", str(tiny_trained_run)]
    )
    assert code == 2 and "already holds a run" in err


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        [
            "bench",
            "mnist-caps",
            "--batch-size",
            "2",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--routing",
            "sequential",
            "--iterations",
            "3",
            "--json",
        ],
    )
    assert code == 0
    row = json.loads(out)["rows"][0]
    assert row["name"] == "mnist-caps" and row["routing"] == "sequential" and row["iterations"] == 3
    assert (
        row["train_step_s"] > 0
        and row["infer_images_per_s"] > 0
        and row["peak_rss_bytes"] > 10 * 2**20
    )


def test_inspect_routing_json_dump_png(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    dump = tmp_path / "coeffs.safetensors"
    code, out, err = run_cli(
        capsys,
        [
            "inspect-routing",
            str(tiny_trained_run / "best.safetensors"),
            "--indices",
            "0,5",
            "--iterations",
            "3",
            "--routing",
            "sequential",
            "--json",
            "--dump",
            str(dump),
            "--png",
            str(tmp_path / "png"),
        ],
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["iterations"] == 3 and len(doc["layers"]) == 2 and len(doc["images"]) == 2
    assert dump.exists()
    assert len(list((tmp_path / "png").glob("*.png"))) == 2 * 3 + 2


def test_export_safetensors_and_onnx(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "release.safetensors"
    code, out, err = run_cli(
        capsys,
        [
            "export",
            str(tiny_trained_run / "best.safetensors"),
            "--format",
            "safetensors",
            "--out",
            str(out_file),
            "--json",
        ],
    )
    assert code == 0, err
    assert json.loads(out)["max_abs_diff"] == 0.0
    pytest.importorskip("onnxruntime")
    code, out, err = run_cli(
        capsys,
        [
            "export",
            str(tiny_trained_run / "best.safetensors"),
            "--format",
            "onnx",
            "--out",
            str(tmp_path / "m.onnx"),
            "--check-images",
            "5",
            "--json",
        ],
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["max_abs_diff"] <= 1e-4 and "test images" in doc["checked_on"]


def test_export_to_unwritable_path(
    tiny_trained_run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run_cli(
        capsys,
        [
            "export",
            str(tiny_trained_run / "best.safetensors"),
            "--format",
            "safetensors",
            "--out",
            str(tmp_path / "no" / "such" / "dir" / "x.safetensors"),
        ],
    )
    assert code in (1, 2) and len(err.strip().splitlines()) == 1


def test_compare_json_and_suite(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_cli(capsys, ["compare", "caps", "resnet18", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["models"]}
    assert rows["cifar10-caps"]["params"]["total"] == 1_828_817
    assert rows["resnet18"]["params"]["total"] == 11_173_962
    assert any("fewer parameters" in line for line in doc["footer"])
    code, out, _ = run_cli(capsys, ["compare", "caps", "resnet18", "--csv"])
    assert code == 0 and out.splitlines()[0].startswith("name,")

    import capsctl.compare as compare_mod

    seen: list[list[str]] = []
    real = compare_mod.compare

    def spy(specs: list[str], **kw: object):  # noqa: ANN202
        seen.append(list(specs))
        return real(["cifar10-caps-simple"], **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(compare_mod, "compare", spy)
    code, _, err = run_cli(capsys, ["compare", "--suite", "paper", "--json"])
    assert code == 0, err
    assert seen[0] == compare_mod.SUITES["paper"]
    assert {"cifar10-dynamic", "cifar10-em", "cifar100-cnn-simple", "resnet18"} <= set(seen[0])
    code, _, err = run_cli(capsys, ["compare", "--suite", "nope"])
    assert code == 2 and "unknown" in err


@pytest.mark.usefixtures("eager_routing")  # the chunk size is the torch code's (not the loops')
def test_a_bad_chunk_size_in_the_environment_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", "lots")
    code, _, err = run_cli(capsys, ["bench", "mnist-caps", "--batch-size", "2", "--iters", "1"])
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and "CAPSCTL_CHUNK_MIB" in err


def test_export_refuses_an_existing_file_unless_overwrite(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint()
    last = tiny_checkpoint(tmp_path / "release.safetensors")  # weights only: an export's kind
    before = last.read_bytes()
    args = ["export", str(ckpt), "--format", "safetensors", "--out", str(last)]
    code, _, err = run_cli(capsys, [*args])
    assert code == 2 and str(last) in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1 and last.read_bytes() == before
    code, _, err = run_cli(capsys, [*args, "--overwrite"])
    assert code == 0, err
    assert last.read_bytes() != before
    (tmp_path / "run").mkdir()  # a run's checkpoint: never an export's output
    best = tiny_checkpoint(tmp_path / "run" / "best.safetensors")
    before = best.read_bytes()
    code, _, err = run_cli(capsys, [*args[:-1], str(best), "--overwrite"])
    assert code == 2 and str(best) in err and "run folder" in err
    assert best.read_bytes() == before
    code, _, err = run_cli(
        capsys, ["export", str(ckpt), "-f", "safetensors", "-o", str(ckpt), "--overwrite"]
    )
    assert code == 2 and str(ckpt) in err and "pick another output path" in err


# --------------------------------------------------------------------------------------------
# User text is shown verbatim, never read as rich markup (issue 26, finding 6)
# --------------------------------------------------------------------------------------------

BRACKETED_CLASSES = ["[red]cat", "dog[/]", "[/bold]", "a[b]c", *[f"c{i}" for i in range(6)]]


@pytest.mark.parametrize(
    "name", ["x[/].safetensors", "runs/exp[final]/best.safetensors", "[bold]b[/bold].safetensors"]
)
@pytest.mark.parametrize("command", ["eval", "predict", "export"])
def test_bracketed_missing_paths_are_one_verbatim_line(
    capsys: pytest.CaptureFixture[str], name: str, command: str
) -> None:
    args = [command, name, *(["img.png"] if command == "predict" else [])]
    code, _, err = run_cli(capsys, [*args])
    assert code == 2 and f"error: {name}: no such file" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bracketed_paths_and_class_names_show_as_typed(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    image_module = pytest.importorskip("PIL.Image")
    folder = Path("exp[final]")
    folder.mkdir()
    ckpt = tiny_checkpoint(folder / "best[1].safetensors", classes=BRACKETED_CLASSES)
    (Path("imgs[x]")).mkdir()
    image_module.new("L", (28, 28), 128).save("imgs[x]/a[red]b.png")
    code, out, err = run_cli(
        capsys, ["predict", str(ckpt), "imgs[x]", "-k", "10", "--device", "cpu"]
    )
    assert code == 0, err
    assert "exp[final]/best[1].safetensors" in out and "imgs[x]/a[red]b.png" in out
    for name in BRACKETED_CLASSES:
        assert name in out
    code, out, err = run_cli(capsys, ["eval", str(ckpt), "--device", "cpu"])
    assert code == 0, err
    assert out.startswith("exp[final]/best[1].safetensors  epoch 1")
    target = folder / "rel[2].safetensors"
    code, out, err = run_cli(capsys, ["export", str(ckpt), "-f", "safetensors", "-o", str(target)])
    assert code == 0, err
    assert f"wrote {target}" in out and f"{target}.json" in out


def test_error_note_and_warning_lines_show_the_message_verbatim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from capsctl.views.common import error, note
    from capsctl.views.progress import simple_progress

    error("cannot read [bold]x[/bold] or y[/]")
    note("z[/red] is [i]odd")
    with simple_progress("eval") as on_event:
        on_event({"event": "warning", "message": "w[/] and [link]"})
    assert [line for line in capsys.readouterr().err.splitlines() if line] == [
        "error: cannot read [bold]x[/bold] or y[/]",
        "z[/red] is [i]odd",
        "warning: w[/] and [link]",
    ]


# --------------------------------------------------------------------------------------------
# Tables at 80 and 200 columns: numbers never cut (issue 26, finding 8)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def terminal_width(monkeypatch: pytest.MonkeyPatch):
    """Set the width of the stdout console, as a terminal of that many columns would."""
    from capsctl.views.common import out

    def set_width(columns: int) -> None:
        monkeypatch.setattr(out, "width", columns)

    return set_width


@pytest.mark.parametrize("columns", [80, 200])
def test_predict_table_keeps_classes_and_scores_with_long_paths(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str], terminal_width, columns: int
) -> None:
    image_module = pytest.importorskip("PIL.Image")
    folder = Path("data", *[f"deep-folder-{i:02d}" for i in range(5)])
    folder.mkdir(parents=True)
    for i in range(3):
        image_module.new("L", (28, 28), 40 * i).save(folder / f"image-number-{i}.png")
    ckpt = tiny_checkpoint()
    terminal_width(columns)
    code, out, err = run_cli(
        capsys, ["predict", str(ckpt), str(folder), "-k", "2", "--device", "cpu"]
    )
    assert code == 0, err
    lines = out.splitlines()
    assert all(len(line) <= columns for line in lines)
    rows = [line for line in lines if re.search(r"│ [12] │", line)]
    assert len(rows) == 6
    for line in rows:  # class and score are whole in every row
        cells = [c.strip() for c in line.split("│")[1:-1]]
        assert re.fullmatch(r"\d{1,3}\.\d%", cells[3]) and cells[2], line
    for i in range(3):
        shown = f"…/image-number-{i}.png" if columns == 80 else f"{folder}/image-number-{i}.png"
        assert shown in out


@pytest.mark.parametrize("columns", [80, 200])
def test_eval_confusion_table_keeps_every_number_and_class(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str], terminal_width, columns: int
) -> None:
    ckpt = tiny_checkpoint()
    code, out, err = run_cli(capsys, ["eval", str(ckpt), "--device", "cpu", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    terminal_width(columns)
    code, out, err = run_cli(capsys, ["eval", str(ckpt), "--device", "cpu"])
    assert code == 0, err
    lines = out.splitlines()
    assert all(len(line) <= columns for line in lines)
    for name, acc, counts in zip(doc["classes"], doc["per_class"], doc["confusion"], strict=True):
        rows = [line for line in lines if line.startswith(f"│ {name} ")]
        cells = [c.strip() for row in rows for c in row.split("│")[2:-1]]
        assert cells[:2] == [f"{100 * acc:.1f}%", str(sum(counts))], out
        assert cells[2:] == [str(c) for c in counts], rows
    assert "Ankle" in out


# --------------------------------------------------------------------------------------------
# A named pipe is refused, never read (issue 26, finding 10): reading one waits for a writer
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["inspect-routing", "{fifo}", "--random", "2"], "pass a .safetensors file"),
        (["robustness", "{fifo}", "--limit", "4", "--device", "cpu"], "pass a .safetensors file"),
        (["train", "--resume", "{fifo}", "--out", "new-run"], "pass a .safetensors file"),
        (["compare", "{fifo}"], "pass a checkpoint, preset or model folder"),
        (["train", "--preset", "{yaml}"], "pass a preset name or the path of a .yaml file"),
        (["plot", "{run}"], "pass a run folder written by capsctl train"),
    ],
)
def test_a_named_pipe_is_refused_in_one_line_not_read(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = {
        "fifo": tmp_path / "pipe.safetensors",
        "yaml": tmp_path / "pipe.yaml",
        "run": tmp_path / "run",
    }
    paths["run"].mkdir()
    for path in (paths["fifo"], paths["yaml"], paths["run"] / "metrics.jsonl"):
        os.mkfifo(path)
    args = [a.format(**paths) for a in args]

    def stuck(*_: object) -> None:
        raise TimeoutError("the command is reading the named pipe")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)  # without the check, the command waits here for a writer forever
    try:
        code, out, err = run_cli(capsys, args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    (line,) = err.strip().splitlines()
    assert code in (1, 2) and "not a regular file" in line and words in line, err
    assert any(str(p) in line for p in (paths["fifo"], paths["yaml"], paths["run"]))
    assert not Path("new-run").exists()
