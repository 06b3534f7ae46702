"""Pictures of a suite report: accuracy against parameters and against GFLOPs, with error bars
(the standard deviation over seeds). Needs matplotlib (``capsctl[plot]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capsctl.atomic import temp_path
from capsctl.errors import CapsctlError

__all__ = ["suite_plot"]


def suite_plot(doc: dict[str, Any], folder: Path, *, overwrite: bool = False) -> list[str]:
    """Accuracy against parameters and against GFLOPs, with error bars (std over seeds), one
    PNG each in ``folder`` (created if missing); needs matplotlib (``capsctl[plot]``)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CapsctlError(f"--png needs matplotlib ({e}); pip install 'capsctl[plot]'") from None
    test = doc["tests"][0]
    written = []
    for key, label, log in (("params", "parameters", True), ("gflops", "GFLOPs per image", True)):
        fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
        for r in doc["rows"]:
            t = r["tests"][test]
            if t["top1_mean"] is None or r[key] is None:
                continue
            ax.errorbar(
                r[key],
                100 * t["top1_mean"],
                yerr=100 * (t["top1_std"] or 0.0),
                fmt="o",
                capsize=4,
                label=r["member"],
            )
            ax.annotate(
                r["member"],
                (r[key], 100 * t["top1_mean"]),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel(f"top-1 % ({test})")
        ax.set_title(f"suite {doc['suite']}: mean ± std over seeds")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(folder) / f"{doc['suite']}-accuracy-vs-{key}.png"
        if path.exists() and not overwrite:
            plt.close(fig)
            raise CapsctlError(f"--png {path}: exists; pass --overwrite to replace it")
        tmp = temp_path(path)
        fig.savefig(tmp, format="png")
        plt.close(fig)
        tmp.replace(path)
        written.append(str(path))
    return written
