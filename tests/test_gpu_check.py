"""scripts/gpu_check.py and scripts/make_gpu_check_data.py: the data that travels to a GPU
machine, the dry run that exercises every part on the CPU (so the script cannot rot), the
summary of the part files and the message on a machine without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"
PARTS = ("warm", "check", "bench", "compile", "train")


def _script(name: str) -> ModuleType:
    return load_script(name)


def _cifar_source(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tiny CIFAR-10 npz folder as the shared one is laid out: two training files (60
    images, 6 a class, shuffled), an exact and a lossy test file. Its training images and
    labels (concatenated) and its exact test images."""
    folder = root / "cifar10"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8)
    labels = rng.permutation(np.repeat(np.arange(10), 6)).astype(np.uint8)
    for i in range(2):
        part = slice(30 * i, 30 * (i + 1))
        np.savez_compressed(folder / f"train-{i}.npz", images=images[part], labels=labels[part])
    exact = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    test_labels = (np.arange(12) % 10).astype(np.uint8)
    np.savez_compressed(folder / "test-lossless-1k.npz", images=exact, labels=test_labels)
    lossy = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    np.savez_compressed(folder / "test-jpeg.npz", images=lossy, labels=np.zeros(20, np.uint8))
    (folder / "classes.txt").write_text("\n".join(f"c{k}" for k in range(10)) + "\n")
    return images, labels, exact


def test_the_data_for_a_gpu_machine_is_a_class_balanced_subset_capsctl_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capsctl.data.cifar import load_cifar

    images, labels, exact = _cifar_source(tmp_path / "src")
    make = _script("make_gpu_check_data")
    monkeypatch.setenv("CAPSCTL_DATA", str(tmp_path / "src"))
    out = tmp_path / "gpu-data"
    assert make.main(["--out", str(out), "--train", "30"]) == 0

    first3 = np.sort(np.concatenate([np.flatnonzero(labels == k)[:3] for k in range(10)]))
    train, _ = load_cifar("cifar10", "train", out, None, download=False, on_event=None)
    assert np.array_equal(train.images.permute(0, 2, 3, 1).numpy(), images[first3])
    assert np.array_equal(train.labels.numpy(), labels[first3])
    assert train.classes == [f"c{k}" for k in range(10)]
    test, _ = load_cifar("cifar10", "test", out, None, download=False, on_event=None)
    assert test.name == "cifar10[test-lossless-1k]"
    assert np.array_equal(test.images.permute(0, 2, 3, 1).numpy(), exact)
    with np.load(out / "cifar10" / "train.npz") as z:
        assert sorted(z.files) == ["images", "labels"]
        assert z["images"].dtype == np.uint8 and z["labels"].dtype == np.uint8
    manifest = json.loads((out / "cifar10" / "subset.json").read_text())
    assert manifest["train"]["images"] == 30 and manifest["train"]["of"] == 60
    assert manifest["test"]["images"] == 12

    before = (out / "cifar10" / "train.npz").read_bytes()
    assert make.main(["--data", str(tmp_path / "src"), "--out", str(out), "--train", "30"]) == 0
    assert (out / "cifar10" / "train.npz").read_bytes() == before  # same input, same bytes


