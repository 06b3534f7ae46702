"""The robustness tables of docs/ROBUSTNESS.md, generated from benchmarks/robustness/.

Each measured checkpoint is a folder ``benchmarks/robustness/SUITE/MEMBER/seed-N/`` holding the
``--json`` output of ``capsctl robustness`` for each kind of measurement it had:

- ``attacks.json``: ``--attack fgsm,pgd --eps 1/255,2/255,4/255,8/255 --limit 1000``;
- ``corruptions.json``: ``--attack none --corruptions --limit 1000``;
- ``rotate.json``, ``translate.json``: ``--attack none --shift rotate|translate --limit 1000``;
- ``attacks-cw.json``: as ``attacks.json`` with ``--loss cw`` (the gradient-masking check);
- ``affine.json``: ``--attack none --shift affine`` (models trained on expanded MNIST);

and where it was measured: the ``provenance`` each JSON carries, or for measurements older than
that a ``provenance.json`` (``commit``, ``cpu``, ``cores``, ``torch``; ``commits``, by kind,
where the measurements ran at different commits). Only the tables of what was measured appear.
``python scripts/robustness_table.py`` prints every suite's tables; ``--write`` replaces the
text between ``<!-- robustness:SUITE -->`` and ``<!-- /robustness:SUITE -->`` in README.md and
every ``docs/*.md`` (or in the files named after it); ``--check`` exits 1 when those blocks
differ from the measurements (the tests run it); ``--png DIR`` draws each suite's pictures into
``DIR/SUITE/`` (accuracy against eps under untargeted PGD with each model's own loss, against
each shift's magnitude). Members are listed in the suite's order
(``benchmarks/suites/SUITE/suite.yaml`` or the shipped preset), seeds in order.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_table import readme_main  # noqa: E402

from capsctl.checkpoint.shipped import list_weights  # noqa: E402

MEASURED = ROOT / "benchmarks" / "robustness"
KINDS = ("attacks", "corruptions", "rotate", "translate", "attacks-cw", "affine")
_BLOCK = re.compile(
    r"(<!-- robustness:(?P<name>[\w.-]+) -->\n)(.*?)(<!-- /robustness:(?P=name) -->)", re.S
)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _result(folder: Path, kind: str) -> dict[str, Any] | None:
    """The one checkpoint's result in ``folder/kind.json``, or None when it was not measured."""
    path = folder / f"{kind}.json"
    if not path.is_file():
        return None
    (result,) = json.loads(path.read_text(encoding="utf-8"))["results"]
    return result


def _member_order(suite: str) -> list[str]:
    """The suite's members in its own order: from its ledger's suite.yaml, else the preset."""
    for path in (
        ROOT / "benchmarks" / "suites" / suite / "suite.yaml",
        ROOT / "presets" / "suites" / f"{suite.removesuffix('-cpu')}.yaml",
    ):
        if path.is_file():
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            return [m["name"] for m in doc.get("members", [])]
    return []


def _known_files(folder: Path) -> None:
    """Refuse a checkpoint folder holding a file that is not a kind of measurement (a misnamed
    one would vanish from the tables) or holding no measurement at all."""
    known = {f"{kind}.json" for kind in KINDS}
    for path in sorted(folder.iterdir()):
        if path.name not in known | {"provenance.json"}:
            raise SystemExit(
                f"{path}: not a kind of measurement; name it one of {', '.join(sorted(known))}"
            )
    if not any((folder / name).is_file() for name in known):
        raise SystemExit(f"{folder}: no measurement in it; remove the folder or measure it")


def checkpoints(suite_folder: Path) -> list[tuple[str, int, Path]]:
    """(member, seed, folder) of every measured checkpoint, in the suite's member order."""
    order = _member_order(suite_folder.name)
    found = [
        (f.parent.name, int(f.name.removeprefix("seed-")), f)
        for f in suite_folder.glob("*/seed-*")
        if f.is_dir() and f.name.removeprefix("seed-").isdigit()
    ]
    for _, _, folder in found:
        _known_files(folder)
    rank = {m: i for i, m in enumerate(order)}
    return sorted(found, key=lambda t: (rank.get(t[0], len(rank)), t[0], t[1]))


