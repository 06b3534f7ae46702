"""What ``capsctl robustness`` measures, as data: one point per attack and radius, per shift
and magnitude, one row per corruption, and a checkpoint's whole result; each converts to the
plain dict ``--json`` writes and back (:meth:`RobustnessResult.from_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AttackPoint", "CorruptionRow", "RobustnessResult", "ShiftPoint", "from_known_fields"]


@dataclass
class AttackPoint:
    attack: str
    eps: float
    targeted: bool
    accuracy: float  # over all images
    success_rate: float | None  # over the images correct before the attack (None: no such one)
    correct_before: int
    count: int
    seconds: float = 0.0  # wall time of this attack over every image

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ShiftPoint:
    shift: str
    magnitude: float
    accuracy: float
    count: int
    seconds: float = 0.0  # wall time of building and scoring this shifted set

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CorruptionRow:
    name: str  # with a star for a documented substitute (frost*, motion_blur*, snow*)
    accuracies: list[float]  # severity 1..5
    mean: float
    substitute: bool
    seconds: float = 0.0  # wall time of corrupting and scoring its five severities

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RobustnessResult:
    checkpoint: str
    dataset: str
    model: str  # arch, or capsnet/<router>
    count: int
    clean_accuracy: float
    loss_name: str  # the loss the attacks use (the model's own)
    flip: bool  # outputs averaged with the mirror image's (attacked and scored alike)
    seed: int
    steps: int
    pgd_step: str
    attacks: list[AttackPoint] = field(default_factory=list)
    shifts: list[ShiftPoint] = field(default_factory=list)
    corruptions: list[CorruptionRow] = field(default_factory=list)
    mean_corruption_accuracy: float | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # the points and rows too, as plain dicts

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RobustnessResult:
        """The result :meth:`to_dict` (or ``capsctl robustness --json``) wrote; fields a newer
        capsctl added take their defaults in an older measurement, unknown ones are ignored."""
        parts = {"attacks": AttackPoint, "shifts": ShiftPoint, "corruptions": CorruptionRow}
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        for key, kind in parts.items():
            known[key] = [from_known_fields(kind, item) for item in doc.get(key, [])]
        return cls(**known)


def from_known_fields(kind: Any, item: dict[str, Any]) -> Any:
    """``kind(**item)`` with the fields ``kind`` does not have left out (a newer capsctl's)."""
    return kind(**{k: v for k, v in item.items() if k in kind.__dataclass_fields__})
