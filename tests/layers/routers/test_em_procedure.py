"""EM routing without the vote tensor (capsctl/layers/routers/em/procedure.py over
capsctl/layers/passes/em_moments.py): the chunked path gives the dense path's results and
gradients for every chunk size, and keeps no vote-sized tensor for the backward pass.

The dense path (``dispatch.use("dense")``) builds the votes whole and follows
Procedure 1 of Hinton, Sabour, Frosst, "Matrix capsules with EM routing" (ICLR 2018) line by
line; tests/layers/routers/test_dynamic_and_em.py checks it against loops written from the paper.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from capsctl.layers import dispatch
from capsctl.layers.routers.em.layer import EMCapsules

ITERATIONS = 3


def _layer(kind: str, n: int, m: int, **kw) -> EMCapsules:
    """A float64 layer with 2x2 poses, weights N(0, 0.5^2) and random betas."""
    layer = EMCapsules(kind, n, 4, m, 4, rows=2, **kw).double()
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.5)
        layer.beta_u.normal_(0.0, 0.5)
        layer.beta_a.normal_(0.0, 0.5)
    return layer


def _inputs(kind: str, n: int, b: int = 2, side: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    lead = (b, side, side, n) if kind == "conv" else (b, n)
    pose = (torch.randn(*lead, 4, dtype=torch.float64) + 0.7).requires_grad_()
    act = (torch.rand(*lead, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()
    return pose, act


def _run(layer: EMCapsules, pose: torch.Tensor, act: torch.Tensor) -> list[torch.Tensor]:
    """Outputs (poses, activations, every R, every mean, every activation) and the gradients
    of a fixed random-weighted loss of all of them, w.r.t. inputs and parameters."""
    mu, a_out, rs, mus, acts = layer.route(pose, act, ITERATIONS)
    outs = [mu, a_out, *rs, *mus, *acts]
    gen = torch.Generator().manual_seed(5)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    params = [pose, act, layer.weight, layer.beta_u, layer.beta_a]
    grads = torch.autograd.grad(loss, params)
    return [o.detach() for o in outs] + list(grads)


CASES = [
    ("fc", 5, 3, {}),
    ("fc", 1, 3, {}),
    ("fc", 4, 1, {}),
    ("conv", 2, 3, {"kernel": 3, "stride": 2}),
    ("conv", 1, 2, {"kernel": 2, "stride": 1}),
    ("conv", 2, 1, {"kernel": 3, "stride": 1}),
    ("conv", 2, 3, {"kernel": 3, "stride": 1, "assignment": "window"}),
    ("conv", 2, 1, {"kernel": 2, "stride": 1, "assignment": "window"}),
    ("conv", 2, 2, {"kernel": 2, "stride": 1, "standardize_costs": True}),
]


@pytest.mark.parametrize(("kind", "n", "m", "kw"), CASES)
@pytest.mark.parametrize("sites", [1, 3, 7, 1000])
def test_chunked_matches_dense(kind: str, n: int, m: int, kw: dict, sites: int) -> None:
    torch.manual_seed(3)
    layer = _layer(kind, n, m, **kw)
    pose, act = _inputs(kind, n)
    with dispatch.use("dense"):
        want = _run(layer, pose, act)
    with dispatch.use("chunked", sites=sites):
        got = _run(layer, pose, act)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_chunked_matches_dense_in_float32() -> None:
    """Moments about the mean vote: float32 keeps the dense path's digits (votes far from 0)."""
    torch.manual_seed(4)
    layer = EMCapsules("conv", 4, 16, 3, 16, rows=4, kernel=3, stride=2)
    pose = torch.randn(2, 7, 7, 4, 16) * 0.3 + 3.0
    act = torch.rand(2, 7, 7, 4) * 0.8 + 0.1
    with dispatch.use("dense"):
        mu_d, a_d, _, _, _ = layer.route(pose, act, ITERATIONS)
    with dispatch.use("chunked", sites=2):
        mu_c, a_c, _, _, _ = layer.route(pose, act, ITERATIONS)
    torch.testing.assert_close(mu_c, mu_d, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a_c, a_d, rtol=1e-4, atol=1e-5)