def _sweep(result: dict[str, Any] | None) -> str:
    if result is None:
        return "-"
    return " / ".join(_pct(s["accuracy"]) for s in result["shifts"])


def _magnitudes(rows: list[dict[str, Any] | None], unit: str) -> str:
    for r in rows:
        if r is not None:
            return "/".join(f"{s['magnitude']:g}" for s in r["shifts"]) + unit
    return ""


def _attack_cells(
    result: dict[str, Any] | None, attack: str, radii: list[float]
) -> tuple[str, str]:
    """Accuracy at each of ``radii`` (``-`` where not measured) and the success rate at the
    largest radius measured, for one untargeted attack."""
    found = {
        round(a["eps"] * 255, 3): a
        for a in (result or {}).get("attacks", [])
        if a["attack"] == attack and not a["targeted"]
    }
    if not found:
        return "-", "-"
    cells = " / ".join(_pct(found[e]["accuracy"]) if e in found else "-" for e in radii)
    return cells, _pct(found[max(found)]["success_rate"])


def _radii(rows: list[dict[str, Any] | None]) -> list[float]:
    """Every radius (in 1/255) any checkpoint was attacked at, ascending."""
    return sorted({round(a["eps"] * 255, 3) for r in rows if r for a in r["attacks"]})


def _cw_table(res: dict[tuple[str, int], dict[str, Any]], radii: list[float]) -> list[str]:
    """The attacks again with the CW margin, for the checkpoints measured so."""
    checked = [(key, r) for key, r in res.items() if r["attacks-cw"] is not None]
    if not checked:
        return []
    eps = " / ".join(f"{e:g}" for e in radii) + " (/255)"
    lines = [
        "",
        f"| checkpoint | own loss | FGSM, CW margin {eps} | PGD-10, CW margin {eps} | "
        "FGSM / PGD-10 success at the largest |",
        "|---|---|---|---|---|",
    ]
    for (member, seed), r in checked:
        own = "-" if r["attacks"] is None else r["attacks"]["loss_name"]
        fgsm, fgsm_success = _attack_cells(r["attacks-cw"], "fgsm", radii)
        pgd, pgd_success = _attack_cells(r["attacks-cw"], "pgd", radii)
        lines.append(
            f"| {member}, seed {seed} | {own} | {fgsm} | {pgd} | {fgsm_success} / {pgd_success} |"
        )
    return lines


def _attack_table(res: dict[tuple[str, int], dict[str, Any]], radii: list[float]) -> list[str]:
    """Clean accuracy, the attacks with each model's own loss and the corruptions."""
    if not any(r["attacks"] or r["corruptions"] for r in res.values()):
        return []
    eps = " / ".join(f"{e:g}" for e in radii) + " (/255)"
    lines = [
        f"| checkpoint | clean | FGSM {eps} | PGD-10 {eps} | FGSM / PGD-10 success at "
        "the largest | CIFAR-10-C mean (15 x 5) |",
        "|---|---|---|---|---|---|",
    ]
    for (member, seed), r in res.items():
        any_result = next((v for v in r.values() if v is not None), None)
        clean = None if any_result is None else any_result["clean_accuracy"]
        fgsm, fgsm_success = _attack_cells(r["attacks"], "fgsm", radii)
        pgd, pgd_success = _attack_cells(r["attacks"], "pgd", radii)
        corr = r["corruptions"]
        mean_corr = None if corr is None else corr["mean_corruption_accuracy"]
        lines.append(
            f"| {member}, seed {seed} | {_pct(clean)} | {fgsm} | {pgd} | "
            f"{fgsm_success} / {pgd_success} | {_pct(mean_corr)} |"
        )
    return lines


