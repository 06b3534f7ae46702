"""Export a checkpoint for deployment: ONNX, ``torch.export`` (.pt2), a weights-only release or a
model folder in the Hugging Face layout, each checked against eager PyTorch.

* :mod:`capsctl.export.api`: :func:`export_checkpoint`, the library call of ``capsctl export``;
* :mod:`capsctl.export.parity`: the check images and the parity check, :class:`ExportResult`;
* :mod:`capsctl.export.source`: the checkpoint being exported, loaded once;
* :mod:`capsctl.export.formats`: the file formats (onnx, pt2, safetensors) and their sidecars;
* :mod:`capsctl.export.hf`: the model folder; :mod:`capsctl.export.card`: its model card.

Nothing is printed; progress goes to ``on_event`` (:mod:`capsctl.events`).
"""

from __future__ import annotations

from capsctl.export.api import export_checkpoint
from capsctl.export.card import model_card
from capsctl.export.formats import FORMATS, default_output_path
from capsctl.export.hf import export_model_folder
from capsctl.export.parity import ExportResult

__all__ = [
    "FORMATS",
    "ExportResult",
    "default_output_path",
    "export_checkpoint",
    "export_model_folder",
    "model_card",
]
