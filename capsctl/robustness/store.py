"""Finished robustness settings kept on disk, so an interrupted measurement resumes.

``capsctl robustness --resume-file FILE`` appends one JSON line per finished setting (an attack
at one radius, a shift at one magnitude, a corruption at its five severities): the checkpoint's
fingerprint (resolved path, size, modification time), the setting with every option that
changes its numbers, and its result. A rerun with the same file takes each setting it finds
there instead of measuring it again; a retrained checkpoint or other options miss and are
measured anew. A line cut short by a kill is ignored (its setting is measured again). Lines
are flushed and synced as they are written, so a Ctrl-C or a kill loses at most the setting in
progress.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from capsctl.errors import UsageError

__all__ = ["HEADER", "PointStore", "fingerprint"]

HEADER = {"capsctl": "robustness settings", "version": 1}


def fingerprint(path: str | Path) -> dict[str, Any]:
    """What identifies a checkpoint's weights without reading them: its resolved path, size and
    modification time (a model folder: of its ``best.safetensors`` or ``last.safetensors``)."""
    p = Path(path).resolve()
    if p.is_dir():
        p = next((p / n for n in ("best.safetensors", "last.safetensors") if (p / n).is_file()), p)
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PointStore:
    """The finished settings in one ``--resume-file`` (created with its header if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._done: dict[str, dict[str, Any]] = {}
        if self.path.is_dir():
            raise UsageError(f"--resume-file {self.path}: is a folder; give a file name")
        if not self.path.exists():
            self._append(HEADER)
            return
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        try:
            head = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            head = None
        if head != HEADER:
            raise UsageError(
                f"--resume-file {self.path}: not a file of finished robustness settings; "
                "pick another name"
            )
        for line in lines[1:]:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a kill cut short: measured again
            self._done[self._key(doc["checkpoint"], doc["setting"])] = doc["result"]
        if not text.endswith("\n"):  # a kill cut the last line short: start the next one afresh
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")

    @staticmethod
    def _key(checkpoint: dict[str, Any], setting: dict[str, Any]) -> str:
        return json.dumps([checkpoint, setting], sort_keys=True)

    def _append(self, doc: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(doc, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, checkpoint: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any] | None:
        """The result kept for this checkpoint and setting, or None."""
        return self._done.get(self._key(checkpoint, setting))

    def put(
        self, checkpoint: dict[str, Any], setting: dict[str, Any], result: dict[str, Any]
    ) -> None:
        """Keep a finished setting's result (on disk before this returns)."""
        self._append({"checkpoint": checkpoint, "setting": setting, "result": result})
        self._done[self._key(checkpoint, setting)] = result

    def __len__(self) -> int:
        return len(self._done)