def _sweep_table(res: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """The rotation and translation sweeps."""
    if not any(r["rotate"] or r["translate"] for r in res.values()):
        return []
    rotations = _magnitudes([r["rotate"] for r in res.values()], " degrees")
    shifts = _magnitudes([r["translate"] for r in res.values()], " px")
    lines = [
        "",
        f"| checkpoint | rotated by {rotations} | translated by {shifts} |",
        "|---|---|---|",
    ]
    for (member, seed), r in res.items():
        lines.append(
            f"| {member}, seed {seed} | {_sweep(r['rotate'])} | {_sweep(r['translate'])} |"
        )
    return lines


def _affine_table(res: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    """Sabour et al.'s protocol: the (translated) test set the model trained for, then the
    affNIST-style sets at each fraction of affNIST's ranges (0: the digit centred)."""
    checked = [(key, r["affine"]) for key, r in res.items() if r["affine"] is not None]
    if not checked:
        return []
    fractions = _magnitudes([a for _, a in checked], "")
    lines = [
        "",
        f"| checkpoint | test ({checked[0][1]['dataset']}) | affNIST-style 40x40, at "
        f"{fractions} of affNIST's ranges |",
        "|---|---|---|",
    ]
    for (member, seed), a in checked:
        lines.append(f"| {member}, seed {seed} | {_pct(a['clean_accuracy'])} | {_sweep(a)} |")
    return lines


def _provenance(folder: Path) -> dict[str, Any]:
    """Where a checkpoint was measured: ``cpu``, ``cores``, ``torch`` and the ``commits`` of its
    kinds of measurement, from the ``provenance`` each measurement's JSON carries, and for
    older measurements without one from the folder's ``provenance.json``."""
    path = folder / "provenance.json"
    base = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    found: dict[str, Any] = {k: v for k, v in base.items() if k in ("cpu", "cores", "torch")}
    commits: dict[str, str] = {}
    for kind in KINDS:
        doc = folder / f"{kind}.json"
        if not doc.is_file():
            continue
        own = json.loads(doc.read_text(encoding="utf-8")).get("provenance") or {}
        if own.get("commit"):
            commits[kind] = own["commit"]
            found = {"cpu": own["cpu"], "cores": own["cores"], "torch": own["torch_version"]}
        elif base:
            commits[kind] = base.get("commits", {}).get(kind, base["commit"])
        else:
            raise SystemExit(f"{doc}: no provenance in it and no provenance.json beside it")
    return found | {"commits": commits}


def table(suite_folder: Path) -> str:
    """Markdown tables of one suite's measured checkpoints (attacks and corruptions; shift
    sweeps; the CW check; the affNIST-style sets), each only where something was measured,
    and a line naming where and at which commits."""
    found = checkpoints(suite_folder)
    if not found:
        return "(no robustness measured yet)\n"
    res = {(m, s): {k: _result(f, k) for k in KINDS} for m, s, f in found}
    radii = _radii([r[k] for r in res.values() for k in ("attacks", "attacks-cw")])
    lines = _attack_table(res, radii) + _sweep_table(res) + _cw_table(res, radii)
    lines += _affine_table(res)
    if lines[0] == "":
        lines = lines[1:]
    machines: set[str] = set()
    commits: dict[str, list[str]] = defaultdict(list)
    for member, seed, folder in found:
        p = _provenance(folder)
        machines.add(f"{p['cpu']} ({p['cores']} cores), torch {p['torch']}")
        for commit in sorted({c[:9] for c in p["commits"].values()}):
            commits[commit].append(f"{member} {seed}")
    datasets = sorted(
        {
            f"{v['dataset']}, first {v['count']:,} images"
            for r in res.values()
            for v in r.values()
            if v
        }
    )
    which = ", ".join(f"{c} ({', '.join(m)})" for c, m in commits.items())
    rel = suite_folder.relative_to(ROOT) if suite_folder.is_relative_to(ROOT) else suite_folder
    note = weights_note(
        suite_folder.name.removesuffix("-cpu"), [(m, s, res[(m, s)]) for m, s, _ in found]
    )
    lines += [
        "",
        note,
        "",
        f"Accuracy in % on {'; '.join(datasets)}. Measured on {'; '.join(sorted(machines))}; "
        f"capsctl commits {which}; `{rel}/`.",
    ]
    return "\n".join(lines) + "\n"


def weights_note(suite: str, found: list[tuple[str, int, dict[str, Any]]]) -> str:
    """Which weights the rows were measured on: shipped ones (a shipped name, or a file of
    capsctl/weights/), which anyone can measure again, and run checkpoints that are not
    shipped (saying where a shipped file of the member's name is another training of it)."""
    names = {w.name for w in list_weights()}
    shipped, unshipped = [], []
    for member, seed, kinds in found:
        ckpts = {str(r["checkpoint"]) for r in kinds.values() if r and r.get("checkpoint")}
        own = {c for c in ckpts if c in names or "capsctl/weights/" in c}
        label = f"{member} {seed}"
        if own and own == ckpts:
            shipped.append(f"{label} ({', '.join(sorted(Path(c).name for c in own))})")
        elif f"{suite}.{member}" in names:
            unshipped.append(f"{label} (shipped: {suite}.{member}, another training of it)")
        else:
            unshipped.append(label)
    parts = []
    if shipped:
        parts.append(
            f"Measured on shipped weights: {', '.join(shipped)}; `capsctl robustness NAME` "
            "with the settings above measures them again."
        )
    if unshipped:
        parts.append(f"Measured on run checkpoints that are not shipped: {', '.join(unshipped)}.")
    return " ".join(parts)


def render(text: str, root: Path | None = None) -> str:
    """``text`` with every robustness block replaced by its tables (of ``root``, by default
    benchmarks/robustness/)."""
    root = MEASURED if root is None else root

    def one(m: re.Match[str]) -> str:
        return m.group(1) + table(root / m.group("name")) + m.group(4)

    return _BLOCK.sub(one, text)


def plotted(suite_folder: Path) -> tuple[list[Any], list[str]]:
    """One result per measured checkpoint for the pictures, and its label (``member, seed N``):
    its untargeted PGD attacks with its own loss, and the shifts of every sweep it had."""
    from capsctl.robustness.results import RobustnessResult

    results, labels = [], []
    for member, seed, folder in checkpoints(suite_folder):
        found = {k: _result(folder, k) for k in ("attacks", "rotate", "translate", "affine")}
        docs = [d for d in found.values() if d is not None]
        if not docs:
            continue
        r = RobustnessResult.from_dict(found["attacks"] or docs[0])
        r.attacks = [a for a in r.attacks if a.attack == "pgd" and not a.targeted]
        r.shifts = [
            p
            for d in docs
            if d is not found["attacks"]
            for p in RobustnessResult.from_dict(d).shifts
        ]
        results.append(r)
        labels.append(f"{member}, seed {seed}")
    return results, labels


def pictures(out: Path, overwrite: bool = False, root: Path | None = None) -> list[Path]:
    """Every suite's pictures (of ``root``, by default benchmarks/robustness/), each suite in
    its own folder of ``out``."""
    from capsctl.robustness.plot import plot_robustness

    written: list[Path] = []
    for folder in sorted(p for p in (MEASURED if root is None else root).glob("*") if p.is_dir()):
        results, labels = plotted(folder)
        if results:
            written += plot_robustness(
                results, out / folder.name, overwrite=overwrite, labels=labels
            )
    return written


def main(argv: list[str] | None = None) -> int:
    def print_all() -> None:
        for folder in sorted(p for p in MEASURED.glob("*") if p.is_dir()):
            print(f"## {folder.name}\n\n{table(folder)}")

    return readme_main(
        argv,
        doc=__doc__ or "",
        what="robustness",
        source="benchmarks/robustness/",
        script="robustness_table.py",
        render=render,
        print_all=print_all,
        root=ROOT,
        pictures=pictures,
    )


if __name__ == "__main__":
    sys.exit(main())
