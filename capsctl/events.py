"""Progress events: how library functions report progress without printing.

Every long-running library function takes ``on_event: EventFn = None`` and calls it with one
plain dict per event (JSON-serializable, so ``--json`` front ends and logs can pass it on).
Every event has ``"event"``: its kind. Kinds and their fields:

=================  ============================================================================
kind               fields
=================  ============================================================================
``progress``       ``task`` (what is counted, e.g. ``"eval"``), ``step``, ``steps`` (total or
                   None when unknown)
``step``           a training step: ``epoch``, ``epochs``, ``step``, ``steps``, ``loss``,
                   ``lr``, ``images_per_s``
``epoch_start``    ``epoch``, ``epochs``, ``steps``
``epoch_end``      the epoch's metrics record (see ``capsctl.training``) and ``epochs``
``warning``        ``message``: one line for the user
``download``       ``url``, ``done`` (bytes), ``total`` (bytes or None)
=================  ============================================================================

Other kinds carry the fields their emitter documents. Counts always use ``step``/``steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Event", "EventFn", "emit"]

Event = dict[str, Any]
EventFn = Callable[[Event], None] | None


def emit(on_event: EventFn, kind: str, **fields: Any) -> None:
    """Send one event of ``kind`` to ``on_event`` (a no-op when it is None)."""
    if on_event is not None:
        on_event({"event": kind, **fields})
