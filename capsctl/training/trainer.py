"""The fit loop: set up, restore, train an epoch, end an epoch, test once.

Data flow of :func:`fit`: preset -> datasets (train split into train/val, test kept apart,
:mod:`capsctl.data.prepare`) -> model (:func:`capsctl.models.build_model_from_config`) ->
optimizer, per-step LR schedule, optional EMA (:mod:`capsctl.training.recipe`) -> epochs. After
each epoch the run folder (:mod:`capsctl.training.run_folder`) gets ``last.safetensors``
(weights and everything needed to resume) and, when validation accuracy improved,
``best.safetensors``; ``metrics.jsonl`` gets one line. At the end the best weights are evaluated
once on the test split.

Ctrl-C is turned into a flag checked between steps: the loop saves a mid-epoch checkpoint and
raises :class:`Interrupted`; resuming skips the batches already done (the loader's order is a
function of the seed and the epoch), so a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import copy
import shlex
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import capsctl.training.run_folder as files
from capsctl.checkpoint import (
    capture_rng_state,
    model_tensors,
    pack_training_state,
    save_checkpoint,
)
from capsctl.config import Preset
from capsctl.devices import autocast, flush_denormals, resolve_device
from capsctl.errors import DivergedError
from capsctl.evaluation import EvalResult, evaluate
from capsctl.events import EventFn, emit
from capsctl.losses import count_correct
from capsctl.provenance import machine_load
from capsctl.training.distributed import Distributed
from capsctl.training.ending import FitResult, RunEnd
from capsctl.training.epoch_stats import EpochStats
from capsctl.training.interrupt import Interrupted, sigint_as_flag, stop_exit_code
from capsctl.training.ownership import RunLock, clear_temp_files, recover_parked
from capsctl.training.phases import PhaseClock
from capsctl.training.setup import RunSetUp

__all__ = ["FitResult", "Interrupted", "Trainer", "fit"]

#: On an accelerator, steps between reads of the loss (its finiteness and the progress shown):
#: every read waits for the device to finish its queued work.
SYNC_EVERY = 25


def fit(
    preset: Preset,
    out_dir: str | Path,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    on_event: EventFn = None,
    handle_sigint: bool = True,
) -> FitResult:
    """Train ``preset`` into ``out_dir``; resume from a ``last.safetensors`` if given.

    Started by ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel:
    ``train.batch_size`` is then the global batch, split evenly over the processes.
    """
    t_start = time.perf_counter()
    out = Path(out_dir)
    dist = Distributed.from_env(resolve_device(preset.train.device))
    lock = RunLock(out) if dist.is_main else None
    try:
        if lock is not None:
            files.check_out_dir(out, True, True)  # a file where the folder should be
            lock.acquire()  # one run per folder; a dead run's lock dies with it
            clear_temp_files(out)  # left by a killed process: nobody else writes here now
            recovered = recover_parked(out, files.RUN_FILES)  # a killed --overwrite
            if recovered is not None:
                emit(on_event, "warning", message=f"{out}: {recovered}")
        trainer = Trainer(preset, out, dist, on_event if dist.is_main else None, t_start)
        with sigint_as_flag(handle_sigint) as flag, flush_denormals(dist.device):
            try:
                trainer.set_up(resume, overwrite, flag)
                return trainer.run(flag)
            except BaseException:
                if trainer.replace is not None:  # no checkpoint of the new run yet
                    trainer.replace.restore()
                raise
    finally:
        if lock is not None:
            lock.release()
        dist.close()


class Trainer(RunSetUp, RunEnd):
    """One training run; :func:`fit` is its public face."""

    # -- the loop ------------------------------------------------------------------------------

    def run(self, flag: dict[str, bool]) -> FitResult:
        """Epochs until the last, the time limit (mid-epoch; :mod:`capsctl.training.budget`)
        or Ctrl-C; then the final test."""
        interrupted_in: int | None = None
        with self.tensorboard or contextlib.nullcontext():
            for epoch in range(self.start_epoch, self.t.epochs):
                record = self.train_epoch(epoch, flag)
                if record is None:
                    interrupted_in = epoch
                    break
                if self.end_epoch(record):
                    break
        if interrupted_in is not None:
            raise Interrupted(
                f"interrupted during epoch {interrupted_in + 1}; the run is saved, resume with "
                f"capsctl train --resume {shlex.quote(str(self.out / files.LAST))}",
                exit_code=stop_exit_code(flag),
            )
        return self.finish()

    def train_epoch(self, epoch: int, flag: dict[str, bool]) -> dict[str, Any] | None:
        """Train one epoch; its metrics record, or None when Ctrl-C stopped it (saved)."""
        t = self.t
        self.model.train()
        self.loader.set_epoch(epoch)
        emit(
            self.on_event,
            "epoch_start",
            epoch=epoch + 1,
            epochs=t.epochs,
            steps=self.steps_per_epoch,
        )
        t0 = time.perf_counter()
        resumed = self.partial if epoch == self.start_epoch else None
        stats = EpochStats.start(self.device, resumed)
        skip = int(resumed["step"]) if resumed else 0
        out_of_time = False
        clock = PhaseClock()
        for step, (x, y) in enumerate(self.loader):
            clock.lap("data")
            if step >= self.steps_per_epoch:
                break
            if step < skip:
                continue  # done before the interruption; the loader's order is f(seed, epoch)
            t_step = time.perf_counter()
            self._train_step(epoch, step, (x, y), stats, flag, t0, clock)
            self.budget.note_train(int(y.shape[0]), time.perf_counter() - t_step)
            if flag["stop"]:
                self._save_mid_epoch(epoch, step + 1, stats, time.perf_counter() - t0)
                return None
            if self.t.time_limit is not None and self.dist.any_flags(self.budget.spent())[0]:
                out_of_time = True  # the epoch ends here: validation, checkpoints, test
                break
            clock.lap("other")
        piece = time.perf_counter() - t0  # this process's part of the epoch
        loss_sum, correct, seen = self.dist.sum_stats(stats.loss_sum, stats.correct, stats.seen)
        return {
            "epoch": epoch + 1,
            "train_loss": float(loss_sum) / max(seen, 1),
            "train_accuracy": float(correct) / max(seen, 1),
            "lr": self.optimizer.param_groups[0]["lr"],
            "epoch_seconds": stats.seconds(piece),
            "precision": "bf16" if self.amp else "float32",  # train.amp as resolved here
            **machine_load(),
            "images": int(seen),
            # this process's rate, scaled to the images of every process
            "images_per_s": stats.images_per_s(piece) * seen / max(stats.seen, 1),
            **stats.grad_record(),
            **clock.record(),
            **({"time_limit": True} if out_of_time else {}),
        }

    def _train_step(
        self,
        epoch: int,
        step: int,
        batch: tuple[Tensor, Tensor],
        stats: EpochStats,
        flag: dict[str, bool],
        t0: float,
        clock: PhaseClock,
    ) -> None:
        t, (x, y) = self.t, batch
        if t.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(self.device, self.amp):
            logits = self.step_fn(x)
            progress = self.budget.progress(epoch * self.steps_per_epoch + step)
            loss = self.loss_fn(logits.float(), y, progress)
        self._check_finite(loss, epoch, step, stats, flag)
        clock.lap("forward")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clock.lap("backward")
        # the total norm before clipping (no clipping: max_norm inf scales by exactly 1)
        clip = float("inf") if t.grad_clip is None else t.grad_clip
        stats.note_grad_norm(nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.model)
        clock.lap("optimizer")
        images = int(y.shape[0])  # y: [b] labels, or [b, 2] for a multi-label image
        stats.loss_sum += loss.detach() * images
        stats.correct += count_correct(logits.detach(), y)
        stats.seen += images
        report = stats.first_bad is None or (step + 1) % SYNC_EVERY == 0
        if self.on_event is not None and (report or step + 1 == self.steps_per_epoch):
            elapsed = max(time.perf_counter() - t0, 1e-9)
            self.on_event(
                {
                    "event": "step",
                    "epoch": epoch + 1,
                    "epochs": t.epochs,
                    "step": step + 1,
                    "steps": self.steps_per_epoch,
                    "loss": float(loss.detach()),
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "images_per_s": (stats.seen - stats.resumed_seen) / elapsed,
                }
            )

    def _check_finite(
        self, loss: Tensor, epoch: int, step: int, stats: EpochStats, flag: dict[str, bool]
    ) -> None:
        """A non-finite loss ends the run. On a CPU it is seen at once; on an accelerator the
        first bad step is kept on the device and read every :data:`SYNC_EVERY` steps and at
        the end of the epoch, so that steps never wait for the device."""
        last = step + 1 == self.steps_per_epoch
        if stats.first_bad is None:
            bad_now = not bool(torch.isfinite(loss))
        else:
            first = torch.where(torch.isfinite(loss), -1, step)
            stats.first_bad = torch.where(stats.first_bad < 0, first, stats.first_bad)
            if not (last or (step + 1) % SYNC_EVERY == 0):
                return
            bad_now = int(stats.first_bad) >= 0
        # with several processes, every rank learns of a bad loss or a Ctrl-C at once
        bad, flag["stop"] = self.dist.any_flags(bad_now, flag["stop"])
        if bad:
            at = step if stats.first_bad is None else max(int(stats.first_bad), 0)
            self._non_finite(loss, epoch, at)

    def _non_finite(self, loss: Tensor, epoch: int, step: int) -> None:
        last = self.out / files.LAST
        kept = (
            f"the last good checkpoint ({last}) is kept"
            if last.exists()
            else "no checkpoint was written yet"
        )
        raise DivergedError(
            f"loss became {float(loss.detach())} at epoch {epoch + 1}, step {step + 1}; {kept}. "
            "Lower train.lr or set train.grad_clip",
            epoch=epoch + 1,
            step=step + 1,
        )

    def _save_mid_epoch(self, epoch: int, done: int, stats: EpochStats, piece: float) -> None:
        """Save mid-epoch: resume skips the batches already done and continues exactly."""
        partial = stats.partial(done, piece)
        self.save_last(epoch, self.history[-1] if self.history else {}, {"partial": partial})

    # -- end of an epoch -----------------------------------------------------------------------

    def end_epoch(self, record: dict[str, Any]) -> bool:
        """Validation, checkpoints and the metrics line; True when the time limit is reached
        (in this epoch or at its end)."""
        if self.dist.is_main:
            self._validate_and_save(record)
        else:
            self.history.append(record)
        self.dist.barrier()
        over_time = bool(record.get("time_limit")) or self.budget.spent()
        if self.t.time_limit is not None and self.dist.any_flags(over_time)[0]:
            emit(self.on_event, "time_limit", epoch=record["epoch"])
            return True
        return False

    def _validate_and_save(self, record: dict[str, Any]) -> None:
        """Main process: validation, best/last checkpoints and the metrics line."""
        data = self.data
        if data.val is not None:
            t0 = time.perf_counter()
            ev = self._evaluate(self.eval_model(), data.val, "val")
            val_seconds = time.perf_counter() - t0
            self.budget.note_eval(len(data.val), val_seconds)
            record.update(val_loss=ev.loss, val_accuracy=ev.accuracy, val_top5=ev.top5)
            record["val_seconds"] = round(val_seconds, 4)
            improved = ev.accuracy > self.best_acc
        else:
            improved = True
        if self.t.time_limit is not None and self.budget.spent():
            record["time_limit"] = True  # the budget ran out during validation
        if improved:
            self.best_acc = record.get("val_accuracy", -1.0) if data.val is not None else -1.0
            self.best_epoch = int(record["epoch"])
            # kept in memory too: the final test runs on these weights, whatever is on disk
            self.best_state = {
                k: v.detach().to("cpu", copy=True)
                for k, v in model_tensors(self.eval_model()).items()
            }
            self.best_meta = {
                **self.base_meta,
                "epoch": record["epoch"],
                "metrics": record,
                "kind": "best",
            }
            save_checkpoint(self.out / files.BEST, self.best_state, self.best_meta)
        record["best"] = improved
        self.history.append(record)
        if self.tensorboard is not None:
            self.tensorboard.log_epoch(record)
        files.write_metrics(self.out / files.METRICS, self.history)
        self.save_last(int(record["epoch"]), record)
        emit(self.on_event, "epoch_end", **record, epochs=self.t.epochs)

    def eval_model(self) -> nn.Module:
        """The weights evaluation sees: the EMA's when it is on."""
        if self.ema is None:
            return self.model
        shadow = copy.deepcopy(self.model)
        shadow.load_state_dict(self.ema.state_dict())
        return shadow

    def _evaluate(self, model: nn.Module, ds: Any, split: str) -> EvalResult:
        data = self.data
        return evaluate(
            model,
            ds,
            batch_size=self.t.eval_batch_size,
            device=self.device,
            mean=data.mean,
            std=data.std,
            classes=data.classes,
            split=split,
            amp=self.amp,
            loss=self.own_loss,
            flip=self.preset.data.augment.test_flip,
        )

    def save_last(
        self, epoch: int, metrics: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> None:
        if not self.dist.is_main:
            return
        tensors, state_meta = pack_training_state(
            self.optimizer.state_dict(),
            self.scheduler.state_dict(),
            self.ema.state_dict() if self.ema else None,
            capture_rng_state(),
        )
        best_acc = self.best_acc if self.best_acc >= 0 else None
        meta = {
            **self.base_meta,
            "epoch": epoch,
            "metrics": metrics,
            "kind": "last",
            "elapsed": self.budget.elapsed(),
            "best": {"epoch": self.best_epoch, "val_accuracy": best_acc},
            **state_meta,
            **(extra or {}),
        }
        save_checkpoint(self.out / files.LAST, {**model_tensors(self.model), **tensors}, meta)
        if self.replace is not None:  # the new run has its first checkpoint: the old one goes
            self.replace.commit()
            self.replace = None
        emit(self.on_event, "checkpoint", path=str(self.out / files.LAST), epoch=epoch)
