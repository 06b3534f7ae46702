"""Trained weights shipped inside the package, by name: ``capsctl weights`` lists them, and
every command that reads a checkpoint takes a name as well as a path.

A shipped name is ``<suite or preset>.<member>``, e.g. ``cifar10-fast.idpa``: the dot keeps it
apart from model and preset names, which have none (as timm's ``model.tag``). Resolution of a
checkpoint argument (:func:`resolve_checkpoint`): an existing path wins, then a shipped name,
then (where the command takes one) a Hub id.

The files live in ``capsctl/weights/``. Each is a capsctl checkpoint with float16 weights and
no training state, made from a ledger run by ``scripts/ship_weights.py``; ``index.json`` beside
it records per name the model,
router, dataset, test set, the accuracy that ``capsctl eval NAME`` gives with the file itself,
parameters, bytes, the training command, the commit that trained it and ``source`` (the ledger
folder of the run in the repository).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError

__all__ = [
    "INDEX",
    "SHIPPED_DIR",
    "ShippedWeights",
    "is_shipped_name",
    "list_weights",
    "shipped",
    "shipped_or_path",
]

#: Where the shipped files and their index live.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "weights"
#: The index of the shipped files.
INDEX = SHIPPED_DIR / "index.json"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*\.[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True)
class ShippedWeights:
    """One shipped file: ``name`` (``<suite>.<member>``), the model and router it is, its
    dataset and test set, the accuracy ``capsctl eval NAME`` gives there, its parameters and
    bytes, the command that trained it, the commit and ``source``, its ledger folder."""

    name: str
    model: str
    router: str | None
    dataset: str
    test_set: str
    accuracy: float
    params: int
    bytes: int
    command: str
    commit: str
    source: str

    @property
    def path(self) -> Path:
        return SHIPPED_DIR / f"{self.name}.safetensors"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_shipped_name(text: str) -> bool:
    """Whether ``text`` has the form of a shipped name (``<suite>.<member>``)."""
    return bool(_NAME.match(text))


def list_weights() -> list[ShippedWeights]:
    """Every shipped file, in the index's order."""
    if not INDEX.exists():
        return []
    try:
        doc = json.loads(INDEX.read_text())
        keys = {f.name for f in fields(ShippedWeights)}
        return [ShippedWeights(**{k: item[k] for k in keys}) for item in doc["weights"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CapsctlError(
            f"{INDEX}: the index of the shipped weights is damaged ({e}); reinstall capsctl"
        ) from None


def shipped(name: str) -> ShippedWeights | None:
    """The shipped file called ``name``, or None."""
    return next((w for w in list_weights() if w.name == name), None)


def shipped_or_path(ref: str | Path) -> Path:
    """The file a checkpoint argument names: ``ref`` itself when it exists, else the shipped
    file of that name, else ``ref`` unchanged (for the caller to try as a Hub id or to report
    as missing)."""
    path = Path(ref)
    if path.exists() or not is_shipped_name(str(ref)):
        return path
    found = shipped(str(ref))
    return found.path if found is not None else path