def _saving_case(
    kind: str, seed: int
) -> tuple[EMCapsules, torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """A layer of 6 child types routed to 5 parent types (conv: 3x3 kernel over a 6x6 grid, so
    4x4 sites of 54 children), batch 2, and its sizes ``(B, m, J)``."""
    torch.manual_seed(seed)
    n, m = 6, 5
    kw = {"kernel": 3, "stride": 1} if kind == "conv" else {}
    layer = _layer(kind, n, m, **kw)
    pose, act = _inputs(kind, n, b=2, side=6)
    sites = 2 * 4 * 4 if kind == "conv" else 2  # B
    children = n * 9 if kind == "conv" else n  # J
    return layer, pose, act, (sites, m, children)


@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_no_vote_sized_tensor_is_saved(kind: str) -> None:
    layer, pose, act, (sites, m, children) = _saving_case(kind, seed=6)
    vote_elems = sites * m * children * 4  # B * m * J * d
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mu, a_out, _, _, _ = layer.route(pose, act, ITERATIONS)
    assert saved, "the hook saw no saved tensor"
    assert max(saved) < vote_elems, (max(saved), vote_elems)
    with dispatch.use("dense"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.route(pose, act, ITERATIONS)
    assert max(saved) >= vote_elems  # the check can see a vote-sized tensor
    (mu.sum() + a_out.sum()).backward()
    assert pose.grad is not None and layer.weight.grad is not None


def test_float32_under_autocast() -> None:
    torch.manual_seed(7)
    layer = EMCapsules("fc", 6, 16, 3, 16, rows=4)
    pose, act = torch.randn(2, 6, 16), torch.rand(2, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mu, a_out, rs, _, _ = layer.route(pose.bfloat16(), act.bfloat16(), ITERATIONS)
    assert mu.dtype == a_out.dtype == rs[-1].dtype == torch.float32


@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_one_assignment_sized_tensor_is_saved_per_e_step(kind: str) -> None:
    """Per iteration the backward keeps the assignments ``R[B, m, J]`` and nothing else of
    their size: ``R a`` is formed chunk by chunk inside the moments, not saved in a second
    layout (at batch 128 that copy was about 1 GB of cifar10-em-simple's saved tensors)."""
    layer, pose, act, (sites, m, children) = _saving_case(kind, seed=8)
    coefficient_bytes = sites * m * children * 8  # B * m * J float64 entries
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() == coefficient_bytes:
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.route(pose, act, ITERATIONS)
    # the first R is uniform (an expanded row); the E-steps make ITERATIONS - 1 more
    assert len(storages) == ITERATIONS - 1, len(storages)


@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_the_m_step_is_recomputed_not_saved(kind: str) -> None:
    """The M-step's parent-sized intermediates (means, variances, their logs and inverses,
    about a dozen ``[B, m, d]`` tensors per iteration) are recomputed in the backward pass."""
    layer, pose, act, (sites, m, _) = _saving_case(kind, seed=9)
    parent_elems = sites * m * 4  # B * m * d
    counts = []
    for dense in (False, True):
        storages: set[int] = set()

        def pack(t: torch.Tensor, storages: set[int] = storages) -> torch.Tensor:
            if t.numel() == parent_elems:
                storages.add(t.untyped_storage().data_ptr())
            return t

        with contextlib.ExitStack() as stack:
            if dense:
                stack.enter_context(dispatch.use("dense"))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            mu, a_out, _, _, _ = layer.route(pose, act, ITERATIONS)
        counts.append(len(storages))
    assert counts[1] >= 2 * ITERATIONS, counts  # the check sees the dense path's intermediates
    # chunked: only the votes' shift s[B, d, m], a constant the moments are taken about
    assert counts[0] == 1, counts
    (mu.sum() + a_out.sum()).backward()  # and the recomputation runs
    assert layer.beta_u.grad is not None and layer.beta_a.grad is not None


def test_the_assignment_mass_and_its_gradients() -> None:
    """``mass_j = sum_i R_ij a_i`` (the M-step's denominator, an output of the moments' pass),
    values and gradients checked against finite differences, for a broadcast (expanded) first
    assignment too."""
    from capsctl.layers.passes.em_moments import VoteMoments

    torch.manual_seed(3)
    r = torch.rand(3, 5, 4, dtype=torch.float64, requires_grad=True)  # [B, J, m]
    a = torch.rand(3, 5, dtype=torch.float64, requires_grad=True)  # [B, J]
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64)  # [J, B, a, x]
    wc = torch.randn(5, 2, 2 * 4, dtype=torch.float64)  # [J, x, c*m]
    shift = torch.randn(3, 4, 4, dtype=torch.float64)  # [B, d, m]

    def mass(r: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return VoteMoments.apply(r, a, x, wc, shift)[1]  # [B, m, 1]

    want = torch.stack([(r[:, :, k] * a).sum(-1) for k in range(4)], 1).unsqueeze(-1)
    assert torch.allclose(mass(r, a), want)
    assert torch.autograd.gradcheck(mass, (r, a))
    assert torch.autograd.gradcheck(lambda r, a: VoteMoments.apply(r, a, x, wc, shift), (r, a))
    first = torch.full((3, 1, 1), 0.25, dtype=torch.float64).expand(3, 5, 4)
    assert torch.autograd.gradcheck(lambda a: mass(first, a), (a,))
