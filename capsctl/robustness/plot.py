"""Pictures of robustness results: accuracy against eps, accuracy against shift magnitude.

matplotlib (the ``plot`` extra) is imported only when a picture is drawn. Files are checked
before anything is drawn (an existing file needs ``overwrite``) and written atomically.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from capsctl.atomic import check_output, write_atomic
from capsctl.errors import CapsctlError
from capsctl.outputs import PNG
from capsctl.robustness.results import RobustnessResult

__all__ = ["plot_files", "plot_robustness"]

PLOT_MISSING = "robustness plots need matplotlib: pip install 'capsctl[plot]'"


def plot_files(results: Sequence[RobustnessResult], folder: Path) -> dict[str, Path]:
    """The pictures the results call for: ``accuracy-vs-eps.png`` when attacks ran,
    ``accuracy-vs-<shift>.png`` for each shift that ran and ``accuracy-vs-severity.png`` when
    the corruptions did."""
    files: dict[str, Path] = {}
    if any(r.attacks for r in results):
        files["eps"] = folder / "accuracy-vs-eps.png"
    for kind in sorted({p.shift for r in results for p in r.shifts}):
        files[kind] = folder / f"accuracy-vs-{kind}.png"
    if any(r.corruptions for r in results):
        files["severity"] = folder / "accuracy-vs-severity.png"
    return files


def _points(r: RobustnessResult, key: str) -> list[tuple[float, float]]:
    """``(x, accuracy %)`` of one result's curve in picture ``key`` other than eps: a shift's
    magnitudes, or severity 0 (clean) to 5, the mean over the corruptions."""
    if key != "severity":
        return [(p.magnitude, 100 * p.accuracy) for p in r.shifts if p.shift == key]
    rows = r.corruptions
    if not rows:
        return []
    means = [sum(c.accuracies[s] for c in rows) / len(rows) for s in range(5)]
    return [(float(s), 100 * a) for s, a in enumerate([r.clean_accuracy, *means])]


def _label(result: RobustnessResult, many: bool) -> str:
    return Path(result.checkpoint).parent.name + "/" + Path(result.checkpoint).name if many else ""


def _draw(
    results: Sequence[RobustnessResult], key: str, labels: Sequence[str] | None = None
) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CapsctlError(PLOT_MISSING) from None
    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    many = len(results) > 1
    for i, r in enumerate(results):
        name = _label(r, many) if labels is None else labels[i]
        if key == "eps":
            for attack in sorted({p.attack for p in r.attacks}):
                pts = [p for p in r.attacks if p.attack == attack]
                start = [] if any(p.eps == 0 for p in pts) else [(0.0, r.clean_accuracy)]
                xy = start + [(p.eps * 255, p.accuracy) for p in pts]
                xs, ys = [x for x, _ in xy], [100 * y for _, y in xy]
                ax.plot(xs, ys, marker="o", label=f"{name} {attack}".strip())
        else:
            pts = _points(r, key)
            fallback = "mean over the corruptions" if key == "severity" else key
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name or fallback)
    unit = {"eps": "eps (x 1/255)", "rotate": "rotation (degrees)", "translate": "pixels",
            "severity": "corruption severity (0 = clean)"}  # fmt: skip
    ax.set_xlabel(unit.get(key, "share of affNIST's ranges"))
    ax.set_ylabel("accuracy (%)")
    titles = {"eps": "accuracy against the attack's radius", "rotate": "accuracy against rotation",
              "translate": "accuracy against translation",
              "affine": "accuracy on affNIST-style sets",
              "severity": "mean accuracy over the CIFAR-10-C corruptions"}  # fmt: skip
    ax.set_title(titles.get(key, f"accuracy against {key}"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def plot_robustness(
    results: Sequence[RobustnessResult],
    folder: str | Path,
    *,
    overwrite: bool = False,
    labels: Sequence[str] | None = None,
) -> list[Path]:
    """Write the pictures of :func:`plot_files` into ``folder`` (created if missing); each
    result's curves are named by ``labels`` (default: the checkpoint, when there are several)."""
    if labels is not None and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CapsctlError(f"--png {folder}: not a folder; give a folder for the pictures")
    files = plot_files(results, folder)
    inputs = [r.checkpoint for r in results]
    for path in files.values():
        check_output(path, kind=PNG, inputs=inputs, overwrite=overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    for key, path in files.items():
        write_atomic(path, _draw(results, key, labels), overwrite=overwrite)
    return list(files.values())
