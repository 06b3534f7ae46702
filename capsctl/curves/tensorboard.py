"""Per-epoch scalars of a run as TensorBoard event files (``torch.utils.tensorboard``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError

__all__ = ["TB_TAGS", "TENSORBOARD_MISSING", "TensorBoardLogger"]

TENSORBOARD_MISSING = "TensorBoard logging needs tensorboard: pip install 'capsctl[tensorboard]'"

#: TensorBoard tag of each ``metrics.jsonl`` key (the first part groups charts in TensorBoard).
TB_TAGS: dict[str, str] = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "train_accuracy": "accuracy/train",
    "val_accuracy": "accuracy/val",
    "val_top5": "accuracy/val_top5",
    "lr": "lr",
    "images_per_s": "speed/images_per_s",
    "epoch_seconds": "speed/epoch_seconds",
    "data_seconds": "time/data",
    "forward_seconds": "time/forward",
    "backward_seconds": "time/backward",
    "optimizer_seconds": "time/optimizer",
    "other_seconds": "time/other",
    "val_seconds": "time/val",
    "grad_norm_mean": "grad_norm/mean",
    "grad_norm_max": "grad_norm/max",
}


class TensorBoardLogger:
    """Per-epoch scalars as TensorBoard event files in ``run_dir`` (``tensorboard --logdir``).

    The event files go straight into the run folder, so ``tensorboard --logdir runs`` shows
    each run folder as one run. :meth:`log_epoch` takes a ``metrics.jsonl`` record and writes
    every number it knows (:data:`TB_TAGS`, accuracies as fractions) at step = epoch, then
    flushes. ``resume_epoch``: the epochs already done; events an earlier process wrote for
    later epochs (or, with 0, for any epoch, as after ``--overwrite``) are hidden by
    TensorBoard (a purge marker at step ``resume_epoch + 1``). Needs the ``tensorboard``
    package (CapsctlError with the pip hint otherwise).
    """

    def __init__(self, run_dir: str | Path, *, resume_epoch: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise CapsctlError(TENSORBOARD_MISSING) from None
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CapsctlError(
                f"cannot create the folder {self.run_dir}: {e.strerror or e}"
            ) from None
        self._writer: Any = SummaryWriter(
            log_dir=str(self.run_dir), purge_step=int(resume_epoch) + 1
        )

    def log_epoch(self, record: dict[str, Any]) -> None:
        """Write the numbers of one epoch record (keys of :data:`TB_TAGS`; others ignored)."""
        if self._writer is None:
            raise CapsctlError(f"the TensorBoard log of {self.run_dir} is already closed")
        step = int(record["epoch"])
        for key, tag in TB_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a second call does nothing)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
