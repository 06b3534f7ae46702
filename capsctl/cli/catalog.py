"""``capsctl models``, ``capsctl presets`` and ``capsctl weights``."""

from __future__ import annotations

from typing import Annotated

import typer

from capsctl.cli.app import JsonOpt, app
from capsctl.errors import UsageError


@app.command("models")
def models_cmd(
    pattern: Annotated[str, typer.Argument(help="Shell-style filter, e.g. 'cifar10-*'.")] = "*",
    json_out: JsonOpt = False,
) -> None:
    """List registered models with their parameter counts."""
    from capsctl.registry import model_summaries
    from capsctl.views.catalog import print_models
    from capsctl.views.common import print_json

    rows = model_summaries(pattern)
    if not rows:
        raise UsageError(f"no registered model matches {pattern!r}; run capsctl models")
    if json_out:
        print_json({"models": rows})
    else:
        print_models(rows)


@app.command("presets")
def presets_cmd(json_out: JsonOpt = False) -> None:
    """List the bundled presets."""
    from capsctl.config import list_presets
    from capsctl.views.catalog import print_presets
    from capsctl.views.common import print_json

    items = list_presets()
    if json_out:
        print_json({"presets": [{"name": n, "description": d} for n, d in items]})
    else:
        print_presets(items)


@app.command("weights")
def weights_cmd(json_out: JsonOpt = False) -> None:
    """List the trained weights shipped with capsctl, by name.

    Example: capsctl weights, then capsctl eval cifar10-fast.idpa
    """
    from capsctl.checkpoint.shipped import list_weights
    from capsctl.views.catalog import print_weights
    from capsctl.views.common import print_json

    rows = [w.to_dict() for w in list_weights()]
    if json_out:
        print_json({"weights": rows})
    else:
        print_weights(rows)
