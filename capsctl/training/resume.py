"""What a resumed run may change, and what it may not.

The stored preset of ``last.safetensors`` is the run's recipe. Fields that only say how long,
where and with what logging the run goes on may change on ``--resume`` (they are applied and
reported); everything that shapes the data split, the batch order, the optimizer's trajectory or
the model is refused with one line naming the field and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capsctl.checkpoint import read_metadata, stored_preset
from capsctl.config import Preset, preset_to_dict
from capsctl.errors import UsageError

__all__ = ["RESUME_MAY_CHANGE", "load_resume_preset", "resume_changes"]


def load_resume_preset(path: str | Path) -> Preset:
    """The preset stored in a checkpoint (for ``--resume``)."""
    return stored_preset(read_metadata(path), Path(path))


# Fields a resumed run may change: how long it runs, where and how fast it computes, what it
# logs and which files hold the data. Everything else shapes the data split, the order of the
# batches, the optimizer's trajectory or the model, and is refused on resume.
RESUME_MAY_CHANGE = (
    "name",
    "description",
    "train.epochs",
    "train.time_limit",
    "train.device",
    "train.eval_batch_size",
    "train.amp",
    "train.compile",
    "train.channels_last",
    "train.deterministic",
    "train.ema_decay",
    "data.data_dir",
    "data.download",
    "data.test_file",
    "log.",
)

_RESUME_REFUSED_WHY = (
    (
        "train.seed",
        "it drew the validation split and the batch order; a new seed would put "
        "trained images into validation",
    ),
    ("train.batch_size", "the step-based LR schedule and the mid-epoch position depend on it"),
    ("train.steps_per_epoch", "the step-based LR schedule and the mid-epoch position depend on it"),
    ("data.", "the training and validation images depend on it"),
    ("model.", "the checkpoint's weights belong to the stored model"),
    ("train.", "the run's optimizer state and LR schedule depend on it"),
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key))
        else:
            flat[key] = v
    return flat


def resume_changes(stored: Preset, new: Preset) -> list[dict[str, Any]]:
    """The fields ``new`` changes in a run stored with ``stored``, as ``{field, old, new}``.

    Raises :class:`UsageError` naming the first field that may not change on resume and why
    (see :data:`RESUME_MAY_CHANGE`).
    """
    old_flat = _flatten(preset_to_dict(stored))
    new_flat = _flatten(preset_to_dict(new))
    changes = []
    for key in sorted(set(old_flat) | set(new_flat)):
        a, b = old_flat.get(key), new_flat.get(key)
        if a == b:
            continue
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in RESUME_MAY_CHANGE):
            changes.append({"field": key, "old": a, "new": b})
            continue
        why = next(
            (w for prefix, w in _RESUME_REFUSED_WHY if key.startswith(prefix)),
            "it is part of the run's recipe",
        )
        raise UsageError(
            f"{key}: cannot change on resume ({a!r} -> {b!r}): {why}; drop the override or "
            "start a new run"
        )
    return changes
