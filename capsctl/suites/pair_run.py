"""One pair's training: a new run, or a partial one resumed, and the record of what trained
it in the run's ``provenance.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from capsctl.atomic import write_text_atomic
from capsctl.events import EventFn
from capsctl.provenance import provenance
from capsctl.suites.pairs import Pair, pair_overrides
from capsctl.suites.run_files import read_json
from capsctl.suites.spec import Suite

__all__ = ["train_pair"]


def train_pair(
    suite: Suite,
    pair: Pair,
    resume: bool,
    limit: float | None,
    on_event: EventFn,
    handle_sigint: bool,
    data_dir: str | None,
) -> None:
    """Train a new pair (``limit``: a matched member's time limit) or resume a partial one,
    and record what trained it, once this process holds the pair's folder: a pair another
    process holds (busy) gets no record from this one."""
    from capsctl.training import train_from_preset

    started = provenance()  # the code that trains: the commit as it starts
    state = {"owned": False, "recorded": False}

    def record(event: dict[str, Any] | None = None) -> None:
        """Name the starting commit once this process holds the folder and the folder holds a
        checkpoint: a resumed run at its ``resume`` event, a new one at its first checkpoint
        (or the one an interruption leaves), so a run resumed later keeps it."""
        kind = None if event is None else event.get("event")
        if event is not None:
            state["owned"] = True  # training emits nothing before it holds the folder's lock
            if on_event is not None:
                on_event(event)
        due = kind == "resume" if resume else kind in (None, "checkpoint")
        due = due and state["owned"] and not state["recorded"]
        if due and (pair.folder / "last.safetensors").exists():
            _record_provenance(pair.folder, resume, started)
            state["recorded"] = True

    common = {"on_event": record, "handle_sigint": handle_sigint, "data_dir": data_dir}
    try:
        if resume:
            train_from_preset(resume=pair.folder / "last.safetensors", **common)
            return
        overrides = pair_overrides(suite, pair)
        if limit is not None:
            overrides.append(f"train.time_limit={limit:.0f}")
        train_from_preset(suite.recipe, out=pair.folder, overrides=overrides, **common)
    finally:
        record()


def _record_provenance(folder: Path, resumed: bool, record: dict[str, Any]) -> None:
    """Append this process's commit, machine and versions (``record``: as taken when its
    training started, since the checkout may move on while it trains) to the run's
    ``provenance.json``: every process that trained a run is named (a resumed run has
    several). A damaged file is refused (:func:`read_json`), never replaced."""
    path = folder / "provenance.json"
    doc = read_json(path)
    doc.setdefault("trained_by", []).append({**record, "resumed": resumed})
    write_text_atomic(path, json.dumps(doc, indent=2))
