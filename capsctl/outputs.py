"""What a command writes, told by what is in a file, and the folders no other command writes in.

Each :class:`OutputKind` names one kind of output (a results CSV, a PNG, an ONNX file, ...) and
how to tell an existing file of that kind by its content, never by its name: ``--overwrite``
replaces only an earlier output of the same kind (:func:`capsctl.atomic.check_output`).

A **run folder** holds one of a run's files (:data:`RUN_MARKERS`); a **suite folder** holds
``suite.yaml`` and the pairs' run folders ``MEMBER/seed-N`` (``capsctl suite run --out`` and the
ledgers of ``capsctl suite archive --to``). Only a run writes in its run folder and only a suite
in its suite folder (its runs included): :func:`refuse_inside_runs` refuses any other output
there or anywhere below.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from capsctl.errors import UsageError

__all__ = [
    "KINDS",
    "MODEL_FOLDER_FILES",
    "RESULTS_HEADER",
    "RUN_MARKERS",
    "SUITE_COPY",
    "OutputKind",
    "folder_role",
    "refuse_inside_runs",
]

Role = Literal["run", "suite"]

#: The files of a run (capsctl/training/run_folder.py) whose presence makes a run folder.
RUN_MARKERS = (
    "results.json",
    "metrics.jsonl",
    "preset.yaml",
    "best.safetensors",
    "last.safetensors",
)
#: The copy of the suite in a suite folder (capsctl/cli/suite.py).
SUITE_COPY = "suite.yaml"
#: The first columns of a results file (capsctl/suites/results_file.py: RESULT_COLUMNS).
RESULTS_HEADER = ("suite", "member", "model", "test_set")
#: The files of an exported model folder (capsctl/export/hf.py: FOLDER_FILES).
MODEL_FOLDER_FILES = ("model.safetensors", "config.json", "README.md")
#: The first line of a robustness ``--resume-file`` (capsctl/robustness/store.py: HEADER).
_SETTINGS_HEADER = {"capsctl": "robustness settings", "version": 1}
_PNG = b"\x89PNG\r\n\x1a\n"
# ModelProto field keys that follow ir_version (field 1) in an ONNX file: producer name and
# version, domain, model version, doc string, graph, opset imports, metadata.
_ONNX_NEXT = frozenset(b"\x12\x1a\x22\x28\x32\x3a\x42\x72")
_SNIFF_BYTES = 64 * 1024
_MAX_HEADER = 16 * 1024 * 1024


@dataclass(frozen=True)
class OutputKind:
    """One kind of output. ``what`` names it in messages; ``holds`` says whether an existing
    file (a folder for ``folder`` kinds) is one. ``home``: the folder such an output belongs in
    (``run``: a run folder, ``suite``: a suite folder), None for every other output."""

    name: str
    what: str
    holds: Callable[[Path], bool]
    folder: bool = False
    home: Role | None = None


# -- reading a little of a file ----------------------------------------------------------------


def _head(path: Path, size: int = _SNIFF_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def _json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_HEADER:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _safetensors(path: Path) -> tuple[dict[str, Any], dict[str, str]] | None:
    """(tensor entries, string metadata) of a safetensors file, or None."""
    head = _head(path, 8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    if not 2 <= size <= _MAX_HEADER:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(8)
            doc = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("__metadata__", {}), dict):
        return None
    metadata = doc.pop("__metadata__", {})
    return doc, metadata


# -- telling each kind by its content ----------------------------------------------------------


def _is_png(path: Path) -> bool:
    return _head(path, len(_PNG)) == _PNG


def _is_svg(path: Path) -> bool:
    head = _head(path, 4096).lstrip()
    return head.startswith(b"<") and b"<svg" in head


def _is_pdf(path: Path) -> bool:
    return _head(path, 5) == b"%PDF-"


def _is_results_csv(path: Path) -> bool:
    first = _head(path).split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    return tuple(first.split(",")[: len(RESULTS_HEADER)]) == RESULTS_HEADER


def _is_onnx(path: Path) -> bool:
    head = _head(path, 3)
    return len(head) == 3 and head[0] == 0x08 and head[1] < 0x80 and head[2] in _ONNX_NEXT


def _is_pt2(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.rsplit("/", 1)[-1] == "archive_format" for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _is_release(path: Path) -> bool:
    """A weights-only capsctl checkpoint (export --format safetensors): never a resumable one."""
    found = _safetensors(path)
    if found is None:
        return False
    tensors, metadata = found
    weights_only = all(k.startswith("model.") for k in tensors)
    return metadata.get("format") == "capsctl" and "training_state" not in metadata and weights_only


def _is_routing_dump(path: Path) -> bool:
    found = _safetensors(path)
    return found is not None and found[1].get("format") == "capsctl-routing"


def _is_export_sidecar(path: Path) -> bool:
    doc = _json(path)
    return isinstance(doc, dict) and {"format", "file", "source_checkpoint", "parity"} <= set(doc)


def _is_settings(path: Path) -> bool:
    first = _head(path).split(b"\n", 1)[0]
    try:
        return bool(json.loads(first) == _SETTINGS_HEADER)
    except ValueError:
        return False


def _is_model_folder(path: Path) -> bool:
    """An exported model folder: only its own files, and a config.json naming the model."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return False
    config = _json(path / "config.json")
    named = isinstance(config, dict) and "architecture" in config
    return names <= set(MODEL_FOLDER_FILES) and named


