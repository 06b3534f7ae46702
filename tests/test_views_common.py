"""capsctl/views/common.py: the ``--json`` document."""

from __future__ import annotations

import json
import math

import pytest

from capsctl.views.common import print_json


def test_json_never_holds_nan_or_infinity(capsys: pytest.CaptureFixture[str]) -> None:
    """JSON has no NaN or Infinity (Python would write them, and strict readers fail):
    every non-finite float, however deep, becomes null."""
    doc = {"loss": math.nan, "rows": [1.5, math.inf, {"x": -math.inf}], "pair": (math.nan, 2)}
    print_json(doc)
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard {c}"))
    assert parsed == {"loss": None, "rows": [1.5, None, {"x": None}], "pair": [None, 2]}
