"""Finished robustness settings kept on disk, so an interrupted measurement resumes.

``capsctl robustness --resume-file FILE`` appends one JSON line per finished setting (an attack
at one radius, a shift at one magnitude, a corruption at its five severities): the checkpoint's
fingerprint (resolved path, size, modification time), the setting with every option that
changes its numbers, and its result. A rerun with the same file takes each setting it finds
there instead of measuring it again; a retrained checkpoint or other options miss and are
measured anew. A line cut short by a kill is ignored (its setting is measured again); other
damage (not UTF-8, a line or a result of the wrong shape) is a one-line error. Lines
are flushed and synced as they are written, so a Ctrl-C or a kill loses at most the setting in
progress.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from capsctl.config.convert import from_dict
from capsctl.errors import ConfigError, UsageError

__all__ = ["HEADER", "PointStore", "fingerprint"]

HEADER = {"capsctl": "robustness settings", "version": 1}

T = TypeVar("T")


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
        data = self._read()
        lines = data.splitlines()
        try:
            head = json.loads(lines[0]) if lines else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            head = None
        if head != HEADER:
            raise UsageError(
                f"--resume-file {self.path}: not a file of finished robustness settings; "
                "pick another name"
            )
        for number, line in enumerate(lines[1:], 2):
            self._take(number, line)
        if not data.endswith(b"\n"):  # a kill cut the last line short: start the next one afresh
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")

    def _read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as e:
            raise UsageError(
                f"--resume-file {self.path}: cannot read it ({e.strerror}); pick another name"
            ) from None

    def _take(self, number: int, line: bytes) -> None:
        """Line ``number``: a finished setting kept, a line a kill cut short skipped (measured
        again), anything else refused as damage."""
        try:
            doc = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise self.damaged(f"line {number} is not UTF-8 text") from None
        except json.JSONDecodeError:
            return  # the line a kill cut short: measured again
        fields = ("checkpoint", "setting", "result")
        if not (isinstance(doc, dict) and all(isinstance(doc.get(k), dict) for k in fields)):
            raise self.damaged(f"line {number} is not a finished setting")
        self._done[self._key(doc["checkpoint"], doc["setting"])] = doc["result"]

    def damaged(self, what: str) -> UsageError:
        """The error for a file whose content is damaged: ``what`` says where."""
        return UsageError(
            f"--resume-file {self.path}: damaged ({what}); delete it to measure every setting "
            "again, or pick another name"
        )

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

    def point(self, kind: type[T], checkpoint: dict[str, Any], setting: dict[str, Any]) -> T | None:
        """The result kept for this checkpoint and setting as a ``kind`` (a point or row of
        :mod:`capsctl.robustness.results`; fields a newer capsctl added are left out), or None;
        a result of the wrong shape is refused as damage."""
        found = self.get(checkpoint, setting)
        if found is None:
            return None
        known = {k: v for k, v in found.items() if k in kind.__dataclass_fields__}  # type: ignore[attr-defined]
        try:
            return from_dict(kind, known)
        except ConfigError as e:
            raise self.damaged(f"a kept {kind.__name__}: {e}") from None

    def put(
        self, checkpoint: dict[str, Any], setting: dict[str, Any], result: dict[str, Any]
    ) -> None:
        """Keep a finished setting's result (on disk before this returns)."""
        self._append({"checkpoint": checkpoint, "setting": setting, "result": result})
        self._done[self._key(checkpoint, setting)] = result

    def __len__(self) -> int:
        return len(self._done)
