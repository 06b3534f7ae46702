"""Dynamic routing (Sabour, Frosst, Hinton, "Dynamic routing between capsules", NeurIPS 2017,
arXiv:1710.09829): the squash, the routing procedure and the capsule layer that uses it.

Letters and the site layout (parent sites in ``B``, the children that vote at a site in ``J``,
votes ``[B, m, J, d]``) as in capsctl/layers/routing.py and capsctl/layers/baseline_capsules.py.
Procedure 1 of the paper with the exact squash (eq. 1); its conv layers (the paper has none)
route every window on its own, normalizing over the parent types there, as the main model does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from capsctl.layers.baseline_capsules import BaselineCapsules


def squash(s: Tensor, dim: int = -1) -> Tensor:
    """``squash(s) = |s|^2 / (1 + |s|^2) * s / |s| = s |s| / (1 + |s|^2)`` (Sabour et al. 2017,
    eq. 1), exactly; ``torch.linalg.vector_norm`` has gradient 0 at ``s = 0``, so no epsilon."""
    norm = torch.linalg.vector_norm(s, dim=dim, keepdim=True)
    return s * (norm / (1.0 + norm * norm))


def dynamic_routing(votes: Tensor, iterations: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Routing-by-agreement (Sabour et al. 2017, Procedure 1) over votes ``u_hat[B, m, J, d]``.

    ``b_ij = 0``; each iteration: ``c_ij = softmax_j(b_ij)`` (over the parents ``m`` of the site),
    ``s_j = sum_i c_ij u_hat_ij``, ``v_j = squash(s_j)``, and except after the last iteration
    ``b_ij += <u_hat_ij, v_j>``. Gradients flow through every iteration (no stop-gradient).
    The paper routes 3 times (``iterations = 3`` in the registered models).

    Returns the parent poses ``v[B, m, d]`` and, per iteration, the coefficients ``c[B, m, J]``
    and the poses ``v[B, m, d]`` (iteration 0 has uniform coefficients ``1/m``).
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    bsz, m, j, _ = votes.shape
    logits = votes.new_zeros(bsz, m, j)  # [B, m, J]
    coeffs: list[Tensor] = []
    poses: list[Tensor] = []
    v = votes.new_zeros(bsz, m, votes.shape[-1])
    for t in range(iterations):
        c = torch.softmax(logits, dim=1)  # [B, m, J], sums to 1 over m
        s = (c.unsqueeze(2) @ votes).squeeze(2)  # [B, m, 1, J] @ [B, m, J, d] -> [B, m, d]
        v = squash(s)  # [B, m, d]
        coeffs.append(c)
        poses.append(v)
        if t + 1 < iterations:
            # [B, m, J, d] @ [B, m, d, 1] -> [B, m, J]
            logits = logits + (votes @ v.unsqueeze(-1)).squeeze(-1)
    return v, coeffs, poses


class DynamicCapsules(BaselineCapsules):
    """A capsule layer with vector poses and dynamic routing (Sabour et al. 2017).

    Votes ``u_hat_ij = W_ij u_i`` (``W_ij``: ``d_out x d_in``, stored as ``W[.., x, m, c]``).
    Init (fan-based): ``W ~ N(0, std^2)``, ``std = 2 m / sqrt(J * d_out)`` with ``J`` the
    children per parent site. With the uniform coefficients ``1/m`` of the first iteration this
    gives ``E|s_j|^2 = 4 |u|^2``: a uniform pass maps capsules of length 0.5 to length 0.5 after
    the squash (gain 2 is the smallest for which lengths have a fixed point; below it they shrink
    layer after layer, as they do with the paper's ``N(0, 0.01)`` on these layer sizes).
    Conv layers normalize the coefficients over the parent types at each output position,
    separately for each window a child falls in, as the main model does.
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        kernel: int = 1,
        stride: int = 1,
    ) -> None:
        super().__init__(
            kind, in_types, in_dim, out_types, out_dim, rows=1, kernel=kernel, stride=stride
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 2.0 * self.out_types / math.sqrt(self.fan * self.out_dim)
        with torch.no_grad():
            self.weight.normal_(0.0, std)

    def route(self, child: Tensor, iterations: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Returns parent poses (``[b, h, w, m, d]`` or ``[b, m, d]``) and per iteration the
        coefficients (``[b, h, w, k, l, n, m]`` or ``[b, n, m]``) and parent poses."""
        xs, site = self.sites(child)  # [B, J, d_in]
        v, cs, ps = dynamic_routing(self.votes(xs), iterations)  # [B, m, d]
        coeffs = [self.unsite_coefficients(c, site) for c in cs]
        poses = [self.unsite(p, site) for p in ps]
        return self.unsite(v, site), coeffs, poses
