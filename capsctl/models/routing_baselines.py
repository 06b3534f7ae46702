"""Baseline routing procedures: dynamic routing and EM routing, on capsctl's layer lists.

Letters (REFERENCE.md §1): ``b`` batch, ``n`` child capsule types, ``m`` parent capsule types,
``a``/``x`` rows/cols of a child pose matrix, ``c`` cols of a parent pose matrix, ``d`` pose dim,
``h,w`` output positions, ``k,l`` kernel offsets. As in ``capsctl.layers.routing``, every
*parent site* (a batch item for an FC layer, a batch item at one output position for a conv
layer) is flattened into ``B``, and every child that votes at that site (all child types, and for
a conv layer all ``k x k`` window offsets) into ``J``. Votes are laid out ``[B, m, J, d]`` so that
every sum over children is one batched matrix product without copies.

Both models reuse :func:`capsctl.models.capsnet.plan_layers` (grids, child counts, the class
capsules) and the backbone and 1x1 primary-capsule convolution of :class:`CapsNet`, and expose the
same API: ``forward(x, trace=False)`` returns ``[b, classes]`` or ``(outputs, RoutingTrace)``,
``set_routing(iterations, mode)``, ``parameter_counts()``, ``capsules`` (the capsule layers, each
with ``out_types``), ``iterations`` and ``routing``.

Both procedures are *sequential* by construction (each layer runs all its iterations before the
next layer starts): ``cfg.routing`` is ignored, ``routing`` is always ``"sequential"``, and
``set_routing(mode="concurrent")`` raises ``ValueError``. ``cfg.dropout``, ``cfg.layer_norm``,
``cfg.agreement_scale`` and ``cfg.head`` belong to inverted dot-product routing and are ignored.
Both papers route 3 times; the registered ``*-dynamic*`` and ``*-em*`` models do too.

Fidelity. Dynamic routing is Procedure 1 of Sabour, Frosst, Hinton (NeurIPS 2017,
arXiv:1710.09829) with the exact squash; its conv layers (the paper has none) route every window
on its own. EM routing is Procedure 1 of Hinton, Sabour, Frosst ("Matrix capsules with EM
routing", ICLR 2018): a conv child's assignments are normalized over every parent it votes for,
as in the paper; the constants the paper leaves open (temperature schedule, epsilons, weight
init) come from the authors' published implementation (google-research/google-research,
``capsule_em/em_layers.py``; see the ``EM_*`` constants). Stabilizers the paper lacks (cost
standardization, routing conv windows separately) are knobs, off by default.

Outputs are not logits in the cross-entropy sense; ``output_kind`` says what they are:

- :class:`DynamicCapsNet` (``output_kind = "length"``): ``logit_scale * |v_c|``, the lengths of
  the class capsules (``logit_scale`` defaults to 1.0, so the outputs lie in ``[0, 1)`` and suit
  :func:`margin_loss`; for cross-entropy raise ``logit_scale``, e.g. to 10, since a softmax over
  values in ``[0, 1)`` is nearly flat).
- :class:`EMCapsNet` (``output_kind = "activation"``): the class activations ``a_c`` in ``(0, 1)``
  for :func:`spread_loss`; for cross-entropy use ``logit(a_c)``.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from capsctl.errors import ConfigError
from capsctl.layers.capsules import PrimaryCapsules, pose_shape
from capsctl.models.backbones import BACKBONE_CHANNELS, build_backbone
from capsctl.models.capsnet import RoutingTrace, plan_layers
from capsctl.models.spec import CapsLayerSpec, ModelConfig

# Constants of EM routing that the paper (Hinton, Sabour, Frosst, ICLR 2018) leaves open, from
# the authors' published implementation (google-research/google-research, capsule_em/).
# Added to sum_i R_ij a_i before dividing by it (capsule_em/em_layers.py, conv routing: 1e-7;
# its FC routing uses 1e-5).
EM_EPS = 1e-7
# Added to every variance sigma^2 (capsule_em/em_layers.py, ``min_var``): keeps log sigma and
# 1 / sigma^2 finite when the votes of a parent agree exactly (e.g. a parent with one child).
EM_VAR_EPS = 5e-4
# lambda_inf of the inverse-temperature schedule lambda_t = lambda_inf * (1 - 0.95^(t+1)),
# t = 0..T-1 (capsule_em/em_layers.py). The reference implementation's ``final_beta`` = 0.01
# (capsule_em/experiment.py and README.md) multiplies a cost written with log sigma^2 where the
# paper has log sigma, so the same temperature in the paper's formula is 2 * 0.01.
EM_FINAL_LAMBDA = 0.02
EM_LAMBDA_DECAY = 0.95
# FC capsule layers use a quarter of lambda_inf (``final_beta / 4`` in connector_capsule_mat).
EM_FC_LAMBDA_FACTOR = 0.25
# Weight std before truncation at 2 std (TensorFlow's truncated normal), per layer kind:
# conv_capsule_mat (0.3) and connector_capsule_mat (0.01) in capsule_em/em_layers.py.
EM_INIT_STD = {"conv": 0.3, "fc": 0.01}
# Only for the optional cost standardization (``standardize_costs``, not in the paper).
EM_COST_EPS = 1e-6
EM_ASSIGNMENTS = ("parents", "window")


# --------------------------------------------------------------------------------------------
# Functional routing cores (sites flattened into B, children into J)
# --------------------------------------------------------------------------------------------


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


def em_inverse_temperature(final_lambda: float, t: int) -> float:
    """``lambda_t = final_lambda * (1 - 0.95^(t+1))`` for iteration ``t = 0, 1, ...``: the
    schedule of the authors' implementation (capsule_em/em_layers.py); the paper only says
    that lambda follows a fixed schedule."""
    return final_lambda * (1.0 - EM_LAMBDA_DECAY ** (t + 1))


@dataclasses.dataclass(frozen=True)
class WindowGrid:
    """Where the ``J = k*k*n`` entries of every conv site come from: child grid
    ``[b, H, W, n]``, sites ``[b, h, w]``, kernel ``k``, stride. Gathers, for every entry, a
    reduction over all entries of the same child (every window it falls in)."""

    batch: int
    height: int
    width: int
    types: int
    out_height: int
    out_width: int
    kernel: int
    stride: int

    @classmethod
    def of(cls, child_act: Tensor, kernel: int, stride: int) -> WindowGrid:
        """From the child activations ``[b, H, W, n]``."""
        b, hh, ww, n = child_act.shape
        ho, wo = (hh - kernel) // stride + 1, (ww - kernel) // stride + 1
        return cls(b, hh, ww, n, ho, wo, kernel, stride)

    def sum_over_windows(self, x: Tensor) -> Tensor:
        """``x[B, J]`` -> ``[B, J]``: every entry becomes the sum of its child's entries."""
        b, h, w, k, n = self.batch, self.out_height, self.out_width, self.kernel, self.types
        cols = x.reshape(b, h, w, k, k, n).permute(0, 5, 3, 4, 1, 2)  # [b, n, k, l, h, w]
        cols = cols.reshape(b, n * k * k, h * w)  # [b, (n, k, l), (h, w)]
        grid = F.fold(
            cols, (self.height, self.width), kernel_size=k, stride=self.stride
        )  # [b, n, H, W]
        return _windows(grid.permute(0, 2, 3, 1), k, self.stride)[0]  # [B, J]

    def max_over_windows(self, x: Tensor) -> Tensor:
        """``x[B, J]`` -> ``[B, J]``: every entry becomes the max of its child's entries (no
        gradient)."""
        b, h, w, k, n, s = (
            self.batch,
            self.out_height,
            self.out_width,
            self.kernel,
            self.types,
            self.stride,
        )
        with torch.no_grad():
            win = x.reshape(b, h, w, k, k, n)  # [b, h, w, k, l, n]
            grid = x.new_full((b, self.height, self.width, n), -math.inf)  # [b, H, W, n]
            for ky in range(k):
                for kx in range(k):
                    part = grid[:, ky : ky + s * (h - 1) + 1 : s, kx : kx + s * (w - 1) + 1 : s]
                    part.copy_(torch.maximum(part, win[:, :, :, ky, kx]))  # [b, h, w, n]
            return _windows(grid, k, s)[0]  # [B, J]


