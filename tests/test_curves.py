"""Training curves: reading metrics.jsonl, plot pictures, TensorBoard scalars, eval --csv."""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

from capsctl import curves
from capsctl.cli import main
from capsctl.curves import (
    TensorBoardLogger,
    plot_runs,
    read_history,
    resolve_metrics,
    write_run_curves,
)
from capsctl.errors import CapsctlError, UsageError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MATPLOTLIB_MODULES = (
    "matplotlib",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "matplotlib.lines",
    "matplotlib.ticker",
)


def record(epoch: int, scale: float = 1.0, val: bool = True) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "epoch": epoch,
        "train_loss": scale * 2.0 / epoch,
        "train_accuracy": min(0.99, 0.2 * epoch / scale),
        "lr": 0.1 * scale / epoch,
        "epoch_seconds": 1.5,
        "images_per_s": 1000.0 * epoch,
        "forward_seconds": 0.5,
        "grad_norm_mean": 3.0 / epoch,
        "grad_norm_max": 5.0 / epoch,
    }
    if val:
        rec.update(
            val_loss=scale * 2.2 / epoch,
            val_accuracy=min(0.99, 0.18 * epoch / scale),
            val_top5=min(1.0, 0.5 + 0.1 * epoch),
        )
    rec["best"] = True
    return rec


