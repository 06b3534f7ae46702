"""Every pass of every bundled capsule model runs the compiled loops on a CPU, in float32 and
under bf16 autocast: a pass that silently falls back to the torch code (several times slower)
fails here, naming the model, the router and the reason the dispatch gave."""

from __future__ import annotations

import pytest
import torch
from conftest import require_native

from capsctl.config import build_model
from capsctl.layers.backend import dispatch
from capsctl.registry import get_config, list_models

ROUTERS = ("idpa", "dynamic", "em", "self")
# the registered capsule models, each with its own router (cifar10-dynamic, cifar100-em, ...)
REGISTERED = [n for n in list_models() if get_config(n).arch == "capsnet"]
# the models no registered name pairs with every router: each with the other routers
OTHERS = [("mnist-caps", r) for r in ROUTERS[1:]] + [("multimnist-caps", r) for r in ROUTERS[1:]]
CASES = [(n, None) for n in REGISTERED] + OTHERS
# the models small enough to step under autocast too in a few seconds (the large cifar100 ones
# have the same layer kinds as their cifar10 twins)
AUTOCAST = [case for case in CASES if not case[0].startswith("cifar100")]


@pytest.fixture(autouse=True)
def _native_required() -> None:
    require_native()


def _choices(name: str, router: str | None, amp: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every pass's plan in one training step (forward and backward, batch 2) of the model."""
    cfg = get_config(name)
    if router is not None:
        cfg = cfg.replace(router={"name": router})
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randn(2, cfg.in_channels, cfg.input_size, cfg.input_size)
    seen: list[dispatch.Choice] = []
    real = dispatch._chosen

    def spy(choice: dispatch.Choice) -> dispatch.Choice:
        seen.append(choice)
        return real(choice)

    monkeypatch.setattr(dispatch, "_chosen", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    out.float().sum().backward()
    return seen


def _slow(seen: list[dispatch.Choice]) -> list[str]:
    return sorted({f"{c.backend}: {c.reason}" for c in seen if c.backend != "native"})


@pytest.mark.parametrize(("name", "router"), CASES, ids=[f"{n}-{r or 'own'}" for n, r in CASES])
def test_every_pass_runs_the_compiled_loops_in_float32(
    name: str, router: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _choices(name, router, False, monkeypatch)
    assert not _slow(seen), f"{name} with router {router or 'its own'}: {_slow(seen)}"
    assert all(c.dtype is None for c in seen)


@pytest.mark.parametrize(
    ("name", "router"), AUTOCAST, ids=[f"{n}-{r or 'own'}" for n, r in AUTOCAST]
)
def test_every_pass_runs_the_compiled_loops_under_bf16_autocast(
    name: str, router: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The passes take autocast's bf16 activations and run the loops in float32."""
    seen = _choices(name, router, True, monkeypatch)
    assert not _slow(seen), f"{name} with router {router or 'its own'}: {_slow(seen)}"


def test_the_cases_cover_every_router_on_every_bundled_model() -> None:
    covered = {(name, router or str(get_config(name).router["name"])) for name, router in CASES}
    for base in ("mnist-caps", "multimnist-caps"):
        assert {(base, r) for r in ROUTERS} <= covered
    for family in ("cifar10", "cifar100"):
        for suffix in ("", "-simple"):
            models = {f"{family}-caps{suffix}"} | {f"{family}-{r}{suffix}" for r in ROUTERS[1:]}
            assert {n for n, _ in covered} >= models
