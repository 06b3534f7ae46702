"""scripts/robustness_table.py: the robustness tables of docs/ come from the measurements kept in
benchmarks/robustness/ (the ``--json`` output of ``capsctl robustness``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    return load_script("robustness_table")


def _doc(clean: float, **parts: Any) -> str:
    result = {"dataset": "cifar10[test-lossless-1k]", "count": 1000, "clean_accuracy": clean}
    result |= {"checkpoint": "c.safetensors", "model": "capsnet/dynamic", "loss_name": "margin"}
    result |= {"flip": True, "seed": 0, "steps": 10, "pgd_step": "2.5 * eps / 10 (Madry et al.)"}
    result |= {"attacks": [], "shifts": [], "corruptions": [], "mean_corruption_accuracy": None}
    result |= parts
    return json.dumps({"results": [result], "pictures": []})


def _attack(
    name: str, eps: float, accuracy: float, success: float, targeted: bool = False
) -> dict[str, Any]:
    # as an older capsctl wrote it: no "seconds"
    return {"attack": name, "eps": eps / 255, "targeted": targeted, "accuracy": accuracy,
            "success_rate": success, "correct_before": 900, "count": 1000}  # fmt: skip


def _measured(root: Path) -> Path:
    """Two checkpoints of a suite named like the shipped one: cnn seed 0 fully measured,
    dynamic seed 2 with its attacks only."""
    suite = root / "cifar10-fast-cpu"
    cnn, dyn = suite / "cnn/seed-0", suite / "dynamic/seed-2"
    for folder, commit in ((cnn, "a" * 40), (dyn, "b" * 40)):
        folder.mkdir(parents=True)
        prov = {"commit": commit, "cpu": "Test CPU", "cores": 2, "torch": "9.9"}
        (folder / "provenance.json").write_text(json.dumps(prov))
    by_kind = {"attacks": "a" * 40, "corruptions": "c" * 40, "rotate": "a" * 40}
    prov |= {"commit": "a" * 40, "commits": by_kind}  # measured at two commits
    (cnn / "provenance.json").write_text(json.dumps(prov))
    attacks = [_attack("pgd", 8, 0.01, 0.99), _attack("fgsm", 8, 0.2, 0.78)]
    attacks += [_attack("fgsm", 2, 0.5, 0.45), _attack("pgd", 2, 0.3, 0.66)]
    attacks += [_attack("pgd", 8, 0.0, 1.0, targeted=True)]
    (cnn / "attacks.json").write_text(_doc(0.9, attacks=attacks))
    (cnn / "corruptions.json").write_text(_doc(0.9, mean_corruption_accuracy=0.6543))
    turns = [{"shift": "rotate", "magnitude": m, "accuracy": a, "count": 1000}
             for m, a in ((0, 0.9), (30, 0.5))]  # fmt: skip
    (cnn / "rotate.json").write_text(_doc(0.9, shifts=turns))
    (dyn / "attacks.json").write_text(_doc(0.88, attacks=[_attack("fgsm", 8, 0.25, 0.72)]))
    cw = [_attack("pgd", 8, 0.0, 1.0), _attack("pgd", 4, 0.05, 0.94)]
    (dyn / "attacks-cw.json").write_text(_doc(0.88, attacks=cw, loss_name="cw_margin"))
    return suite


def test_table_of_measured_checkpoints(tmp_path: Path) -> None:
    lines = _script().table(_measured(tmp_path)).splitlines()
    assert lines[0].startswith(
        "| checkpoint | clean | FGSM 2 / 4 / 8 (/255) | PGD-10 2 / 4 / 8 (/255) |"
    )
    # the suite's member order (dynamic before cnn), radii ascending ('-' where not
    # measured), success at the largest
    assert lines[2] == "| dynamic, seed 2 | 88.0 | - / - / 25.0 | - | 72.0 / - | - |"
    assert (
        lines[3] == "| cnn, seed 0 | 90.0 | 50.0 / - / 20.0 | 30.0 / - / 1.0 | 78.0 / 99.0 | 65.4 |"
    )
    assert "| checkpoint | rotated by 0/30 degrees | translated by  |" in lines
    assert "| cnn, seed 0 | 90.0 / 50.0 | - |" in lines
    # the CW check: only the checkpoint measured with it, at the radii of every table (4 too)
    cw = [line for line in lines if "CW margin" in line]
    assert cw == ["| checkpoint | own loss | FGSM, CW margin 2 / 4 / 8 (/255) | PGD-10, CW margin "
                  "2 / 4 / 8 (/255) | FGSM / PGD-10 success at the largest |"]  # fmt: skip
    assert "| dynamic, seed 2 | margin | - | - / 5.0 / 0.0 | - / 100.0 |" in lines
    assert not any(line.startswith("| cnn, seed 0 | margin") for line in lines)
    assert lines[-1].startswith("Accuracy in % on cifar10[test-lossless-1k], first 1,000 images.")
    assert "commits bbbbbbbbb (dynamic 2), aaaaaaaaa (cnn 0), ccccccccc (cnn 0);" in lines[-1]


def test_render_replaces_only_the_robustness_blocks(tmp_path: Path) -> None:
    script = _script()
    root = _measured(tmp_path).parent
    name = "cifar10-fast-cpu"
    text = f"before\n<!-- robustness:{name} -->\nstale\n<!-- /robustness:{name} -->\nafter\n"
    new = script.render(text, root)
    assert new.startswith(f"before\n<!-- robustness:{name} -->\n| checkpoint | clean |")
    assert new.endswith(f"<!-- /robustness:{name} -->\nafter\n") and "stale" not in new
    assert script.render(new, root) == new


@pytest.mark.parametrize("stale", [False, True])
def test_check_says_whether_the_docs_are_the_measurements(
    stale: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without files, --check reads README.md and every page of docs/, where the robustness
    tables live (docs/ROBUSTNESS.md)."""
    page = ROOT / "docs" / "ROBUSTNESS.md"
    if not stale:
        assert _script().main(["--check"]) == 0
        assert _script().main(["--check", str(page)]) == 0
        return
    script = _script()
    script.MEASURED = Path("/nonexistent")  # nothing measured: every block would change
    assert script.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert f"{page}: robustness tables differ" in err
    assert "run python scripts/robustness_table.py --write" in err


