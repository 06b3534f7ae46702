"""Ship a trained run's weights inside the package: ``capsctl/weights/<name>.safetensors``
(float16 weights, the run's metadata, no training state) and its entry in
``capsctl/weights/index.json``.

    python scripts/ship_weights.py RUN_FOLDER --name cifar10-fast.idpa \\
        --source benchmarks/suites/cifar10-fast-cpu/idpa/seed-1 [--data-dir DIR] [--replace]

The accuracy recorded is what ``capsctl eval NAME`` gives on the run's test set with the
shipped file itself; it must lie within 0.3 points of the ledger's figure for the run
(``source``/tests.json or results.json), or nothing is written. ``--command`` is the line that
trained it (``capsctl suite run SUITE --print-commands``); the commit comes from the run's
``provenance.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capsctl.atomic import write_atomic  # noqa: E402
from capsctl.checkpoint.format import MODEL_PREFIX, decode_metadata, save_checkpoint  # noqa: E402
from capsctl.checkpoint.shipped import INDEX, SHIPPED_DIR, is_shipped_name, list_weights  # noqa: E402
from capsctl.evaluation import evaluate_checkpoint  # noqa: E402

#: The largest difference in points between the shipped file's accuracy and the ledger's.
AGREEMENT_POINTS = 0.3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run folder (holds best.safetensors)")
    ap.add_argument("--name", required=True, help="<suite>.<member>, e.g. cifar10-fast.idpa")
    ap.add_argument("--source", required=True, type=Path, help="the run's ledger folder")
    ap.add_argument(
        "--command", required=True, help="the command that trained it (--print-commands' line)"
    )
    ap.add_argument("--data-dir", default=None, help="where the test set lives")
    ap.add_argument("--replace", action="store_true", help="replace a shipped file of that name")
    args = ap.parse_args(argv)
    if not is_shipped_name(args.name):
        ap.error(f"--name {args.name!r}: expected <suite>.<member> in lower case")
    entry = ship(args.run, args.name, args.source, args.command, args.data_dir, args.replace)
    print(json.dumps(entry, indent=2))
    return 0


def ship(
    run: Path, name: str, source: Path, command: str, data_dir: str | None, replace: bool
) -> dict[str, Any]:
    """Write the float16 file and its index entry; returns the entry."""
    known = [w.to_dict() for w in list_weights()]
    if any(w["name"] == name for w in known) and not replace:
        raise SystemExit(f"{name} is shipped already; pass --replace to replace it")
    ledger = _ledger_accuracy(ROOT / source)
    target = SHIPPED_DIR / f"{name}.safetensors"
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / target.name
        meta, params = _half(run / "best.safetensors", staged)
        result, _ = evaluate_checkpoint(staged, data_dir=data_dir, device="cpu")
        if abs(100 * (result.accuracy - ledger)) > AGREEMENT_POINTS:
            raise SystemExit(
                f"{name}: the shipped file gives {100 * result.accuracy:.2f}% against the "
                f"ledger's {100 * ledger:.2f}%; more than {AGREEMENT_POINTS} points apart"
            )
        write_atomic(target, staged.read_bytes())
    preset = meta["preset"]
    model = preset["model"]
    entry = {
        "name": name,
        "model": _model_name(model),
        "router": (model.get("router") or {}).get("name")
        if model.get("arch") == "capsnet"
        else None,
        "dataset": meta.get("dataset"),
        "test_set": meta.get("test_name") or "test",
        "accuracy": round(float(result.accuracy), 6),
        "params": params,
        "bytes": target.stat().st_size,
        "command": command,
        "commit": _commit(run),
        "source": source.as_posix(),
    }
    rest = [w for w in known if w["name"] != name]
    index = {"weights": sorted([*rest, entry], key=lambda w: listing_order(w["name"]))}
    write_atomic(INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return entry


def listing_order(name: str) -> tuple[int, str, int, str]:
    """Where ``<suite>.<member>`` goes in the index (what ``capsctl weights`` lists): the
    quickstart first, then by suite, each suite's members in the suite file's order."""
    from capsctl.errors import CapsctlError
    from capsctl.suites import load_suite

    suite, member = name.split(".", 1)
    try:
        members = [m.name for m in load_suite(suite).members]
    except CapsctlError:  # not a bundled suite: after its members, by name
        members = []
    rank = members.index(member) if member in members else len(members)
    return (0 if suite == "quickstart" else 1, suite, rank, member)


def _half(src: Path, dst: Path) -> tuple[dict[str, Any], int]:
    """Copy the model tensors of ``src`` as float16 (integers as they are) with its metadata,
    less the training state; returns the metadata and the parameter count."""
    with safe_open(str(src), "pt") as f:
        meta = decode_metadata(src, f.metadata())
        tensors = {k: f.get_tensor(k) for k in list(f.keys()) if k.startswith(MODEL_PREFIX)}
    half = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
    meta.pop("training_state", None)
    meta.pop("format", None)
    save_checkpoint(dst, half, meta)
    counts = meta.get("params")
    total = counts.get("total") if isinstance(counts, dict) else counts
    params = int(total or sum(v.numel() for v in tensors.values()))
    return meta, params


def _model_name(model: dict[str, Any]) -> str:
    """The registered model the stored one is (its router aside), else its architecture."""
    from capsctl.registry import get_config, list_models

    def plain(cfg: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in cfg.items() if k != "router"}

    for name in list_models():
        if plain(dataclasses.asdict(get_config(name))) == plain(model):
            return name
    return f"{model.get('arch')} ({model.get('backbone')} backbone)"


def _ledger_accuracy(folder: Path) -> float:
    """The run's test accuracy as its ledger records it."""
    results = json.loads((folder / "results.json").read_text())
    return float(results["test"]["accuracy"])


def _commit(run: Path) -> str:
    prov = json.loads((run / "provenance.json").read_text())
    return str(prov["trained_by"][0]["commit"])


if __name__ == "__main__":
    sys.exit(main())
