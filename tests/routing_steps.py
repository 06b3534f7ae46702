"""Whole training steps of the four routing algorithms, for the tests that compare a fast backend
(the compiled loops, the Triton kernels) against the torch code."""

from __future__ import annotations

from typing import Any

import torch

#: Each routing algorithm's small CIFAR-10 model (its ``-simple`` backbone).
PRESETS = {
    "idpa": "cifar10-caps-simple",
    "dynamic": "cifar10-dynamic-simple",
    "em": "cifar10-em-simple",
    "self": "cifar10-self-simple",
}


def routing_model(router: str, **overrides: Any) -> torch.nn.Module:
    """``router``'s model (seed 0; IDPA sequential with T=3, so every layer runs routed passes
    three times), self-routing's zero-initialized gating given random weights so that its
    routing is not uniform; ``overrides``: model fields (a smaller net)."""
    from capsctl.config import build_model

    torch.manual_seed(0)
    model = build_model({"base": PRESETS[router], **overrides})
    if router == "idpa":
        model.set_routing(3, "sequential")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("route_weight", "route_bias"):
                p.normal_(0.0, 0.5)
    return model


def training_step(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs and every parameter's gradient of one step (loss: the outputs' squares)."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().sum().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_step(got: list[torch.Tensor], want: list[torch.Tensor], floor: float) -> None:
    """Each tensor within 1e-4 of ``want``'s on its own scale, or on ``floor`` times the
    largest value of all when its own is smaller (a gradient that is zero but for rounding)."""
    assert len(got) == len(want) > 1
    smallest = floor * max(t.abs().max().item() for t in want)
    for g, w in zip(got, want, strict=True):
        scale = max(w.abs().max().item(), smallest)
        assert (g - w).abs().max().item() / scale < 1e-4