def test_write_replaces_stale_blocks_and_then_check_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script()
    monkeypatch.setattr(script, "MEASURED", _measured(tmp_path / "measured").parent)
    readme = tmp_path / "README.md"
    name = "cifar10-fast-cpu"
    text = f"top\n<!-- robustness:{name} -->\nOLD TABLE\n<!-- /robustness:{name} -->\n"
    readme.write_text(text)
    assert script.main(["--check", str(readme)]) == 1
    assert readme.read_text() == text  # a check never writes
    assert script.main(["--write", str(readme)]) == 0
    assert "| cnn, seed 0 | 90.0 |" in readme.read_text() and "OLD TABLE" not in readme.read_text()
    assert script.main(["--check", str(readme)]) == 0


def test_affine_protocol_table_with_the_provenance_its_json_carries(tmp_path: Path) -> None:
    # A suite measured only on affNIST-style sets: its table alone, no attack or sweep table;
    # no provenance.json, so where it was measured comes from each JSON's own provenance.
    suite = tmp_path / "expanded-mnist-cpu"
    prov = {"commit": "d" * 40, "cpu": "Test CPU", "cores": 2, "torch_version": "9.9"}
    for member, accs in (("caps", (0.99, 0.991, 0.7)), ("cnn", (0.995, 0.996, 0.6))):
        folder = suite / member / "seed-0"
        folder.mkdir(parents=True)
        shifts = [
            {"shift": "affine", "magnitude": m, "accuracy": a}
            for m, a in zip((0, 1), accs[1:], strict=True)
        ]
        doc = json.loads(_doc(accs[0], shifts=shifts, dataset="expanded-mnist", count=10000))
        doc["provenance"] = prov | ({"commit": "e" * 40} if member == "cnn" else {})
        (folder / "affine.json").write_text(json.dumps(doc))
    lines = _script().table(suite).splitlines()
    assert lines[:4] == [
        "| checkpoint | test (expanded-mnist) | affNIST-style 40x40, at 0/1 of affNIST's ranges |",
        "|---|---|---|",
        "| caps, seed 0 | 99.0 | 99.1 / 70.0 |",
        "| cnn, seed 0 | 99.5 | 99.6 / 60.0 |",
    ]
    assert not any("FGSM" in line or "rotated" in line for line in lines)
    assert "Test CPU (2 cores), torch 9.9" in lines[-1]
    assert "commits ddddddddd (caps 0), eeeeeeeee (cnn 0);" in lines[-1]


