"""capsctl/evaluation.py: what ``capsctl eval`` reports, and refuses to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_training import tiny_preset

from capsctl import evaluation
from capsctl.errors import CapsctlError
from capsctl.training import BEST, fit


def test_a_non_finite_loss_is_an_error_not_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that gives NaN (a broken library of compiled loops gave 10% accuracy and a
    NaN loss with exit code 0) must not produce a result that looks like one."""
    fit(tiny_preset(epochs=1, steps_per_epoch=2), tmp_path)
    real = evaluation.load_checkpoint

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        model, meta = real(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return model, meta

    monkeypatch.setattr(evaluation, "load_checkpoint", poisoned)
    with pytest.raises(CapsctlError) as info:
        evaluation.evaluate_checkpoint(tmp_path / BEST, split="test", device="cpu")
    message = str(info.value)
    assert str(tmp_path / BEST) in message and "loss" in message and "not finite" in message
    assert "CAPSCTL_NATIVE=0" in message and "\n" not in message
