"""White-box L-infinity attacks on pixels in [0, 1]: FGSM and PGD with the model's own loss.

Written here rather than taken from an attack library (torchattacks, foolbox) because the loss
attacked must be each model's *own training loss*, as SR-CapsNet (Hahn et al., NeurIPS 2019,
§4.3) attacks its capsule networks: cross-entropy for inverted dot-product attention routing,
self-routing and the CNN/ResNet baselines, the margin loss (Sabour et al. 2017, eq. 4) for
dynamic routing, the spread loss at its final margin 0.9 (Hinton et al. 2018, §3.1) for EM
routing, binary cross-entropy per class for multi-label data (see :mod:`capsctl.losses`). The
libraries attack a cross-entropy of the outputs, which for capsule lengths or EM activations is
not the loss the model minimizes. Label smoothing is left out of the attacked loss. The FGSM
below is checked against foolbox's L-inf fast gradient attack with cross-entropy in the tests.

- FGSM (Goodfellow et al., ICLR 2015): ``x' = clip_[0,1](x + eps * sign(grad_x L(x, y)))``.
- PGD (Madry et al., ICLR 2018): a uniform random start in the eps ball, then ``steps`` signed
  gradient steps of size ``alpha = 2.5 * eps / steps`` (Madry et al.'s choice), each projected
  back onto the eps ball around ``x`` and onto [0, 1].
- Targeted attacks descend the loss of the target class instead of ascending that of the label.
- ``loss="cw"`` attacks Carlini and Wagner's margin instead of the model's own loss
  (:func:`cw_margin`). The margin and spread losses are flat where their margins are met, so
  their gradient is zero there and an attack that follows it stalls: a gradient-masking check
  (Athalye et al., ICML 2018; Croce and Hein, ICML 2020).

The model attacked is :class:`PixelModel`: the network with its input normalization in front,
so that the attack moves raw pixels, and with the test-time flip averaging of the checkpoint
(``data.augment.test_flip``) included when the checkpoint evaluates with it: the function
attacked is the one that is scored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "ATTACKS",
    "ATTACK_LOSSES",
    "LossFn",
    "PixelModel",
    "cw_margin",
    "fgsm",
    "loss_gradient",
    "pgd",
    "pgd_step_size",
    "run_attack",
]

LossFn = Callable[[Tensor, Tensor], Tensor]

ATTACKS = ("fgsm", "pgd")

#: What an attack ascends: the model's own training loss, or Carlini and Wagner's margin.
ATTACK_LOSSES = ("own", "cw")


def cw_margin(outputs: Tensor, y: Tensor) -> Tensor:
    """Carlini and Wagner's margin (IEEE S&P 2017, their f6 without its confidence term) summed
    over the batch: ``max_{j != y} z_j - z_y`` for outputs ``z [b, classes]`` (logits, capsule
    lengths or activations alike). It grows as the label's output falls behind the best other
    class, and its gradient is never zero where the outputs' is not."""
    true = outputs.gather(1, y[:, None])[:, 0]  # [b]
    others = outputs.masked_fill(
        torch.nn.functional.one_hot(y, outputs.shape[1]).bool(), float("-inf")
    )  # [b, classes]: the label's output left out
    return (others.amax(1) - true).sum()


#: PGD's step size relative to eps / steps (Madry et al., ICLR 2018).
PGD_STEP_FACTOR = 2.5


class PixelModel(nn.Module):
    """``model`` on [0, 1] pixels: normalizes as :class:`capsctl.data.Loader` does
    (``x * 255 * scale + shift`` with ``scale = 1 / (255 std)``, ``shift = -mean / std``) and,
    with ``flip``, averages the outputs on the image and on its left-right mirror."""

    def __init__(
        self, model: nn.Module, mean: Sequence[float], std: Sequence[float], flip: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.flip = flip
        std_t = torch.tensor([float(s) for s in std], dtype=torch.float32)
        mean_t = torch.tensor([float(m) for m in mean], dtype=torch.float32)
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).view(1, -1, 1, 1))  # [1, C, 1, 1]
        self.register_buffer("shift", (-mean_t / std_t).view(1, -1, 1, 1))  # [1, C, 1, 1]

    def forward(self, x: Tensor) -> Tensor:
        z = (x * 255.0) * self.scale + self.shift  # [b, C, H, W] normalized
        out = self.model(z).float()  # [b, classes]
        if self.flip:
            out = (out + self.model(z.flip(-1)).float()) / 2  # [b, classes]
        return out


@contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """No parameter gradients while attacking (only the input's); the flags are restored."""
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)


def loss_gradient(model: nn.Module, x: Tensor, y: Tensor, loss_fn: LossFn) -> Tensor:
    """``grad_x loss_fn(model(x), y)`` for a batch ``x [b, C, H, W]`` in [0, 1]."""
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_fn(model(x), y)
        (grad,) = torch.autograd.grad(loss, x)
    return grad  # [b, C, H, W]


def fgsm(
    model: nn.Module, x: Tensor, y: Tensor, eps: float, loss_fn: LossFn, targeted: bool = False
) -> Tensor:
    """One signed gradient step of size ``eps``, clipped to [0, 1]; ``y`` is the target class
    when ``targeted`` (the step then descends its loss)."""
    if eps == 0:
        return x.clone()
    direction = -1.0 if targeted else 1.0
    step = direction * eps * loss_gradient(model, x, y, loss_fn).sign()  # [b, C, H, W]
    return (x + step).clamp(0.0, 1.0).detach()


def pgd_step_size(eps: float, steps: int) -> float:
    """Madry et al.'s step: ``2.5 * eps / steps``."""
    return PGD_STEP_FACTOR * eps / steps


def pgd(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    eps: float,
    loss_fn: LossFn,
    *,
    steps: int,
    targeted: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Projected gradient descent in the L-infinity ball of radius ``eps`` around ``x``, from a
    uniform random start (drawn on the CPU with ``generator``, so runs repeat exactly)."""
    if eps == 0:
        return x.clone()
    alpha = pgd_step_size(eps, steps)
    direction = -1.0 if targeted else 1.0
    noise = torch.rand(x.shape, generator=generator, dtype=torch.float32)  # [b, C, H, W] in [0,1)
    adv = (x + (2 * noise.to(x.device) - 1) * eps).clamp(0.0, 1.0)
    for _ in range(steps):
        grad = loss_gradient(model, adv, y, loss_fn)  # [b, C, H, W]
        adv = adv + direction * alpha * grad.sign()
        adv = torch.minimum(torch.maximum(adv, x - eps), x + eps).clamp(0.0, 1.0).detach()
    return adv


def run_attack(
    name: str,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    eps: float,
    loss_fn: LossFn,
    *,
    steps: int = 10,
    targeted: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The adversarial batch of attack ``name`` (one of :data:`ATTACKS`)."""
    with frozen(model):
        if name == "fgsm":
            return fgsm(model, x, y, eps, loss_fn, targeted)
        if name == "pgd":
            return pgd(
                model, x, y, eps, loss_fn, steps=steps, targeted=targeted, generator=generator
            )
    raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