class _SoftmaxOverParents(torch.autograd.Function):
    """``z[B, m, J]`` -> ``R = exp(z) / sum exp(z)``, the sum over every entry of the same
    child (all windows it falls in, all parent types): a softmax over all the parents each
    child votes for. Stabilized by each child's maximum. Saves only ``R`` for the backward
    (``dz = R * (g - sum_child R g)``), as ``torch.softmax`` does."""

    @staticmethod
    def forward(ctx, z: Tensor, grid: WindowGrid) -> Tensor:  # type: ignore[override]
        top = grid.max_over_windows(z.amax(1))  # [B, J]
        r = torch.exp(z - top.unsqueeze(1))  # [B, m, J]
        r = r / grid.sum_over_windows(r.sum(1)).unsqueeze(1)  # [B, m, J]
        ctx.save_for_backward(r)
        ctx.grid = grid
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (r,) = ctx.saved_tensors
        rg = r * grad  # [B, m, J]
        total = ctx.grid.sum_over_windows(rg.sum(1))  # [B, J]
        return rg - r * total.unsqueeze(1), None


def em_routing(
    votes: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iterations: int,
    final_lambda: float = EM_FINAL_LAMBDA,
    *,
    grid: WindowGrid | None = None,
    standardize_costs: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """EM routing (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1) over votes ``V[B, m, J, d]``.

    ``a_in[B, J]``: child activations; ``beta_u[m]``, ``beta_a[m]``: learned per parent type.
    Iteration ``t = 0..T-1`` runs an M-step with inverse temperature
    ``lambda_t = final_lambda * (1 - 0.95^(t+1))`` (:func:`em_inverse_temperature`) and, except
    after the last (whose result the paper's procedure never uses), an E-step:

    - M-step: ``r_ij = R_ij a_i``; ``mu_j^h = sum_i r_ij V_ij^h / (sum_i r_ij + EM_EPS)``;
      ``(sigma_j^h)^2 = sum_i r_ij (V_ij^h - mu_j^h)^2 / (sum_i r_ij + EM_EPS) + EM_VAR_EPS``;
      ``cost_j^h = (beta_u + log sigma_j^h) sum_i r_ij``;
      ``a_j = sigmoid(lambda_t (beta_a - sum_h cost_j^h))``.
    - E-step: ``p_ij = N(V_ij; mu_j, diag sigma_j^2)``; ``R_ij = a_j p_ij / sum_k a_k p_ik``,
      computed in log space as a softmax of ``log a_j + log p_ij`` (same value, no underflow).

    The sum over ``k`` runs over every parent child ``i`` votes for. With ``grid=None`` those
    are the ``m`` parents of its site (an FC layer, or a conv layer routed window by window);
    with the :class:`WindowGrid` of a conv layer it runs over all of them, in every window the
    child falls in, as the paper's conv layers do, and the first iteration's ``R_ij`` is
    uniform over them, ``1 / (m * windows of i)`` (the paper's ``1 / |Omega_{L+1}|`` over the
    parents the child is connected to; the authors' code starts from ``1/m`` in every window).

    ``standardize_costs`` (off by default; not in the paper nor the authors' code) replaces
    ``sum_h cost_j^h`` by ``(c_j - mean_k c_k) / (std_k c_k + EM_COST_EPS)`` over the ``m`` parent
    types of the site (population std, taken as ``sqrt(var + EM_COST_EPS^2)``). A stabilizer: the
    raw cost grows with the number of children and the vote scale, the standardized one is
    O(1), so O(1) temperatures work in every layer; pair it with ``final_lambda`` near 1.

    Returns ``mu[B, m, d]``, ``a_out[B, m]`` and per iteration the assignment ``R[B, m, J]``
    used by that M-step, the means and the activations after it.
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    bsz, m, j, _ = votes.shape
    if grid is None:
        r = votes.new_full((bsz, m, j), 1.0 / m)  # [B, m, J]
    else:
        windows = grid.sum_over_windows(votes.new_ones(bsz, j))  # [B, J]
        r = (1.0 / (m * windows)).unsqueeze(1).expand(bsz, m, j)  # [B, m, J]
    a_w = a_in.unsqueeze(1)  # [B, 1, J]
    bu = beta_u.view(1, m, 1)  # [1, m, 1]
    ba = beta_a.view(1, m)  # [1, m]
    log_2pi = math.log(2.0 * math.pi)
    rs: list[Tensor] = []
    mus: list[Tensor] = []
    acts: list[Tensor] = []
    mu = votes.new_zeros(bsz, m, votes.shape[-1])
    a_out = votes.new_zeros(bsz, m)
    for t in range(iterations):
        lam = em_inverse_temperature(final_lambda, t)
        rs.append(r)
        # M-step
        ra = r * a_w  # [B, m, J]
        mass = ra.sum(-1, keepdim=True)  # [B, m, 1]
        wts = ra / (mass + EM_EPS)  # [B, m, J]
        mu = (wts.unsqueeze(2) @ votes).squeeze(2)  # [B, m, 1, J] @ [B, m, J, d] -> [B, m, d]
        diff = votes - mu.unsqueeze(2)  # [B, m, J, d]
        diff2 = diff * diff  # [B, m, J, d]
        var = (wts.unsqueeze(2) @ diff2).squeeze(2) + EM_VAR_EPS  # [B, m, d]
        log_var = torch.log(var)  # [B, m, d]; log sigma = log_var / 2
        cost = ((bu + 0.5 * log_var) * mass).sum(-1)  # [B, m]
        if standardize_costs:
            mean = cost.mean(-1, keepdim=True)  # [B, 1]
            std = torch.sqrt((cost - mean).pow(2).mean(-1, keepdim=True) + EM_COST_EPS**2)
            cost = (cost - mean) / (std + EM_COST_EPS)  # [B, m]
        pre = lam * (ba - cost)  # [B, m]
        a_out = torch.sigmoid(pre)  # [B, m]
        mus.append(mu)
        acts.append(a_out)
        if t + 1 < iterations:
            # E-step: log p_ij = -sum_h [(V - mu)^2 / (2 sigma^2) + log(2 pi sigma^2) / 2]
            maha = (diff2 @ (1.0 / var).unsqueeze(-1)).squeeze(-1)  # [B, m, J, d] @ [B, m, d, 1]
            log_norm = 0.5 * (log_var + log_2pi).sum(-1, keepdim=True)  # [B, m, 1]
            log_ap = F.logsigmoid(pre).unsqueeze(-1) - 0.5 * maha - log_norm  # [B, m, J]
            if grid is None:
                r = torch.softmax(log_ap, dim=1)  # [B, m, J]
            else:
                r = _SoftmaxOverParents.apply(log_ap, grid)  # [B, m, J]
    return mu, a_out, rs, mus, acts


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


def _windows(t: Tensor, kernel: int, stride: int) -> tuple[Tensor, int, int]:
    """Grid tensor ``[b, H, W, n, *e]`` -> windows ``[B=(b,h,w), J=(k,l,n), *e]``.

    ``e`` is ``(d,)`` for poses and ``()`` for activations. Two ``unfold``s (height, then width)
    keep every window's entries at their own positions.
    """
    b, nd = t.shape[0], t.dim()
    win = t.unfold(1, kernel, stride).unfold(2, kernel, stride)  # [b, h, w, n, *e, k, l]
    h, w = win.shape[1], win.shape[2]
    win = win.permute(0, 1, 2, nd, nd + 1, 3, *range(4, nd))  # [b, h, w, k, l, n, *e]
    return win.reshape(b * h * w, -1, *t.shape[4:]), h, w  # [B, J, *e]


class _BaselineCapsules(nn.Module):
    """Weights, child sites and votes shared by the dynamic and EM capsule layers.

    A child pose is an ``a x x`` matrix (``a = 1`` for a vector), a weight ``x x c``, a vote
    ``a x c`` (``d = a*c``): ``V_ij = P_i W_ij``, as in ``capsctl.layers.capsules``. Weights
    ``W[n, x, m, c]`` (FC) or ``W[k, l, n, x, m, c]`` (conv, shared over positions).
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        rows: int,
        kernel: int = 1,
        stride: int = 1,
    ) -> None:
        super().__init__()
        if kind not in ("conv", "fc"):
            raise ValueError(f"unknown capsule layer kind {kind!r}")
        if in_dim % rows or out_dim % rows:
            raise ValueError(f"pose dims {in_dim} -> {out_dim} do not have {rows} rows")
        self.kind = kind
        self.in_types, self.in_dim = in_types, in_dim
        self.out_types, self.out_dim = out_types, out_dim
        self.rows, self.cols_in, self.cols_out = rows, in_dim // rows, out_dim // rows
        self.kernel, self.stride = kernel, stride
        self.fan = in_types * kernel * kernel if kind == "conv" else in_types  # J
        lead = (kernel, kernel, in_types) if kind == "conv" else (in_types,)
        self.weight = nn.Parameter(torch.empty(*lead, self.cols_in, out_types, self.cols_out))

    def out_size(self, size: int) -> int:
        return (size - self.kernel) // self.stride + 1

    def sites(self, child: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """Child poses ``[b, H, W, n, d_in]`` (conv) or ``[b, ..., d_in]`` (FC) ->
        ``X[B, J, d_in]`` and the site shape ``(b, h, w)`` or ``(b,)``."""
        b = child.shape[0]
        if self.kind == "conv":
            xs, h, w = _windows(child, self.kernel, self.stride)  # [B, J, d_in]
            return xs, (b, h, w)
        xs = child.reshape(b, -1, self.in_dim)  # [b, n, d_in]; a grid flattens as (h, w, n)
        if xs.shape[1] != self.in_types:
            raise ValueError(
                f"FC capsule layer expects {self.in_types} child capsules, got {xs.shape[1]}"
                " (was the model built for another input size?)"
            )
        return xs, (b,)

    def child_activations(self, act: Tensor) -> Tensor:
        """Child activations ``[b, H, W, n]`` (conv) or ``[b, ...]`` (FC) -> ``[B, J]``."""
        if self.kind == "conv":
            return _windows(act, self.kernel, self.stride)[0]  # [B, J]
        return act.reshape(act.shape[0], -1)  # [b, n]

    def votes(self, xs: Tensor) -> Tensor:
        """``X[B, J, d_in]`` -> votes ``[B, m, J, d]`` with ``V = X W`` per pose row."""
        bsz, j = xs.shape[0], self.fan
        a, xd, m, c = self.rows, self.cols_in, self.out_types, self.cols_out
        xj = xs.view(bsz, j, a, xd).permute(1, 0, 2, 3).reshape(j, bsz * a, xd)  # [J, B*a, x]
        wj = self.weight.reshape(j, xd, m * c)  # [J, x, m*c]
        v = torch.bmm(xj, wj)  # [J, B*a, m*c]
        v = v.view(j, bsz, a, m, c).permute(1, 3, 0, 2, 4)  # [B, m, J, a, c]
        return v.reshape(bsz, m, j, a * c)  # [B, m, J, d]

    def unsite_coefficients(self, r: Tensor, site: tuple[int, ...]) -> Tensor:
        """``[B, m, J]`` -> ``[b, h, w, k, l, n, m]`` (conv) or ``[b, n, m]`` (FC)."""
        if self.kind == "conv":
            b, h, w = site
            k, n, m = self.kernel, self.in_types, self.out_types
            return r.view(b, h, w, m, k, k, n).permute(0, 1, 2, 4, 5, 6, 3)  # [b,h,w,k,l,n,m]
        return r.transpose(1, 2)  # [b, n, m]

    def unsite(self, t: Tensor, site: tuple[int, ...]) -> Tensor:
        """``[B, m, *e]`` -> ``[b, h, w, m, *e]`` (conv) or ``[b, m, *e]`` (FC)."""
        return t.reshape(*site, *t.shape[1:])


class DynamicCapsules(_BaselineCapsules):
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


class EMCapsules(_BaselineCapsules):
    """A capsule layer with pose matrices, activations and EM routing (Hinton et al. 2018).

    Votes ``V_ij = M_i W_ij`` (the pose times a learned ``x x c`` matrix, the convention of the
    main model; a vector pose is a ``1 x d`` row). ``beta_u``, ``beta_a``: one per parent type,
    shared over positions, initialized to 0 (the paper gives no initial value; the authors' code
    starts its biases at 0.5 to 2 in a rescaled parametrization that has no counterpart here).
    Init: ``W`` from a normal with std ``EM_INIT_STD[kind]`` (0.3 conv, 0.01 FC) truncated at
    2 std, as the authors' implementation (capsule_em/em_layers.py) does.

    ``final_lambda``: ``lambda_inf`` of the inverse-temperature schedule (:func:`em_routing`);
    default ``EM_FINAL_LAMBDA`` (0.02) for conv layers and a quarter of it for FC layers.
    ``assignment`` (conv layers): ``"parents"`` (default, the paper's) normalizes a child's
    assignments over every parent it votes for, in all the windows it falls in; ``"window"``
    routes each window on its own, normalizing over the ``m`` parent types there (as the main
    model and the dynamic-routing baseline do; cheaper to reason about, not the paper's).
    ``standardize_costs``: see :func:`em_routing` (off by default; not in the paper).
    No coordinate addition: the class layer has separate weights for every child position, like
    the main model's FC layer, so positions are already distinguishable.
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        rows: int,
        kernel: int = 1,
        stride: int = 1,
        final_lambda: float | None = None,
        assignment: str = "parents",
        standardize_costs: bool = False,
    ) -> None:
        super().__init__(
            kind, in_types, in_dim, out_types, out_dim, rows=rows, kernel=kernel, stride=stride
        )
        if assignment not in EM_ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {EM_ASSIGNMENTS}, got {assignment!r}")
        if final_lambda is None:
            factor = EM_FC_LAMBDA_FACTOR if kind == "fc" else 1.0
            final_lambda = EM_FINAL_LAMBDA * factor
        self.final_lambda = final_lambda
        self.assignment = assignment
        self.standardize_costs = standardize_costs
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = EM_INIT_STD[self.kind]
        with torch.no_grad():
            nn.init.trunc_normal_(self.weight, 0.0, std, -2.0 * std, 2.0 * std)
            self.beta_u.zero_()
            self.beta_a.zero_()

    def route(
        self, child: Tensor, act: Tensor, iterations: int, final_lambda: float | None = None
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """Child poses and activations -> parent poses (``[b, h, w, m, d]`` / ``[b, m, d]``),
        activations (``[b, h, w, m]`` / ``[b, m]``), and per iteration ``R`` (``[b, h, w, k,
        l, n, m]`` / ``[b, n, m]``), the parent poses and the parent activations.
        ``final_lambda`` overrides the layer's ``lambda_inf`` for this call."""
        xs, site = self.sites(child)  # [B, J, d_in]
        a_in = self.child_activations(act)  # [B, J]
        grid = None
        if self.kind == "conv" and self.assignment == "parents":
            grid = WindowGrid.of(act, self.kernel, self.stride)
        mu, a_out, rs, mus, acts = em_routing(
            self.votes(xs),
            a_in,
            self.beta_u,
            self.beta_a,
            iterations,
            self.final_lambda if final_lambda is None else final_lambda,
            grid=grid,
            standardize_costs=self.standardize_costs,
        )
        return (
            self.unsite(mu, site),
            self.unsite(a_out, site),
            [self.unsite_coefficients(r, site) for r in rs],
            [self.unsite(p, site) for p in mus],
            [self.unsite(a, site) for a in acts],
        )


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _check_iterations(iterations: int) -> None:
    if iterations < 1:
        raise ConfigError("model.iterations: must be >= 1")


class _BaselineNet(nn.Module):
    """Backbone, primary capsules, capsule layers, routing settings and parameter groups."""

    arch = ""
    output_kind = ""
    capsules: nn.ModuleList

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != self.arch:
            raise ConfigError(
                f"model.arch: {type(self).__name__} builds arch {self.arch!r}, got {cfg.arch!r}"
            )
        _check_iterations(cfg.iterations)
        self.config = cfg
        self.iterations = cfg.iterations
        self.routing = "sequential"
        self.backbone = build_backbone(cfg.backbone, cfg.in_channels)
        self.primary = PrimaryCapsules(
            BACKBONE_CHANNELS[cfg.backbone], cfg.primary_types, cfg.primary_dim, layer_norm=False
        )
        self._child_grids: list[tuple[int, int, int] | None] = []

    def _add_grid(self, item: dict[str, object]) -> None:
        g = item["in_grid"] if item["spec"].kind == "fc" else None  # type: ignore[attr-defined]
        self._child_grids.append((g, g, item["child_types"]) if g is not None else None)  # type: ignore[arg-type]

    def set_routing(self, iterations: int | None = None, mode: str | None = None) -> None:
        """Change T; ``mode`` may only be ``"sequential"`` (the only schedule these have)."""
        if iterations is not None:
            if iterations < 1:
                raise ValueError("iterations must be >= 1")
            self.iterations = iterations
        if mode is not None and mode != "sequential":
            if mode == "concurrent":
                raise ValueError(
                    f"{self.arch} routes layer by layer; only mode 'sequential' applies"
                )
            raise ValueError(f"unknown routing mode {mode!r}")

    def _new_trace(self) -> RoutingTrace:
        n = len(self.capsules)
        return RoutingTrace(
            coefficients=[[] for _ in range(n)],
            poses=[[] for _ in range(n)],
            kinds=[layer.kind for layer in self.capsules],
            child_grids=list(self._child_grids),
        )

    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts of the backbone and of the capsule part."""
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "backbone": backbone, "capsules": total - backbone}


class DynamicCapsNet(_BaselineNet):
    """Backbone -> squashed primary capsules -> dynamic-routing capsule layers -> lengths.

    Built from ``cfg.layers`` as :class:`CapsNet` is, with every pose a vector of the layer's
    ``pose_dim`` (a matrix spec becomes a vector of the same dim). The primary capsules are the
    main model's 1x1 convolution, squashed instead of LayerNorm-ed. ``forward`` returns
    ``logit_scale * |v_c|`` (``output_kind = "length"``; see the module docstring).
    """

    arch = "capsnet-dynamic"
    output_kind = "length"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.logit_scale = 1.0
        layers: list[nn.Module] = []
        for item in plan_layers(_as_vectors(cfg)):
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            layers.append(
                DynamicCapsules(
                    spec.kind,
                    item["in_types"],  # type: ignore[arg-type]
                    item["in_dim"],  # type: ignore[arg-type]
                    spec.types,
                    spec.pose_dim,
                    kernel=spec.kernel if spec.kind == "conv" else 1,
                    stride=spec.stride if spec.kind == "conv" else 1,
                )
            )
            self._add_grid(item)
        self.capsules = nn.ModuleList(layers)

    def class_poses(self, x: Tensor, trace: RoutingTrace | None = None) -> Tensor:
        """Class capsules ``v[b, classes, d]``, routing layer by layer."""
        child = squash(self.primary(self.backbone(x)))  # [b, h, w, n, d]
        for i, layer in enumerate(self.capsules):
            child, coeffs, poses = layer.route(child, self.iterations)
            if trace is not None:
                trace.coefficients[i] = [c.detach() for c in coeffs]
                trace.poses[i] = [p.detach() for p in poses]
        return child

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = self._new_trace() if trace else None
        v = self.class_poses(x, rt)  # [b, classes, d]
        out = torch.linalg.vector_norm(v, dim=-1) * self.logit_scale  # [b, classes]
        return (out, rt) if rt is not None else out


class EMCapsNet(_BaselineNet):
    """Backbone -> primary capsules (pose conv + sigmoid activation conv) -> EM-routing layers.

    Poses are matrices as in the main model (4x4 for pose dim 16; a vector spec is a ``1 x d``
    row). The primary capsules are the main model's 1x1 pose convolution (no LayerNorm) plus a
    1x1 convolution (with bias) to one sigmoid activation per capsule type. ``forward`` returns
    the class activations ``a_c`` (``output_kind = "activation"``).

    Routing knobs from the config: ``em_lambda`` (``lambda_inf`` of conv layers; FC layers,
    the class capsules included, use a quarter of it), ``em_assignment`` and
    ``em_standardize_costs`` (see :class:`EMCapsules`). The paper routes 3 times
    (``iterations = 3`` in the registered models).
    """

    arch = "capsnet-em"
    output_kind = "activation"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if not cfg.em_lambda > 0:
            raise ConfigError(f"model.em_lambda: must be > 0, got {cfg.em_lambda}")
        self.primary_act = nn.Conv2d(
            BACKBONE_CHANNELS[cfg.backbone], cfg.primary_types, kernel_size=1
        )
        layers: list[nn.Module] = []
        for item in plan_layers(cfg):
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            in_dim: int = item["in_dim"]  # type: ignore[assignment]
            rows, _ = pose_shape(in_dim, spec.pose)
            if spec.pose_dim % rows:
                raise ConfigError(f"model: pose dim {spec.pose_dim} is not a {rows}-row matrix")
            factor = EM_FC_LAMBDA_FACTOR if spec.kind == "fc" else 1.0
            layers.append(
                EMCapsules(
                    spec.kind,
                    item["in_types"],  # type: ignore[arg-type]
                    in_dim,
                    spec.types,
                    spec.pose_dim,
                    rows=rows,
                    kernel=spec.kernel if spec.kind == "conv" else 1,
                    stride=spec.stride if spec.kind == "conv" else 1,
                    final_lambda=cfg.em_lambda * factor,
                    assignment=cfg.em_assignment,
                    standardize_costs=cfg.em_standardize_costs,
                )
            )
            self._add_grid(item)
        self.capsules = nn.ModuleList(layers)

    def class_capsules(self, x: Tensor, trace: RoutingTrace | None = None) -> tuple[Tensor, Tensor]:
        """Class poses ``[b, classes, d]`` and activations ``[b, classes]``."""
        feats = self.backbone(x)  # [b, C, H, W]
        pose = self.primary(feats)  # [b, h, w, n, d]
        act = torch.sigmoid(self.primary_act(feats)).permute(0, 2, 3, 1)  # [b, h, w, n]
        for i, layer in enumerate(self.capsules):
            pose, act, rs, mus, _ = layer.route(pose, act, self.iterations)
            if trace is not None:
                trace.coefficients[i] = [r.detach() for r in rs]
                trace.poses[i] = [p.detach() for p in mus]
        return pose, act

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = self._new_trace() if trace else None
        _, act = self.class_capsules(x, rt)  # [b, classes]
        return (act, rt) if rt is not None else act


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------


def _as_vectors(cfg: ModelConfig) -> ModelConfig:
    layers = [dataclasses.replace(s, pose="vector") for s in cfg.layers]
    return cfg.replace(layers=layers, class_pose="vector")


def dynamic_config(base: ModelConfig) -> ModelConfig:
    """A copy of ``base`` for :class:`DynamicCapsNet`: arch ``capsnet-dynamic``, every pose a
    vector of the same dim, routing ``sequential`` (the only schedule dynamic routing has)."""
    cfg = _as_vectors(copy.deepcopy(base))
    return cfg.replace(arch="capsnet-dynamic", routing="sequential")


def em_config(base: ModelConfig) -> ModelConfig:
    """A copy of ``base`` for :class:`EMCapsNet`: arch ``capsnet-em``, routing ``sequential``,
    and matrix poses wherever the pose dim allows them (a square dim equal to the input's);
    other layers keep vector poses (``1 x d`` rows)."""
    cfg = copy.deepcopy(base)
    dim = cfg.primary_dim
    layers: list[CapsLayerSpec] = []
    for spec in cfg.layers:
        layers.append(dataclasses.replace(spec, pose=_em_pose(dim, spec.pose_dim)))
        dim = spec.pose_dim
    class_dim = cfg.class_pose_dim if cfg.class_pose_dim is not None else dim
    return cfg.replace(
        arch="capsnet-em",
        routing="sequential",
        layers=layers,
        class_pose=_em_pose(dim, class_dim),
    )


def _em_pose(in_dim: int, out_dim: int) -> str:
    if in_dim == out_dim and math.isqrt(in_dim) ** 2 == in_dim:
        return "matrix"
    return "vector"