def write_run(root: Path, name: str, epochs: int = 4, scale: float = 1.0, val: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    lines = [json.dumps(record(e, scale, val)) + "\n" for e in range(1, epochs + 1)]
    (folder / "metrics.jsonl").write_text("".join(lines))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def colour_pixels(path: Path, rgb: tuple[int, int, int]) -> int:
    """How many pixels are within a small distance of ``rgb`` (0..255)."""
    image = pytest.importorskip("matplotlib.image").imread(path)
    import numpy as np

    target = np.array(rgb, dtype=float) / 255.0
    return int((np.abs(image[..., :3] - target).max(-1) < 0.06).sum())


BLUE = (0x1F, 0x77, 0xB4)  # matplotlib's C0
ORANGE = (0xFF, 0x7F, 0x0E)  # C1
GREEN = (0x2C, 0xA0, 0x2C)  # C2


# --------------------------------------------------------------------------------------------
# read_history


def test_metrics_file_name_matches_the_trainer() -> None:
    from capsctl.training.run_folder import METRICS

    assert curves.METRICS_FILE == METRICS


def test_read_history_skips_a_cut_last_line(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "a", epochs=3)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"epoch": 4, "train_loss": 0.')  # killed while writing
    history = read_history(run_dir)
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert history[0]["train_loss"] == pytest.approx(2.0)
    # the file itself may be passed too
    assert read_history(run_dir / "metrics.jsonl") == history


def test_read_history_damaged_middle_line(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "a", epochs=3)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CapsctlError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_history(run_dir)


def test_read_history_rejects_a_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "other.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(CapsctlError, match="line 1 is not an epoch record"):
        read_history(path)


def test_read_history_sorts_and_keeps_the_later_duplicate(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    folder.mkdir()
    lines = [record(2), record(1), {**record(2), "train_loss": 0.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    history = read_history(folder)
    assert [r["epoch"] for r in history] == [1, 2]
    assert history[1]["train_loss"] == 0.5


def test_read_history_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(CapsctlError, match="has no metrics.jsonl; train it first") as info:
        read_history(tmp_path)
    assert str(tmp_path) in str(info.value) and "capsctl train" in str(info.value)
    assert not isinstance(info.value, UsageError)
    with pytest.raises(UsageError, match="no such folder"):
        read_history(tmp_path / "nowhere")


def test_empty_metrics_file_is_no_history(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("")
    assert read_history(folder) == []


# --------------------------------------------------------------------------------------------
# metric names


def test_resolve_metrics() -> None:
    assert resolve_metrics() == ["train_loss", "val_loss", "train_accuracy", "val_accuracy", "lr"]
    assert resolve_metrics(["lr", "val_accuracy"]) == ["val_accuracy", "lr"]
    assert resolve_metrics(["val_accuracy,lr"]) == ["val_accuracy", "lr"]
    assert resolve_metrics(["accuracy", "val_top5"]) == [
        "train_accuracy",
        "val_accuracy",
        "val_top5",
    ]
    assert resolve_metrics(["loss"]) == ["train_loss", "val_loss"]
    assert resolve_metrics(["grad_norm"]) == ["grad_norm_mean", "grad_norm_max"]
    with pytest.raises(UsageError) as info:
        resolve_metrics(["val_acc"])
    message = str(info.value)
    assert "unknown metric 'val_acc'" in message
    for name in ("loss", "accuracy", "val_accuracy", "val_top5", "lr", "images_per_s", "grad_norm"):
        assert name in message


# --------------------------------------------------------------------------------------------
# pictures


def test_plot_one_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    events: list[dict] = []
    out = plot_runs([run_dir], tmp_path / "pics" / "one.png", on_event=events.append)
    assert out == tmp_path / "pics" / "one.png"
    width, height = png_size(out)
    assert 1000 <= width <= 2000 and 250 <= height <= 600  # three panels side by side
    assert events == [{"event": "plot_run", "name": "one", "path": str(run_dir), "epochs": 4}]
    # one run: train curves blue, val curves orange
    assert colour_pixels(out, BLUE) > 50 and colour_pixels(out, ORANGE) > 50
    assert not list((tmp_path / "pics").glob(".*"))  # no temporary file left behind


def test_plot_two_runs_share_axes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path, "a", epochs=4)
    b = write_run(tmp_path, "b", epochs=6, scale=1.5)
    one = plot_runs([a], tmp_path / "one.png")
    two = plot_runs([a, b], tmp_path / "two.png")
    w1, h1 = png_size(one)
    w2, h2 = png_size(two)
    assert w2 == w1 and h2 > h1  # same panels; the figure legend of the runs below them
    assert colour_pixels(two, BLUE) > 50 and colour_pixels(two, ORANGE) > 50


def test_runs_with_the_same_folder_name_get_their_paths(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "x", "run")
    b = write_run(tmp_path / "y", "run")
    events: list[dict] = []
    plot_runs([a, b], tmp_path / "two.png", on_event=events.append)
    assert [e["name"] for e in events] == [str(a), str(b)]


def test_metrics_choose_the_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    three = plot_runs([run_dir], tmp_path / "three.png")
    single = plot_runs([run_dir], tmp_path / "single.png", ["val_accuracy"])
    five = plot_runs([run_dir], tmp_path / "five.png", ["loss", "accuracy", "lr", "images_per_s"])
    assert png_size(single)[0] < png_size(three)[0] / 2
    assert png_size(five)[1] > 1.5 * png_size(three)[1]  # two rows of panels
    with_top5 = plot_runs([run_dir], tmp_path / "top5.png", ["accuracy", "val_top5"])
    assert colour_pixels(with_top5, GREEN) > 20 and colour_pixels(three, GREEN) == 0
    four = plot_runs([run_dir], tmp_path / "four.png", ["loss", "accuracy", "lr", "grad_norm"])
    assert png_size(four)[1] > 1.5 * png_size(three)[1]  # the gradient norm's panel is drawn


def test_run_without_validation(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "noval", val=False)
    png_size(plot_runs([run_dir], tmp_path / "noval.png"))
    with pytest.raises(CapsctlError, match="no run records val_accuracy"):
        plot_runs([run_dir], tmp_path / "x.png", ["val_accuracy"])
    assert not (tmp_path / "x.png").exists()


def test_svg_and_bad_suffix(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    svg = plot_runs([run_dir], tmp_path / "c.svg")
    assert b"<svg" in svg.read_bytes()[:2000]
    with pytest.raises(UsageError, match=r"\.png, \.svg or \.pdf"):
        plot_runs([run_dir], tmp_path / "c.jpg")


def test_no_finished_epoch_is_an_error(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("")
    with pytest.raises(CapsctlError, match="no finished epoch"):
        plot_runs([folder], tmp_path / "x.png")
    assert write_run_curves(folder) is None
    assert not (folder / "curves.png").exists()


def test_write_run_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "r")
    path = write_run_curves(run_dir)
    assert path == run_dir / "curves.png"
    png_size(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_run_curves(empty) is None


def test_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = write_run(tmp_path, "r")
    for name in MATPLOTLIB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(CapsctlError, match=r"pip install 'capsctl\[plot\]'"):
        plot_runs([run_dir], tmp_path / "x.png")
    assert write_run_curves(run_dir) is None
    assert not (run_dir / "curves.png").exists()


# --------------------------------------------------------------------------------------------
# command line


def test_plot_cli_default_out_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "r")
    code, out, _ = run_cli(capsys, ["plot", str(run_dir), "--metric", "val_accuracy", "-m", "lr"])
    assert code == 0 and "wrote curves.png" in out  # the current folder: the run keeps its own
    png_size(Path("curves.png"))
    assert not (run_dir / "curves.png").exists()


def test_plot_cli_two_runs_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path, "a")
    b = write_run(tmp_path, "b", epochs=2)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # several runs: the default --out is ./curves.png
    code, out, _ = run_cli(capsys, ["plot", str(a), str(b), "--json"])
    assert code == 0
    doc = json.loads(out)
    assert doc["out"] == "curves.png"
    assert [(r["name"], r["epochs"]) for r in doc["runs"]] == [("a", 4), ("b", 2)]
    png_size(work / "curves.png")


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--metric", "accuracy5"], 2, "unknown metric 'accuracy5'; choose from loss, accuracy"),
        (["--out", "x.gif"], 2, "must end in .png, .svg or .pdf"),
    ],
)
def test_plot_cli_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int, needle: str
) -> None:
    run_dir = write_run(tmp_path, "r")
    got, out, err = run_cli(capsys, ["plot", str(run_dir), *args])
    assert got == code and needle in err and out == ""
    assert len(err.strip().splitlines()) == 1


def test_plot_cli_missing_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    code, _, err = run_cli(capsys, ["plot", str(tmp_path)])
    assert code == 1 and "has no metrics.jsonl" in err and "capsctl train" in err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# TensorBoard


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    acc = event_accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with TensorBoardLogger(tmp_path / "run") as tb:
        tb.log_epoch(record(1))
        tb.log_epoch({**record(2, val=False), "best": False})
    tb.close()  # a second close does nothing
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    got = _scalars(tmp_path / "run")
    assert set(got) == {
        "loss/train",
        "loss/val",
        "accuracy/train",
        "accuracy/val",
        "accuracy/val_top5",
        "lr",
        "speed/images_per_s",
        "speed/epoch_seconds",
        "time/forward",
        "grad_norm/mean",
        "grad_norm/max",
    }
    assert got["loss/train"] == [(1, pytest.approx(2.0)), (2, pytest.approx(1.0))]
    assert got["lr"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.05))]
    assert got["accuracy/val"] == [(1, pytest.approx(0.18))]  # epoch 2 had no validation
    with pytest.raises(CapsctlError, match="already closed"):
        tb.log_epoch(record(3))


