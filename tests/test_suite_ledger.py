"""Suite ledgers (``capsctl suite archive``) and reports over several folders."""

from __future__ import annotations

import json
from pathlib import Path

from capsctl.suites import load_suite, report_suite

SUITE = "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1, t2]\nmembers:\n  - name: caps\n"


def _suite_file(folder: Path) -> Path:
    path = folder / "s.yaml"
    path.write_text(SUITE)
    return path


def _run(
    folder: Path,
    seconds: float,
    tests: dict[str, tuple[float, int]],
    *,
    checkpoints: bool = True,
) -> Path:
    """A finished pair's folder: results, test scores, provenance and (dummy) checkpoints."""
    folder.mkdir(parents=True)
    history = [{"epoch": 1, "images_per_s": 100.0}, {"epoch": 2, "images_per_s": 300.0}]
    res = {"test": {"accuracy": 0.5}, "seconds": seconds, "epochs_done": 2, "history": history}
    (folder / "results.json").write_text(json.dumps(res))
    doc = {"tests": {k: {"accuracy": a, "count": n} for k, (a, n) in tests.items()}}
    (folder / "tests.json").write_text(json.dumps(doc))
    trained = {"trained_by": [{"cpu": "Test CPU", "cores": 4, "commit": "abc"}]}
    (folder / "provenance.json").write_text(json.dumps(trained))
    (folder / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    if checkpoints:
        (folder / "best.safetensors").write_bytes(b"weights")
        (folder / "last.safetensors").write_bytes(b"weights and optimizer")
    return folder


def test_a_restored_record_counts_as_finished(tmp_path: Path) -> None:
    suite = load_suite(_suite_file(tmp_path))
    folder = _run(tmp_path / "ledger/caps/seed-0", 10.0, {"t1": (0.75, 200)}, checkpoints=False)
    res = json.loads((folder / "results.json").read_text())
    res["test"] = None  # the run's own final test was not kept
    res["restored_from"] = {"file": "some.csv", "rows": [2]}
    (folder / "results.json").write_text(json.dumps(res))
    row = report_suite(suite, tmp_path / "ledger", score=False).rows[0]
    assert row.seeds_done == [0] and row.tests["t1"].values == [0.75]
    # its preset, marked as restored, is still the pair's own
    from capsctl.config import preset_to_dict
    from capsctl.config.yaml_io import to_yaml
    from capsctl.suites.runner import Pair, check_folder_is_pair, resolved_pair_preset

    pair = Pair(suite.member("caps"), 0, folder)
    preset = preset_to_dict(resolved_pair_preset(suite, pair))
    (folder / "preset.yaml").write_text(to_yaml({**preset, "restored_from": {"rows": [2]}}))
    check_folder_is_pair(suite, pair)