def test_a_measurement_without_provenance_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "expanded-mnist-cpu" / "caps" / "seed-0"
    folder.mkdir(parents=True)
    (folder / "affine.json").write_text(_doc(0.9, dataset="expanded-mnist"))
    with pytest.raises(SystemExit, match="no provenance in it"):
        _script().table(folder.parents[1])


def test_a_newer_measurement_names_its_own_commit_beside_an_older_provenance_file(
    tmp_path: Path,
) -> None:
    suite = _measured(tmp_path)
    doc = json.loads(_doc(0.9, attacks=[_attack("pgd", 8, 0.02, 0.98)], loss_name="cw_margin"))
    doc["provenance"] = {"commit": "f" * 40, "cpu": "Test CPU", "cores": 2, "torch_version": "9.9"}
    (suite / "cnn/seed-0/attacks-cw.json").write_text(json.dumps(doc))
    last = _script().table(suite).splitlines()[-1]
    assert "aaaaaaaaa (cnn 0), ccccccccc (cnn 0), fffffffff (cnn 0);" in last


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("attack.json", "attack.json: not a kind of measurement"),
        ("notes.txt", "notes.txt: not a kind of measurement"),
        (None, "seed-0: no measurement in it"),
    ],
)
def test_a_checkpoint_folder_without_a_known_measurement_is_refused(
    tmp_path: Path, name: str | None, message: str
) -> None:
    # A misnamed measurement (or an empty folder) must not vanish from the README silently.
    folder = tmp_path / "cifar10-fast-cpu" / "cnn" / "seed-0"
    folder.mkdir(parents=True)
    if name is not None:
        (folder / name).write_text(_doc(0.9))
    with pytest.raises(SystemExit, match=message):
        _script().table(folder.parents[1])


def test_pictures_of_each_suite_with_a_label_per_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    script = _script()
    suite = _measured(tmp_path / "measured")
    results, labels = script.plotted(suite)
    assert labels == ["dynamic, seed 2", "cnn, seed 0"]  # the suite's order
    dyn, cnn = results
    # untargeted PGD only (the targeted one and FGSM are left out), the rotation sweep joined in
    assert [(a.attack, round(a.eps * 255), a.targeted) for a in cnn.attacks] == [
        ("pgd", 8, False),
        ("pgd", 2, False),
    ]
    assert [(p.shift, p.magnitude, p.accuracy) for p in cnn.shifts] == [
        ("rotate", 0, 0.9),
        ("rotate", 30, 0.5),
    ]
    assert dyn.attacks == [] and dyn.shifts == []  # its attacks.json had FGSM only
    out = tmp_path / "pictures"
    written = script.pictures(out, root=suite.parent)
    assert sorted(p.relative_to(out).as_posix() for p in written) == [
        "cifar10-fast-cpu/accuracy-vs-eps.png",
        "cifar10-fast-cpu/accuracy-vs-rotate.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    with pytest.raises(Exception, match="exists"):
        script.pictures(out, root=suite.parent)  # never replaced unless told
    assert script.pictures(out, overwrite=True, root=suite.parent) == written


def test_the_tables_say_which_weights_they_were_measured_on() -> None:
    note = _script().weights_note
    run = {"attacks": {"checkpoint": "/work/runs/c10/idpa/seed-1/best.safetensors"}}
    shipped = {"attacks": {"checkpoint": "cifar10-fast.cnn"}, "rotate": None}
    found = [("idpa", 1, run), ("resnet18", 0, run), ("cnn", 1, shipped)]
    text = note("cifar10-fast", found)
    assert text.startswith("Measured on shipped weights: cnn 1 (cifar10-fast.cnn);")
    # idpa's shipped file is another training than the one measured; ResNet-18 ships none
    assert text.endswith(
        "not shipped: idpa 1 (shipped: cifar10-fast.idpa, another training of it), resnet18 0."
    )