def test_tensorboard_resume_hides_later_epochs(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with TensorBoardLogger(tmp_path) as tb:
        for epoch in (1, 2, 3):
            tb.log_epoch({"epoch": epoch, "train_loss": 10.0 + epoch})
    with TensorBoardLogger(tmp_path, resume_epoch=1) as tb:
        tb.log_epoch({"epoch": 2, "train_loss": 2.0})
    assert _scalars(tmp_path)["loss/train"] == [(1, 11.0), (2, 2.0)]


def test_without_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(CapsctlError, match=r"pip install 'capsctl\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)


# --------------------------------------------------------------------------------------------
# a real (tiny) run: curves and eval --csv


@pytest.fixture(scope="module")
def tiny_run(tiny_trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's tiny run (tests/conftest.py) resumed for a second epoch: two
    epochs of curves."""
    out = tmp_path_factory.mktemp("run") / "run"
    shutil.copytree(tiny_trained_run, out)
    main(["train", "--resume", str(out / "last.safetensors"), "--epochs", "2", "--json"])
    return out


def test_plot_a_real_run(tiny_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    history = read_history(tiny_run)
    assert [r["epoch"] for r in history] == [1, 2]
    assert {"train_loss", "val_loss", "train_accuracy", "val_accuracy", "lr"} <= set(history[0])
    events: list[dict] = []
    plot_runs([tiny_run, tiny_run / "metrics.jsonl"], tmp_path / "real.png", None, events.append)
    assert [e["epochs"] for e in events] == [2, 2]
    png_size(tmp_path / "real.png")


EVAL_HEADER = (
    "model,img_size,top1,top1_err,top5,top5_err,param_count,"
    "checkpoint,epoch,split,dataset,count,loss,loss_name,metric,images_per_s,params"
)


def test_eval_csv(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(tiny_run / "best.safetensors")
    code, out, err = run_cli(capsys, ["eval", ckpt, "--csv", "--device", "cpu", "--split", "val"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == EVAL_HEADER and len(lines) == 2
    row = next(csv.DictReader(io.StringIO(out)))
    code, js, _ = run_cli(capsys, ["eval", ckpt, "--json", "--device", "cpu", "--split", "val"])
    doc = json.loads(js)
    assert row["model"] == "quickstart" and row["img_size"] == "28"
    assert float(row["top1"]) == pytest.approx(100 * doc["accuracy"], abs=1e-4)
    assert float(row["top1"]) + float(row["top1_err"]) == pytest.approx(100.0)
    assert float(row["top5"]) == pytest.approx(100 * doc["top5"], abs=1e-4)
    assert float(row["top5"]) + float(row["top5_err"]) == pytest.approx(100.0)
    params = int(row["params"])
    assert params > 1000 and float(row["param_count"]) == round(params / 1e6, 2)
    assert row["split"] == "val" and row["count"] == "200" and row["checkpoint"] == ckpt
    assert row["epoch"] == str(doc["epoch"]) and row["metric"] == "top-1"
    assert row["loss_name"] == doc["loss_name"] and float(row["loss"]) == pytest.approx(
        doc["loss"], abs=1e-6
    )


def test_eval_csv_and_json_exclude_each_other(
    tiny_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(
        capsys, ["eval", str(tiny_run / "best.safetensors"), "--csv", "--json"]
    )
    assert code == 2 and "--json and --csv exclude each other" in err and out == ""


def test_plot_refuses_an_existing_picture_unless_overwrite(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    out = tmp_path / "mine.png"
    out.write_bytes(PNG_SIGNATURE + b"an earlier picture")
    with pytest.raises(UsageError) as info:
        plot_runs([run_dir], out)
    assert str(out) in str(info.value) and "--overwrite" in str(info.value)
    assert out.read_bytes() == PNG_SIGNATURE + b"an earlier picture"
    assert plot_runs([run_dir], out, overwrite=True) == out
    assert png_size(out)[0] > 0
    default = plot_runs([run_dir])  # curves.png in the current folder, once
    with pytest.raises(UsageError, match="already exists"):
        plot_runs([run_dir])
    assert default == Path("curves.png") and not (run_dir / "curves.png").exists()
    precious = tmp_path / "precious.png"  # not a picture: never replaced, even with overwrite
    precious.write_bytes(b"precious")
    with pytest.raises(UsageError, match="is not a PNG picture"):
        plot_runs([run_dir], precious, overwrite=True)
    assert precious.read_bytes() == b"precious"
    with pytest.raises(UsageError, match="inside the run folder"):
        plot_runs([run_dir], run_dir / "mine.png")


def test_plot_never_replaces_the_metrics_it_reads(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    metrics = run_dir / "metrics.jsonl"
    picture = run_dir / "metrics.png"
    picture.symlink_to(metrics)
    before = metrics.read_bytes()
    with pytest.raises(UsageError) as info:
        plot_runs([run_dir], picture, overwrite=True)
    assert str(metrics) in str(info.value) and "pick another output path" in str(info.value)
    assert metrics.read_bytes() == before


def test_plot_cli_overwrite_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run_dir = write_run(tmp_path, "one")
    out = tmp_path / "c.png"
    out.write_bytes(PNG_SIGNATURE + b"precious")
    code, _, err = run_cli(capsys, ["plot", str(run_dir), "--out", str(out)])
    assert code == 2 and str(out) in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1 and out.read_bytes() == PNG_SIGNATURE + b"precious"
    code, _, err = run_cli(capsys, ["plot", str(run_dir), "--out", str(out), "--overwrite"])
    assert code == 0, err
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_each_curve_of_a_panel_has_its_own_look_for_one_run() -> None:
    """The gradient-norm panel's mean and max (and loss's train and val) differ in colour and
    in line style, for one run as for several."""
    from capsctl.curves.plot import PANELS, _draw_curves

    class Axes:
        def __init__(self) -> None:
            self.lines: list[tuple[str, str]] = []

        def plot(self, xs, ys, **kw) -> None:  # type: ignore[no-untyped-def]
            self.lines.append((kw["color"], kw["linestyle"]))

    history = [
        {"epoch": e, "grad_norm_mean": 1.0, "grad_norm_max": 3.0, "train_loss": 1.0, "val_loss": 1}
        for e in (1, 2)
    ]
    for keys, panel in (
        (["grad_norm_mean", "grad_norm_max"], "grad_norm"),
        (["train_loss", "val_loss"], "loss"),
    ):
        for runs in ([history], [history, history]):
            ax = Axes()
            _draw_curves(ax, runs, keys, PANELS[panel], None, {})
            per_run = [ax.lines[i : i + 2] for i in range(0, len(ax.lines), 2)]
            for a, b in per_run:
                assert a[1] != b[1], (panel, a, b)  # a style per curve
            if len(runs) == 1:
                assert per_run[0][0][0] != per_run[0][1][0], panel  # and a colour per curve
