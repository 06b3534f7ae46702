"""``capsctl train`` as one library call: a preset (or a run to resume), overrides, a run folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capsctl.config import Preset, apply_overrides, load_preset, preset_from_dict, preset_to_dict
from capsctl.errors import UsageError
from capsctl.events import EventFn
from capsctl.numbers import duration_seconds
from capsctl.training.resume import load_resume_preset
from capsctl.training.trainer import FitResult, fit

__all__ = ["flag_overrides", "parse_duration", "resolve_run", "train_from_preset"]


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds of ``text``: a number of seconds, or a number with ``s``, ``m`` or ``h``
    (``90s``, ``30m``, ``1.5h``); UsageError otherwise."""
    seconds = duration_seconds(text)  # the syntax of --time-limit's parser (capsctl/numbers.py)
    if seconds <= 0:
        raise UsageError(f"{what} {text!r}: must be more than 0 seconds (e.g. 90s, 30m, 1.5h)")
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(
            f"{what} {text!r}: not a duration; use seconds or a number with s, m or h "
            "(e.g. 1800, 30m, 1.5h)"
        )
    return seconds


def flag_overrides(**flags: Any) -> list[str]:
    """Command-line flags as ``--set`` overrides (None means "not given", and so does False,
    except for ``amp``, where False is ``--no-amp``).

    Keys: ``epochs``, ``time_limit`` (a duration: ``1800``, ``90s``, ``30m``, ``1.5h``),
    ``batch_size``, ``lr``, ``device``, ``data_dir``, ``seed``, ``deterministic``, ``amp``,
    ``compile``.
    """
    paths = {
        "epochs": "train.epochs",
        "time_limit": "train.time_limit",
        "batch_size": "train.batch_size",
        "lr": "train.lr",
        "device": "train.device",
        "data_dir": "data.data_dir",
        "seed": "train.seed",
        "deterministic": "train.deterministic",
        "amp": "train.amp",
        "compile": "train.compile",
    }
    unknown = set(flags) - set(paths)
    if unknown:
        raise TypeError(f"unknown training flags: {', '.join(sorted(unknown))}")
    out = []
    for key, path in paths.items():
        value = flags.get(key)
        if value is None or (value is False and key != "amp"):
            continue
        if key == "time_limit":
            value = parse_duration(str(value), "--time-limit")
        text = (
            {True: "true", False: "false"}.get(value, str(value))
            if isinstance(value, bool)
            else str(value)
        )
        out.append(f"{path}={text}")
    return out


def resolve_run(
    preset: str | None,
    resume: str | Path | None,
    out: str | Path | None,
    overrides: Sequence[str],
) -> tuple[Preset, Path]:
    """The preset to train and its run folder (default ``runs/<preset name>``; on resume, the
    checkpoint's folder)."""
    if resume is not None:
        if preset is not None:
            raise UsageError(
                f"--preset {preset} with --resume: a resumed run keeps the preset it was "
                "trained with; drop --preset (change fields with --set where allowed)"
            )
        resume = Path(resume)
        if not resume.exists():
            raise UsageError(f"--resume {resume}: no such file")
        base = load_resume_preset(resume)
        p = preset_from_dict(apply_overrides(preset_to_dict(base), list(overrides)))
        return p, Path(out) if out is not None else resume.parent
    if preset is None:
        raise UsageError("missing --preset NAME|FILE (see capsctl presets), or --resume CKPT")
    p = load_preset(preset, list(overrides))
    return p, Path(out) if out is not None else Path("runs") / (p.name or Path(preset).stem)


def train_from_preset(
    preset: str | None = None,
    *,
    resume: str | Path | None = None,
    out: str | Path | None = None,
    overrides: Sequence[str] = (),
    overwrite: bool = False,
    on_event: EventFn = None,
    handle_sigint: bool = True,
    **flags: Any,
) -> FitResult:
    """Train a preset (a bundled name or a YAML file) or resume a run, as ``capsctl train`` does.

    ``overrides`` are ``--set dotted.path=value`` strings; ``flags`` are the command's shortcuts
    (see :func:`flag_overrides`) and apply after them, except ``router`` (a routing algorithm's
    name: the preset's model with that router and its own defaults), which applies before them
    so that ``--set model.router.iterations=5`` reaches the new router.
    """
    router = flags.pop("router", None)
    first = [f"model.router={router}"] if router else []
    p, run_dir = resolve_run(preset, resume, out, [*first, *overrides, *flag_overrides(**flags)])
    return fit(
        p,
        run_dir,
        resume=resume,
        overwrite=overwrite,
        on_event=on_event,
        handle_sigint=handle_sigint,
    )
