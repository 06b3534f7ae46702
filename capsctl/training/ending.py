"""The end of a training run: the final test on the selected weights, ``results.json`` and the
curves. :class:`RunEnd` is the last part of :class:`capsctl.training.trainer.Trainer`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import capsctl.training.run_folder as files
from capsctl.atomic import write_text_atomic
from capsctl.checkpoint import load_checkpoint, model_from_tensors, model_tensors, save_checkpoint
from capsctl.errors import CapsctlError
from capsctl.evaluation import EvalResult
from capsctl.events import emit

__all__ = ["FitResult", "RunEnd", "overshoot_warning"]


@dataclass
class FitResult:
    out_dir: Path
    epochs_done: int
    best_epoch: int | None
    best_val_accuracy: float | None
    test: EvalResult | None
    interrupted: bool
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "epochs_done": self.epochs_done,
            "best_epoch": self.best_epoch,
            "best_val_accuracy": self.best_val_accuracy,
            "test": self.test.to_dict() if self.test else None,
            "interrupted": self.interrupted,
            "seconds": self.seconds,
            "history": self.history,
        }


class RunEnd:
    """Mixed into the trainer, whose state (``self.out``, ``self.best_state``, ...) it reads."""

    out: Any
    t: Any
    dist: Any
    preset: Any
    data: Any
    device: Any
    on_event: Any
    history: list[dict[str, Any]]
    start_epoch: int
    best_epoch: int | None
    best_acc: float
    best_state: dict[str, Any] | None
    best_meta: dict[str, Any] | None
    run_id: str
    budget: Any
    _evaluate: Any

    def finish(self) -> FitResult:
        """Test the best weights once, write results.json and the curves."""
        tested = self.dist.is_main and self.t.final_test
        test = self._final_test() if tested else None
        epochs_done = self.history[-1]["epoch"] if self.history else self.start_epoch
        result = FitResult(
            self.out,
            epochs_done,
            self.best_epoch,
            self.best_acc if self.best_acc >= 0 else None,
            test,
            False,
            self.budget.elapsed(),  # this process's seconds and those of earlier ones
            self.history,
        )
        late = overshoot_warning(result.seconds, self.t.time_limit)
        if late is not None:
            emit(self.on_event, "warning", message=late)
        if self.dist.is_main:
            write_text_atomic(self.out / files.RESULTS, json.dumps(result.to_dict(), indent=2))
            if self.preset.log.curves:
                files.draw_curves(self.out, self.on_event)
        return result

    def _final_test(self) -> EvalResult | None:
        """Test the selected weights: those kept in memory, or (a resumed run whose best epoch
        came before the resume) ``best.safetensors`` once it is shown to be this run's."""
        best = self.out / files.BEST
        if self.best_state is not None and self.best_meta is not None:
            best_meta = dict(self.best_meta)
            best_model = model_from_tensors(best, best_meta, self.best_state).to(self.device)
        elif best.exists():
            best_model, best_meta = load_checkpoint(best, device=self.device)
            if best_meta.get("run_id") not in (None, self.run_id):
                raise CapsctlError(
                    f"{best}: written by another run (run id {best_meta.get('run_id')}, this "
                    f"run's is {self.run_id}); the final test is skipped. Train into a folder "
                    "of its own"
                )
        else:
            return None
        result = self._evaluate(best_model, self.data.test, "test")
        summary = {k: v for k, v in result.to_dict().items() if k != "confusion"}
        best_meta["test"] = summary
        best_meta["test_name"] = self.data.test_name
        save_checkpoint(best, model_tensors(best_model), best_meta)
        emit(self.on_event, "test", **summary)
        return result


def overshoot_warning(seconds: float, limit: float | None) -> str | None:
    """What to tell the user when a run took well over its time limit (more than 10% and 2 s
    over), else None."""
    if limit is None or seconds <= 1.1 * limit + 2.0:
        return None
    return (
        f"the run took {seconds:.0f} s against its time limit of {limit:g} s: start-up, one "
        "training step and the final test cannot be cut shorter; give a budget of at least a "
        "few steps"
    )