def test_the_data_script_refuses_lossy_test_images_and_too_many_training_images(
    tmp_path: Path,
) -> None:
    _cifar_source(tmp_path / "src")
    make = _script("make_gpu_check_data")
    args = ["--data", str(tmp_path / "src"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="class .* has only 6"):
        make.main([*args, "--train", "70"])
    (tmp_path / "src" / "cifar10" / "test-lossless-1k.npz").unlink()
    with pytest.raises(SystemExit, match="not exact"):
        make.main([*args, "--train", "30"])


@pytest.mark.slow
def test_a_dry_run_of_every_part_writes_each_part_file_and_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--part", "all", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    names = [f"gpu-check-{p}.json" for p in PARTS] + ["gpu-check-summary.md"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    docs = {p: json.loads((out / f"gpu-check-{p}.json").read_text()) for p in PARTS}
    assert all(d["done"] and d["dry_run"] and d["part"] == p for p, d in docs.items())

    # the warm part stepped every fused row the check and the bench time, before they ran
    warmed = docs["warm"]["rows"]
    assert not [r for r in warmed if "error" in r], warmed
    assert len([r for r in warmed if r["for"] == "check"]) == 10
    assert {(r["model"], r["setting"]) for r in warmed if r["for"] == "bench"} == {
        (r["name"], r["setting"]) for r in docs["bench"]["rows"] if r["passes"] == "fused"
    }

    check = docs["check"]["rows"]
    assert {(r["model"], r["dtype"]) for r in check} == {
        (m, d)
        for m in (
            "cifar10-caps",
            "cifar10-caps-simple (sequential)",
            "cifar10-dynamic-simple",
            "cifar10-em-simple",
            "cifar10-self-simple",
        )
        for d in ("fp32", "bf16")
    }
    assert all(r["ok"] and r["torch_ran"] == "chunked" for r in check), check
    # every Triton kernel runs, under the interpreter, against the torch code
    kernels = docs["check"]["kernels"]
    assert [k["pass"] for k in kernels] == [
        "routed", "weighted", "gated", "em_moments", "em_quad", "squash", "e_step", "em_routing",
        "em_conv", "windows",
    ]  # fmt: skip
    assert all(k["ok"] and k["ran"] == "triton" for k in kernels), kernels

    bench = docs["bench"]["rows"]
    assert not [r for r in bench if "error" in r], bench
    got = {(r["name"], r["setting"], r["passes"]) for r in bench}
    for setting in ("fp32", "bf16+cl"):
        assert ("resnet18", setting, "fused") in got
        for model in ("cifar10-caps-simple (sequential, T=2)", "cifar10-self-simple"):
            assert {(model, setting, "fused"), (model, setting, "torch")} <= got
    assert all(r["train_step_s"] > 0 and r["train_ratio"] > 0 for r in bench)
    assert {r["routing_backend"] for r in bench if r["passes"] == "torch"} == {"chunked"}
    (compiled,) = docs["compile"]["rows"]
    assert compiled["compiled"] and compiled["train_step_s"] > 0
    (trained,) = docs["train"]["rows"]
    assert trained["epochs"] == 1 and 0.0 <= trained["test_accuracy"] <= 1.0
    assert trained["train_images"] + trained["val_images"] == 64

    for head in ("warm:", "check: forward and backward", "bench: training step", "compile:",
                 "train:"):  # fmt: skip
        assert head in res.stdout
    table = (out / "gpu-check-summary.md").read_text()
    assert "| cifar10-self-simple |" in table and "| fp32 torch |" in table
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--summary", str(out)], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout == table


def test_the_summary_says_which_parts_did_not_finish_and_which_rows_failed(
    tmp_path: Path,
) -> None:
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "capsctl": "0.2.0"}
    row = {"setting": "fp32", "passes": "fused", "compiled": False, "routing_backend": None}
    bench = {
        **meta,
        "part": "bench",
        "done": False,
        "seconds": 420.0,
        "settings": {"batch_size": 128},
        "rows": [
            {
                **row,
                "name": "resnet18",
                "train_step_s": 0.01,
                "train_ratio": 1.0,
                "peak_device_bytes": 2**30,
                "memory_ratio": 1.0,
            },
            {
                **row,
                "name": "cifar10-em",
                "routing_backend": "triton",
                "train_step_s": 0.015,
                "train_ratio": 1.5,
                "peak_device_bytes": 3 * 2**29,
                "memory_ratio": 1.5,
            },
            {**row, "name": "cifar10-self", "error": "OutOfMemoryError: CUDA out of memory"},
            {
                **row,
                "name": "cifar10-self-simple",
                "error": "skipped: it would end after the part's 7.5 minutes",
            },
        ],
    }
    (tmp_path / "gpu-check-bench.json").write_text(json.dumps(bench))
    train = {
        **meta,
        "part": "train",
        "done": False,
        "seconds": 200.0,
        "settings": {"model": "cifar10-caps"},
        "rows": [],
        "data": {"train": 14000, "val": 1000},
        "epochs": [
            {"epoch": 1, "seconds": 10.0, "val_accuracy": 0.5},
            {"epoch": 2, "seconds": 20.0, "val_accuracy": 0.91},
        ],
    }
    (tmp_path / "gpu-check-train.json").write_text(json.dumps(train))
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--summary", str(tmp_path)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "part bench did not finish: 4 rows in 420 s" in res.stdout
    assert "| cifar10-em | triton | 15.0 ms (1.50x) | 1,536 MiB (1.50x) |" in lines
    assert "| cifar10-self | - | OutOfMemoryError |  |" in lines
    assert "| cifar10-self-simple | - | skipped |  |" in lines
    assert "part train did not finish: 0 rows in 200 s" in res.stdout
    assert (
        "| cifar10-caps | 14,000 (+1,000 val) | - | 2 (unfinished) | 20 s | - | 91.00% | - |"
        in lines
    )