def _any(path: Path) -> bool:
    return True  # the folder's own command judges what it finds there


RESULTS_CSV = OutputKind("results-csv", "a capsctl results file (CSV)", _is_results_csv)
PNG = OutputKind("png", "a PNG picture", _is_png)
SVG = OutputKind("svg", "an SVG picture", _is_svg)
PDF = OutputKind("pdf", "a PDF document", _is_pdf)
ONNX = OutputKind("onnx", "an ONNX model", _is_onnx)
PT2 = OutputKind("pt2", "a torch.export archive (.pt2)", _is_pt2)
RELEASE = OutputKind("release", "a weights-only capsctl checkpoint (an export)", _is_release)
EXPORT_SIDECAR = OutputKind("export-sidecar", "an export's JSON sidecar", _is_export_sidecar)
MODEL_FOLDER = OutputKind("model-folder", "an exported model folder", _is_model_folder, folder=True)
ROUTING_DUMP = OutputKind("routing-dump", "a routing dump (capsctl-routing)", _is_routing_dump)
ROBUSTNESS_SETTINGS = OutputKind(
    "robustness-settings", "a file of finished robustness settings", _is_settings
)
#: ``capsctl train --out``: the run's own folder (a suite's pair folder is one too).
RUN = OutputKind("run", "a run folder", _any, folder=True, home="run")
#: A run's own ``curves.png``, drawn by the run itself.
RUN_CURVES = OutputKind("run-curves", "a PNG picture", _is_png, home="run")
#: ``capsctl suite run --out`` and ``capsctl suite archive --to``: the suite's own folder.
SUITE = OutputKind("suite", "a suite folder", _any, folder=True, home="suite")

#: Every kind, by name.
KINDS = {
    k.name: k
    for k in (RESULTS_CSV, PNG, SVG, PDF, ONNX, PT2, RELEASE, EXPORT_SIDECAR, MODEL_FOLDER,
              ROUTING_DUMP, ROBUSTNESS_SETTINGS, RUN, RUN_CURVES, SUITE)
}  # fmt: skip


# -- run folders and suite folders -------------------------------------------------------------


def folder_role(folder: Path) -> tuple[Role, str] | None:
    """``("run", marker)`` for a run folder, ``("suite", "suite.yaml")`` for a suite folder
    (its copy of the suite and at least one ``MEMBER/seed-N`` folder), else None."""
    try:
        for name in RUN_MARKERS:
            if (folder / name).exists():
                return "run", name
        if (folder / SUITE_COPY).is_file() and any(p.is_dir() for p in folder.glob("*/seed-*")):
            return "suite", SUITE_COPY
    except OSError:
        return None
    return None


def _places(path: Path) -> list[Path]:
    """Where a write to ``path`` lands (its folder resolved) and, for a link, where it points."""
    absolute = Path(os.path.abspath(path))
    places = [absolute.parent.resolve() / absolute.name]
    if absolute.is_symlink():
        places.append(absolute.resolve())
    return places


def refuse_inside_runs(path: str | os.PathLike[str], kind: OutputKind) -> None:
    """:class:`UsageError` when ``path`` (an output of ``kind``) is in or below a run folder or a
    suite folder other than its own home: a run writes only in its own folder (which may be a
    suite's pair ``MEMBER/seed-N``), a suite only in its own."""
    for place in _places(Path(path)):
        home = place if kind.folder else place.parent
        for folder in (home, *home.parents):
            found = folder_role(folder)
            if found is None:
                continue
            role, marker = found
            if folder == home and role == kind.home:
                continue
            if role == "suite" and kind.home == "run" and _is_pair(home, folder):
                continue
            raise UsageError(_inside_message(Path(path), folder, role, marker, folder == place))


def _is_pair(run: Path, suite: Path) -> bool:
    """Whether ``run`` is a pair's folder ``MEMBER/seed-N`` of the suite folder ``suite``, or a
    tuning run's ``tune/MEMBER/lr-LR``."""
    if run.name.startswith("seed-") and run.parent.parent == suite:
        return True
    tuning = run.parent.parent
    return run.name.startswith("lr-") and tuning.name == "tune" and tuning.parent == suite


def _inside_message(path: Path, folder: Path, role: Role, marker: str, itself: bool) -> str:
    what = "run folder" if role == "run" else "suite folder"
    holds = marker if role == "run" else f"{marker} and its runs"
    where = f"is a {what}" if itself else f"is inside the {what} {folder}"
    return f"{path} {where} (holds {holds}); pick a path outside run and suite folders"
