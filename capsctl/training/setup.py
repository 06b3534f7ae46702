"""Everything before the first training step: data, model, recipe, and the state of a resumed run.

:class:`RunSetUp` is the first half of :class:`capsctl.training.trainer.Trainer`: it builds the
run in a fixed order (the order matters for exact resume: the seed is set before the data and
the model are built) and, on ``--resume``, loads weights, optimizer, schedule, EMA, RNG state and
the position inside the epoch.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

import capsctl.training.run_folder as files
from capsctl.atomic import write_text_atomic
from capsctl.checkpoint import (
    load_tensors,
    read_metadata,
    restore_rng_state,
    stored_preset,
    unpack_training_state,
)
from capsctl.compile_cache import use_private_compile_cache
from capsctl.config import Preset, dump_yaml, preset_to_dict
from capsctl.data import Loader
from capsctl.data.prepare import RunData, prepare_data
from capsctl.devices import resolve_amp
from capsctl.errors import CheckpointError, ConfigError
from capsctl.events import EventFn, emit
from capsctl.losses import eval_loss, make_loss
from capsctl.models import build_model_from_config, parameter_counts, to_channels_last
from capsctl.training.budget import TimeBudget
from capsctl.training.distributed import Distributed
from capsctl.training.interrupt import Interrupted
from capsctl.training.ownership import StagedReplace
from capsctl.training.recipe import EMA, make_optimizer, make_scheduler, seed_everything
from capsctl.training.resume import resume_changes
from capsctl.version import __version__

__all__ = ["RunSetUp"]


class RunSetUp:
    """A training run's state, built by :meth:`set_up`."""

    def __init__(
        self, preset: Preset, out: Path, dist: Distributed, on_event: EventFn, t_start: float
    ) -> None:
        self.preset, self.out, self.dist = preset, out, dist
        self.t, self.device = preset.train, dist.device
        self.on_event, self.t_start = on_event, t_start
        self.start_epoch, self.best_acc = 0, -1.0
        self.best_epoch: int | None = None
        self.partial: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self.tensorboard: Any = None
        self.replace: StagedReplace | None = None
        self.run_id = uuid.uuid4().hex
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_meta: dict[str, Any] | None = None

    # -- set-up --------------------------------------------------------------------------------

    def set_up(
        self, resume: str | Path | None, overwrite: bool, flag: dict[str, bool] | None = None
    ) -> None:
        """Data, model, recipe and (on resume) the stored state; Ctrl-C (``flag``) stops it
        between steps before anything is written."""
        t, dist = self.t, self.dist
        flag = flag if flag is not None else {"stop": False}
        if t.compile:  # before any data loads: torch.compile's code only from a private folder
            use_private_compile_cache()
        fork = resume is not None and not _same_folder(Path(resume).parent, self.out)
        if dist.is_main:
            files.check_out_dir(self.out, resume is not None and not fork, overwrite)
            if overwrite and files.holds_run(self.out) and not (resume and not fork):
                self.replace = StagedReplace(self.out, files.RUN_FILES)
        if t.batch_size % dist.world_size:
            raise ConfigError(
                f"train.batch_size: {t.batch_size} is the global batch and must be divisible by "
                f"the {dist.world_size} processes"
            )
        meta: dict[str, Any] = {}
        changes: list[dict[str, Any]] = []
        if resume is not None:  # refuse a changed recipe before any work
            meta = read_metadata(resume)
            changes = resume_changes(stored_preset(meta, Path(resume)), self.preset)
        seed_everything(t.seed, t.deterministic)
        self.data = prepare_data(self.preset, self.on_event)
        self._emit_data(self.data)
        self.amp, why = resolve_amp(t.amp, self.device)  # bf16 autocast, or float32
        emit(self.on_event, "precision", amp=self.amp, reason=why)
        self._emit_routing()
        self._stop_if_asked(flag, resume)
        self._build_model()
        self._build_loader_and_recipe()
        self._stop_if_asked(flag, resume)
        if dist.is_main:  # every check passed: the old run (--overwrite) steps aside
            self.out.mkdir(parents=True, exist_ok=True)
            if self.replace is not None:
                self.replace.stage()
            if fork:
                _fork_run(Path(resume).parent, self.out)  # type: ignore[arg-type]
        if resume is not None:
            self._restore(Path(resume), meta, changes)
            self.run_id = str(meta.get("run_id") or self.run_id)
        if dist.is_main:
            write_text_atomic(self.out / files.RESOLVED_PRESET, dump_yaml(self.preset))
        self.base_meta = self._base_meta()
        if dist.is_main and self.preset.log.tensorboard:
            from capsctl.curves import TensorBoardLogger

            self.tensorboard = TensorBoardLogger(self.out, resume_epoch=self.start_epoch)

    def _stop_if_asked(self, flag: dict[str, bool], resume: str | Path | None) -> None:
        if flag["stop"]:
            what = "the run is unchanged" if resume is not None else "nothing was written"
            raise Interrupted(
                f"interrupted before training started; {what}: run the same command again"
            )

    def _emit_data(self, data: RunData) -> None:
        emit(
            self.on_event,
            "data",
            train=len(data.train),
            val=len(data.val) if data.val is not None else 0,
            test=len(data.test),
            test_name=data.test_name,
            classes=len(data.classes),
        )

    def _emit_routing(self) -> None:
        """A capsule net's header line: which implementation runs its routing's passes on the
        training device, and why no faster one does (a missing Triton, no C++ compiler)."""
        if self.preset.model.arch != "capsnet":
            return
        from capsctl.layers import dispatch

        choice = dispatch.expected(self.device)
        emit(self.on_event, "routing", backend=choice.backend, reason=choice.reason)

    def _build_model(self) -> None:
        t = self.t
        model = build_model_from_config(self.preset.model)
        if t.sync_bn and self.dist.world_size > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        if t.channels_last:
            model = to_channels_last(model)
        self.model = model
        self.optimizer = make_optimizer(model, self.preset)

    def _build_loader_and_recipe(self) -> None:
        t, data, dist = self.t, self.data, self.dist
        aug = self.preset.data.augment
        self.loader = Loader(
            data.train,
            t.batch_size // dist.world_size,
            rank=dist.rank,
            world_size=dist.world_size,
            shuffle=True,
            seed=t.seed,
            device=self.device,
            mean=data.mean,
            std=data.std,
            crop_padding=aug.crop_padding,
            hflip=aug.hflip,
            drop_last=True,
        )
        steps = len(self.loader)
        if steps == 0:
            raise ConfigError(
                f"train.batch_size: {t.batch_size} is larger than the training set "
                f"({len(data.train)})"
            )
        self.steps_per_epoch = min(steps, t.steps_per_epoch) if t.steps_per_epoch else steps
        self.total_steps = max(1, t.epochs * self.steps_per_epoch)
        tested = len(data.test) if t.final_test else 0  # images of the final test, if any
        after_last_step = (len(data.val) if data.val is not None else 0) + tested
        self.budget = TimeBudget(t.time_limit, self.total_steps, after_last_step, self.t_start)
        self.scheduler = make_scheduler(
            self.optimizer, self.preset, self.steps_per_epoch, self.budget.progress_steps
        )
        self.ema = EMA(self.model, t.ema_decay) if t.ema_decay else None
        multi_label = data.train.labels.dim() == 2
        self.loss_fn = make_loss(self.preset, multi_label, len(data.classes))
        self.own_loss = eval_loss(self.preset, multi_label, len(data.classes))
        step_fn: nn.Module = dist.wrap(self.model)
        self.step_fn = torch.compile(step_fn) if t.compile else step_fn

    def _restore(self, resume: Path, meta: dict[str, Any], changes: list[dict[str, Any]]) -> None:
        """Weights, optimizer, schedule, EMA, RNG and position of a ``last.safetensors``."""
        tensors = load_tensors(resume)
        state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
        try:
            self.model.load_state_dict(state)
        except RuntimeError as e:
            raise CheckpointError(
                f"{resume}: its weights do not fit the preset's model ({str(e)[:120]})"
            ) from None
        opt_state, sched_state, ema_state, rng = unpack_training_state(tensors, meta)
        self.optimizer.load_state_dict(opt_state)
        if sched_state is not None:
            self.scheduler.load_state_dict(sched_state)
        if self.ema is not None:
            # EMA switched on at resume starts from the resumed weights, not the initial ones.
            self.ema = EMA(self.model, self.ema.decay)
            if ema_state is not None:
                self.ema.load_state_dict(ema_state)
        restore_rng_state(rng)
        self.budget.before = float(meta.get("elapsed", 0.0))
        self.start_epoch = int(meta.get("epoch", 0))
        self.partial = meta.get("partial")
        best = meta.get("best") or {}
        # No best epoch yet (Ctrl-C before the first validation) or no validation split: null.
        stored_acc = best.get("val_accuracy")
        self.best_acc = float(stored_acc) if stored_acc is not None else -1.0
        self.best_epoch = best.get("epoch")
        if self.dist.is_main:
            self.history = files.truncate_metrics(self.out / files.METRICS, self.start_epoch)
        emit(self.on_event, "resume", path=str(resume), epoch=self.start_epoch, changes=changes)

    def _base_meta(self) -> dict[str, Any]:
        p, data = self.preset, self.data
        return {
            "preset": preset_to_dict(p),
            "classes": data.classes,
            "normalization": {"name": p.data.normalization, "mean": data.mean, "std": data.std},
            "input_size": p.model.input_size,
            "in_channels": p.model.in_channels,
            "dataset": p.data.dataset,
            "dataset_fingerprint": data.fingerprint,
            "params": parameter_counts(self.model),
            "run_id": self.run_id,
            "capsctl_version": __version__,
            "torch_version": torch.__version__,
        }


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _fork_run(source: Path, out: Path) -> None:
    """``--resume SRC/last.safetensors --out NEW``: NEW gets the source run's best checkpoint
    and metrics, so the run continues there whole (the source folder is left as it is)."""
    for name in (files.BEST, files.METRICS):
        if (source / name).exists():
            tmp = out / f".{name}.fork.tmp"
            shutil.copyfile(source / name, tmp)
            tmp.replace(out / name)