def test_a_part_rewrites_its_file_after_every_row_and_starts_no_row_past_its_minutes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    gpu_check = _script("gpu_check")
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    path = tmp_path / "gpu-check-bench.json"
    part = gpu_check.Part("bench", path, {"device": "x"}, {"batch_size": 128}, budget_s=60.0)
    assert json.loads(path.read_text())["rows"] == [] and not part.out_of_time()
    clock[0] += 20.0  # the slowest row so far: 20 s
    part.add({"n": 1})
    clock[0] += 5.0
    part.add({"n": 2})
    doc = json.loads(path.read_text())
    assert [r["n"] for r in doc["rows"]] == [1, 2] and doc["seconds"] == 25.0 and not doc["done"]
    clock[0] += 15.0
    assert not part.out_of_time()  # 40 s + 20 s ends at the budget
    clock[0] += 1.0
    assert part.out_of_time()
    part.save(done=True)
    assert json.loads(path.read_text())["done"]


def test_the_plan_fits_eight_minutes_and_each_part_keeps_its_budget(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == list(PARTS)
    total = float(lines[-1].split()[1])
    assert total <= 480 and "fits in 8 minutes" in lines[-1]
    # the budgets come from the kernels' report: its compile seconds and modelled steps
    plan = _script("gpu_check_plan")
    gpu_check = _script("gpu_check")
    args = gpu_check._parse([])
    budgets = plan.plan(gpu_check.plan_rows(args), plan.load_report())
    assert sum(b.seconds for b in budgets) == pytest.approx(total, abs=1)
    report = plan.load_report()
    slower = {**report, "baseline": {**report["baseline"], "modelled_us": 1e6}}  # 1 s a step
    more = {b.part: b.seconds for b in plan.plan(gpu_check.plan_rows(args), slower)}
    assert more["bench"] > {b.part: b.seconds for b in budgets}["bench"] + 20
    # and a part takes its budget from the plan
    args.out = tmp_path
    run = gpu_check.Run(args, "cuda", {"device": "x"}, {"bench": 56.0})
    assert run.part("bench").budget_s == 56.0


def test_without_cuda_and_without_dry_run_it_says_what_to_do() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the full check")
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "--dry-run" in res.stdout


def test_a_bf16_row_is_ok_within_twice_the_torch_codes_own_bf16_error() -> None:
    """The check's bf16 rule, with typed numbers: each value of the fused passes may differ
    from the torch code by twice the torch code's own bf16 error (its bf16 result against its
    fp32 result) plus the fp32 tolerance 1e-2, value by value."""
    within = _script("gpu_check").within_bf16
    own = {"logits": 0.01, "a": 0.17, "b": 0.0}
    assert within({"logits": 0.02, "a": 0.35, "b": 0.0099}, own)  # 0.35 <= 2 * 0.17 + 0.01
    assert not within({"logits": 0.02, "a": 0.36, "b": 0.0}, own)  # 0.36 > 0.35
    assert not within({"logits": 0.02, "a": 0.0, "b": 0.011}, own)  # float32 part: 1e-2
    assert not within({"logits": 0.031, "a": 0.0, "b": 0.0}, own)  # 0.031 > 2 * 0.01 + 0.01
