"""Command-line arguments that shrink a preset to a training run of a few seconds."""

from __future__ import annotations

TINY_MODEL = [
    "--set",
    "model.primary_types=4",
    "--set",
    "model.layers=[{kind: conv, types: 4, pose_dim: 16, kernel: 3, stride: 2}]",
]


def tiny_args(steps: int = 4, *extra: str) -> list[str]:
    """A 4-type capsule net, ``steps`` batches of 16 per epoch, 200 validation images, CPU."""
    return [
        *TINY_MODEL,
        "--set",
        f"train.steps_per_epoch={steps}",
        "--set",
        "data.val_size=200",
        *extra,
        "--batch-size",
        "16",
        "--device",
        "cpu",
    ]
